"""benchmarks/experts.py in thesis mode on builtin:tiny (no cgroup, page cache kept): one RAM
budget, a long context filled with random rows, two KV tiers. The smaller tier's KV pool leaves
the expert cache exactly the bytes it saves, and both runs decode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "bench_experts_thesis", Path(__file__).parents[2] / "benchmarks" / "experts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_smaller_tier_hands_its_bytes_to_the_expert_cache(script, tmp_path, monkeypatch):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "thesis.json"
    base = ["builtin:tiny", "--no-limit", "--no-drop-caches", "--context", "1000", "--fill", "random"]
    args = script.main_args(base)
    free = script._plan(args, "f32", 1000, None)  # no budget: every part's size
    fixed = free.dense_bytes + free.kv_bytes + free.activation_bytes + free.working_bytes
    ram = (fixed + free.expert_bytes // 4) / 2**30  # f32 leaves a quarter of the experts a cache
    argv = base + ["--ram-gb", repr(ram), "--tiers", "f32,tq4-r8", "--tokens", "2", "--out", str(out)]
    assert script.main(argv) == 0
    rows = json.loads(out.read_text())["runs"]
    assert [r["tier"] for r in rows] == ["f32", "tq4-r8"] and all("error" not in r for r in rows)
    f32, tq4 = (script._plan(args, t, 1000, int(ram * 2**30)) for t in ("f32", "tq4-r8"))
    assert 0 < tq4.kv_bytes < f32.kv_bytes and rows[0]["budget"] < free.expert_bytes
    assert rows[1]["budget"] - rows[0]["budget"] == f32.kv_bytes - tq4.kv_bytes
    assert all(r["tok_s"] > 0 and r["decode"]["asked"] > 0 for r in rows)
    cmd = script._child_cmd(script.main_args(argv), 1 << 20, "f32", 998)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False)) | dict(zip(cmd[4::2], cmd[5::2], strict=False))
    assert flags["--filled"] == str(998 - script.RANDOM_FILL_PROMPT)  # random rows, not a prefill
    assert flags["--prompt-len"] == str(script.RANDOM_FILL_PROMPT)


def test_random_fill_cannot_go_with_llamacpp(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["builtin:tiny", "--fill", "random", "--llamacpp", "x.gguf"])
    assert "--fill random cannot be combined" in capsys.readouterr().err
