"""The streamed store under a real memory limit (a child cgroup that counts page cache): with a
small budget it streams a store several times its limit without being OOM-killed; the same run
with a budget of the whole store, under the same limit, is killed (so the limit is real and the
budget is what keeps the process under it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from latentkv.experts import memlimit
from latentkv.experts.base import Expert
from latentkv.streaming.convert import write_store
from latentkv.weights.base import make_linear

CHILD = Path(__file__).with_name("memlimit_child.py")
FP = "m" * 64
MIB = 1 << 20
D, I, E, LAYERS = 256, 340, 32, (1, 2, 3)  # f32 experts of ~1 MiB: a 96 MiB store
BUDGET = 16 * MIB
WORKING = (
    10 * MIB
)  # one get's experts that did not fit (4) + prefetch in flight (<= 8 experts' worth, 4 asked)
MARGIN = 32 * MIB  # allocator slack and the reader's buffers in flight


def _store(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)

    def make(e: int) -> Expert:
        return Expert(
            make_linear(torch.randn(2 * I, D, generator=g), "f32"),
            make_linear(torch.randn(D, I, generator=g), "f32"),
        )

    d = tmp_path / "experts"
    write_store(d, FP, [(layer, E, make) for layer in LAYERS])
    return d


def _run(d: Path, budget: int, limit: int, *extra: str) -> memlimit.LimitedRun:
    cmd = [sys.executable, str(CHILD), str(d), FP, str(budget), "2", *extra]
    return memlimit.run_limited(cmd, limit, timeout=300)


@pytest.mark.slow
def test_streaming_stays_under_a_real_memory_limit(tmp_path):
    reason = memlimit.unavailable()
    if reason:
        pytest.skip(reason)
    d = _store(tmp_path)
    store_bytes = sum(f.stat().st_size for f in d.glob("*.lkx"))
    base = _run(d, BUDGET, 8 << 30, "baseline")
    assert base.returncode == 0, base.stderr
    limit = base.peak_bytes + BUDGET + WORKING + MARGIN
    assert store_bytes > BUDGET + WORKING + MARGIN + 32 * MIB  # keeping it all would not fit

    ok = _run(d, BUDGET, limit)
    assert ok.returncode == 0 and ok.oom_kills == 0, ok.stderr[-2000:]
    stats = json.loads(ok.stdout.strip().splitlines()[-1])
    assert stats["bytes_read"] >= store_bytes  # it really streamed (every expert, twice, minus hits)
    assert stats["resident_bytes"] <= BUDGET
    assert 0 < ok.peak_bytes <= limit

    greedy = _run(d, store_bytes, limit)  # keeps every expert it reads: must hit the limit
    assert greedy.returncode != 0 and (greedy.oom_kills >= 1 or greedy.returncode in (-9, 137)), (
        greedy.returncode,
        greedy.oom_kills,
        greedy.stderr[-500:],
    )


@pytest.mark.slow
def test_the_planner_default_sees_the_cgroup_limit(tmp_path):
    reason = memlimit.unavailable()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "avail.py"
    script.write_text(
        "from latentkv.streaming.planner import available_memory\nprint(*available_memory(), sep='|')\n"
    )
    run = memlimit.run_limited([sys.executable, str(script)], 3 << 30, timeout=300)
    assert run.returncode == 0, run.stderr[-1000:]
    limit, source = run.stdout.strip().split("|")
    assert int(limit) == 3 << 30 and source == "the cgroup memory limit"
