"""benchmarks/gpu_check.py runs on the CPU (--dry-run), so it is not broken when a GPU finally runs
it: every section gives a result, the kernels and the oracle pass. The default suite runs the
sections that need no model (about 10 s of CPU); the whole dry run (transformers and two model
loads on top, about 30 s) is marked slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import latentkv
from latentkv.config import KV_CACHE_DTYPES

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
SRC = str(Path(latentkv.__file__).resolve().parents[1])


def run_check(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )


def dry_run(tmp_path: Path, *args: str) -> dict:
    pytest.importorskip("triton")
    out = tmp_path / "gpu-check.json"
    done = run_check("--dry-run", "--out", str(out), *args, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["ok"]
    return result


def test_dry_run_of_the_kernel_sections(tmp_path):
    result = dry_run(tmp_path, "--only", "env,copy,codecs,kernels,bandwidth,weights")
    for name in ("env", "copy", "codecs", "kernels", "bandwidth", "weights"):
        assert "result" in result[name], (name, result[name])
    assert {r["tier"] for r in result["codecs"]["result"]} == set(KV_CACHE_DTYPES)
    assert all(r["ok"] and r["rows_with_identical_codes"] == 1.0 for r in result["codecs"]["result"])
    assert "oracle" not in result and "decode" not in result
    assert all(r["ok"] for r in result["kernels"]["result"])
    assert all(r["gb_per_s"] > 0 and r["share_of_copy"] > 0 for r in result["bandwidth"]["result"])
    assert {(r["format"], r["rows"]) for r in result["weights"]["result"]} == {
        (f, m) for f in ("bf16", "int8", "int4") for m in (1, 64)
    }
    assert all(r["ok"] for r in result["weights"]["result"])


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    result = dry_run(tmp_path)
    for name in ("env", "copy", "codecs", "kernels", "bandwidth", "weights", "oracle", "decode", "experts"):
        assert "result" in result[name], (name, result[name])
    assert {(r["precision"], r["mode"]) for r in result["kernels"]["result"]} == {
        ("ieee", "split-k"),
        ("bf16", "split-k"),
        ("ieee", "gather"),
    }
    assert all(r["ok"] for r in result["kernels"]["result"] + result["oracle"]["result"])
    assert all(r["gb_per_s"] > 0 and r["share_of_copy"] > 0 for r in result["bandwidth"]["result"])
    assert {r["weights"] for r in result["decode"]["result"]} == {"bf16", "int4"}
    _check_expert_rows(result["experts"]["result"])


def _check_expert_rows(rows: list[dict]) -> None:
    """bf16 and int4 weights: the resident model, then the VRAM cache over pinned host RAM and over
    the disk store (whose copies go through the staging ring), each decoding the resident tokens."""
    assert [(r["weights"], r["experts"], r.get("plan_home")) for r in rows] == [
        (w, kind, home)
        for w in ("bf16", "int4")
        for kind, home in (("resident", None), ("vram-cache", "pinned"), ("vram-cache", "disk"))
    ]
    for r in rows:
        assert r["tok_per_s"] > 0
        if r["experts"] == "vram-cache":
            c = r["cache"]
            assert 0 < c["slots"] < c["asked"] and c["misses"] > 0
            assert r["same_tokens_as_resident"] and r["ok"], r
    # on the CPU copies run in line: nothing is staged (on a GPU the disk rows stage every copy)
    assert all(r["cache"]["staged"] == 0 for r in rows if r["experts"] == "vram-cache")


def test_dry_run_of_the_vram_expert_cache_section(tmp_path):
    """The experts section alone (builtin:tiny in bf16 and int4, resident and through the VRAM
    cache from pinned host RAM and from the disk store: six short decodes)."""
    result = dry_run(tmp_path, "--only", "experts")
    _check_expert_rows(result["experts"]["result"])


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = run_check("--out", str(tmp_path / "x.json"), tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_check: torch sees no CUDA device; run with --dry-run on the CPU"
    ]
