"""`latentkv plan --nodes N`: each rank's budget, share and reads, the cluster's disk bound; the
GLM-5 numbers docs/distributed.md and the README quote, from zai-org/GLM-5's config.json alone."""

from __future__ import annotations

import json

import pytest

from latentkv.cli import main
from latentkv.eval.kvstats import GLM5_CONFIG


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm5")
    cfg = {**GLM5_CONFIG, "num_nextn_predict_layers": 1, "eos_token_id": [154820], "hidden_act": "silu"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_glm5_int4_on_four_64_gb_machines(glm5, capsys):
    argv = ["plan", str(glm5), "--nodes", "4", "--ram-gb", "64", "--disk-gbps", "3", "--weight-dtype", "int4"]
    assert main([*argv, "--max-model-len", "32768", "--kv-cache-dtype", "tq4-r8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    ranks = plan["ranks"]
    # every routed expert of the 75 MoE layers and the MTP layer is owned exactly once
    assert sum(r["experts"] for r in ranks) == 76 * 256
    owners = plan["placement"]["owners"]
    for row in owners.values():
        counts = [row.count(r) for r in range(4)]
        assert max(counts) - min(counts) <= 16  # every rank holds a share of every layer
    # workers hold no dense weights or KV: more cache than the head, so more experts
    assert ranks[0]["resident_bytes"] > 10 * 2**30 and all(
        r["resident_bytes"] == 512 << 20 for r in ranks[1:]
    )
    assert ranks[0]["experts"] < ranks[1]["experts"]
    # the numbers the docs quote
    assert round(plan["disk_bound_tok_s"], 2) == 2.26 and round(plan["single_disk_bound_tok_s"], 2) == 0.27
    assert round(plan["exchange_seconds_per_token"] * 1e3) == 106
    # the bound is the slowest owner, layer by layer: never above what each rank alone allows
    slowest = max(r["expected_bytes_per_token"] / (r["disk_gbps"] * 1e9) for r in ranks)
    assert plan["disk_bound_tok_s"] <= 1 / slowest
