"""The decode kernel compiles for real GPUs (sm_90: H100 / H200; sm_120: RTX 5090), on this CPU.

The interpreter that runs the arithmetic tests checks no types or layouts (it multiplied a
bfloat16 by a float32 operand without complaint, which the compiler refuses), so the compiled
path is checked here: triton's compiler and ptxas, from the triton wheel, run without a GPU.
They run in a child process (benchmarks/triton_compile.py): under TRITON_INTERPRET=1, which this
directory sets, triton decorates even its own library for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import latentkv

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_compile.py"
SRC = str(Path(latentkv.__file__).resolve().parents[1])


def compile_report(tmp_path: Path, *args: str) -> list[dict]:
    pytest.importorskip("triton")
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=SRC, TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_compiles_for_an_h200_at_small_widths(tmp_path):
    rows = compile_report(tmp_path, "--arch", "90", "--tiers", "fp8,q4s,tq4-r8", "--widths", "32,8")
    assert [r["tier"] for r in rows] == ["fp8", "q4s", "tq4-r8"]
    assert all(r["registers"] > 0 and r["shared_bytes"] > 0 and r["arch"] == 90 for r in rows)


@pytest.mark.slow
def test_compiles_at_glm5_widths_without_spills_for_the_main_tiers(tmp_path):
    rows = {r["tier"]: r for r in compile_report(tmp_path, "--arch", "90")}
    for tier in ("bf16", "fp8", "q8s", "q4s"):
        assert rows[tier]["stack_bytes"] == 0, rows[tier]
    assert len(compile_report(tmp_path, "--arch", "120")) == len(rows)  # an RTX 5090 too
