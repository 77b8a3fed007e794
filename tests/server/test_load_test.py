"""benchmarks/load_test.py end to end: it starts its own server, drives it with concurrent
streaming clients in rounds and writes rows whose token counts are what was asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_test_starts_a_server_and_reports_rows(tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "load_test.py"), "--serve", "builtin:tiny"]
    cmd += ["--serve-flags", "--threads 1", "--max-num-seqs", "2", "--clients", "1,2", "--requests", "4"]
    cmd += ["--max-tokens", "5", "--rounds", "2", "--quiet", "--out", str(out)]
    if hasattr(os, "sched_getaffinity"):
        cmd += ["--client-cpus", str(min(os.sched_getaffinity(0)))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["max_num_seqs"], r["clients"]) for r in rows] == [(2, 1), (2, 2)]
    for r in rows:
        assert (r["requests"], r["errors"], r["tokens"]) == (8, 0, 40)  # 2 rounds of 4 requests
        assert len(r["round_tok_s"]) == 2 and min(r["round_tok_s"]) <= r["tok_s"] <= max(r["round_tok_s"])
        assert r["ttft_ms"]["p50"] is not None
    table = done.stdout.splitlines()
    assert "tok/s" in table[0] and len([line for line in table if line.split()[:1] == ["2"]]) == 2
