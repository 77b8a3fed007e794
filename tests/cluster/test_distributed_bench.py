"""benchmarks/distributed.py's arithmetic, on made-up telemetry (the runs themselves need root,
cgroups and network namespaces: `benchmarks/distributed.py` on the experts benchmark model).
Expected values are worked out here from the definitions in its docstring."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "bench_distributed", Path(__file__).parents[2] / "benchmarks" / "distributed.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, bytes_read: int, sent: int, wait: float = 0.0) -> dict:
    return {"rank": rank, "bytes_read": bytes_read, "bytes_sent": sent, "net_wait_seconds": wait, "hit_rate": 0.5,
            "recall": 0.8, "read_gbps": 0.4}  # fmt: skip


def test_bounds_and_exchange_cost(script):
    args = argparse.Namespace(rank_gbps=0.5, lan_mbit=1000, lan_latency_ms=0.2)
    ranks = [
        _rank(0, 200_000_000, 10 * 120_000, 0.5),
        _rank(1, 400_000_000, 10 * 200_000),
        _rank(2, 100_000_000, 10 * 100_000),
    ]
    row = script.summarize(
        args, {"tok_s": 2.0, "tokens": 10, "seconds": 5.0, "ranks": ranks, "peaks": [1, 2, 3]}, moe_layers=3
    )
    assert row["read_bytes_per_token"] == [20e6, 40e6, 10e6]
    assert row["disk_bound_tok_s"] == pytest.approx(0.5e9 / 40e6)  # the rank that reads most sets it
    assert row["exchange_bytes_per_token"] == pytest.approx(120_000 + 300_000)
    # the busier direction of the head's link at 1 Gbit/s, plus one round trip per MoE layer
    assert row["exchange_s_per_token_1gbe"] == pytest.approx(300_000 * 8 / 1e9 + 3 * 0.2e-3)
    assert row["exchange_share_of_token"] == pytest.approx(row["exchange_s_per_token_1gbe"] * 2.0)
    assert row["head_net_wait_ms_per_token"] == pytest.approx(50.0)
    text = script.table([row], {3: 1.5}, one=1.0)
    assert "| 3 | 2.00 | 2.00x | 12.50 | 1.50 | 133% |" in text  # bound by the cores (1.5 < 12.5)
    assert "| 0.04/0.08/0.02 |" in text  # GB/s read: each rank's bytes over the timed 5 s


def test_telemetry_deltas_cover_only_the_timed_steps(script):
    before = [
        {
            "rank": 0,
            "asked": 10,
            "hits": 4,
            "bytes_read": 100,
            "read_seconds": 1.0,
            "predicted": 5,
            "recalled": 1,
        }
    ]
    after = [
        {
            "rank": 0,
            "asked": 30,
            "hits": 19,
            "bytes_read": 2100,
            "read_seconds": 2.0,
            "predicted": 25,
            "recalled": 17,
        }
    ]
    (d,) = script._delta(before, after)
    assert (d["asked"], d["hits"], d["hit_rate"]) == (20, 15, 0.75)
    assert d["recall"] == pytest.approx(16 / 20) and d["read_gbps"] == pytest.approx(2000 / 1.0 / 1e9)
