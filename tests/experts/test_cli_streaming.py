"""`--ram-gb` on generate: the experts stream from a store converted on first use, the tokens
are those of the resident run, the telemetry is reported; bad budgets exit 2."""

from __future__ import annotations

import json

from latentkv.cli import main


def _generate(capsys, *extra: str) -> dict:
    argv = ["generate", "builtin:fixture", "--prompt-ids", "5,17,99,3", "--max-tokens", "6", "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_with_ram_gb_streams_and_matches_resident(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    resident = _generate(capsys)
    streamed = _generate(capsys, "--ram-gb", "1", "--expert-cache-policy", "lfu")
    assert streamed["tokens"] == resident["tokens"]
    t = streamed["experts"]
    assert t["asked"] > 0 and t["bytes_read"] > 0 and t["resident_bytes"] <= t["budget"]
    assert "experts" not in resident
    assert list(tmp_path.glob("experts/*/manifest.json"))  # converted once, into the user cache
    again = _generate(capsys, "--ram-gb", "1")
    assert again["tokens"] == resident["tokens"]


def test_bad_ram_budgets_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    base = ["generate", "builtin:fixture", "--prompt-ids", "1,2", "--max-tokens", "1"]
    assert main([*base, "--ram-gb", "0"]) == 2
    assert main([*base, "--ram-gb", "0.001"]) == 2
    assert "latentkv plan" in capsys.readouterr().err


SNAPSHOT = {  # an expert streamer's snapshot, as /metrics reads it
    "asked": 10,
    "hits": 7,
    "misses": 2,
    "prefetched": 1,
    "bytes_read": 12288,
    "hit_rate": 0.7,
    "recall": 0.5,
    "read_gbps": 1.5,
    "resident_bytes": 4096,
    "budget": 8192,
}


def test_metrics_report_expert_streaming():
    from latentkv.engine.request import SchedulerStats
    from latentkv.server.metrics import render

    stats = SchedulerStats(1, 0, 5, 6, 100, 1000, "f32", experts=SNAPSHOT)
    text = render("m", True, stats, (0.0, 0.0))
    assert "latentkv_expert_hit_rate" in text and "latentkv_expert_cache_budget_bytes" in text
    lines = {
        line.split("{")[0].split(" ")[0]: line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith("latentkv_expert")
    }
    assert (
        float(lines["latentkv_expert_hits_total"]) == 7
        and float(lines["latentkv_expert_read_bytes_total"]) == 12288
    )
    plain = render("m", True, SchedulerStats(1, 0, 5, 6, 100, 1000, "f32"), (0.0, 0.0))
    assert "latentkv_expert" not in plain


def test_metrics_split_the_draft_layers_hit_rate():
    from latentkv.engine.request import SchedulerStats
    from latentkv.server.metrics import render

    snapshot = {
        **SNAPSHOT,
        "draft_asked": 4,
        "draft_hits": 4,
        "draft_hit_rate": 1.0,
        "main_hit_rate": 0.5,
    }
    stats = SchedulerStats(1, 0, 5, 6, 100, 1000, "f32", experts=snapshot)
    values = {
        line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in render("m", True, stats, (0.0, 0.0)).splitlines()
        if line.startswith("latentkv_expert")
    }
    assert values["latentkv_expert_draft_hit_rate"] == 1.0 and values["latentkv_expert_main_hit_rate"] == 0.5
    assert values["latentkv_expert_draft_requests_total"] == 4
    plain = SchedulerStats(1, 0, 5, 6, 100, 1000, "f32", experts={**snapshot, "draft_asked": 0})
    assert "latentkv_expert_draft" not in render("m", True, plain, (0.0, 0.0))
