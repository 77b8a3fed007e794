"""/metrics through prometheus_client: the request histograms, observed as events arrive.

The timer is checked with explicit clock readings (no sleeping); tests/server/test_api.py checks
that the live server's histograms move by what requests of known size must add.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from latentkv.engine.request import Finished, SchedulerStats
from latentkv.server.metrics import Metrics, Snapshot, length_buckets


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_length_buckets_are_one_two_five():
    assert length_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert length_buckets(7) == (1, 2, 5)


def test_a_timer_observes_each_histogram():
    metrics = Metrics("m")
    timer = metrics.timer()
    timer.submitted = 100.0
    timer.token(now=100.5)  # first token after 0.5 s
    timer.token(now=100.625)  # gaps of 0.125 and 0.375 s (exact in binary)
    timer.token(now=101.0)
    done = Finished("length", 7, 3, 0, None, prefill_seconds=0.25, decode_seconds=0.4, queued_seconds=0.125)
    timer.finish(done, "length", now=101.5)
    timer.finish(done, "length", now=102.0)  # once only
    s = _samples(metrics.render()[0].decode())
    assert _value(s, "latentkv_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _value(s, "latentkv_time_to_first_token_seconds_count") == 1
    assert _value(s, "latentkv_inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert _value(s, "latentkv_inter_token_latency_seconds_count") == 2
    assert _value(s, "latentkv_inter_token_latency_seconds_bucket", le="0.1") == 0
    assert _value(s, "latentkv_inter_token_latency_seconds_bucket", le="0.15") == 1
    assert _value(s, "latentkv_inter_token_latency_seconds_bucket", le="0.3") == 1
    assert _value(s, "latentkv_inter_token_latency_seconds_bucket", le="0.4") == 2
    assert _value(s, "latentkv_e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    assert _value(s, "latentkv_request_queue_time_seconds_sum") == 0.125
    assert _value(s, "latentkv_request_prefill_time_seconds_sum") == 0.25
    assert _value(s, "latentkv_request_decode_time_seconds_sum") == 0.4
    assert _value(s, "latentkv_request_prompt_tokens_sum") == 7
    assert _value(s, "latentkv_request_prompt_tokens_bucket", le="5.0") == 0
    assert _value(s, "latentkv_request_prompt_tokens_bucket", le="10.0") == 1
    assert _value(s, "latentkv_request_generation_tokens_sum") == 3
    assert _value(s, "latentkv_request_success_total", finished_reason="length") == 1


def test_a_stop_token_first_still_counts_a_first_token_and_refusals_count_nothing():
    metrics = Metrics("m")
    timer = metrics.timer()
    timer.submitted = 10.0
    timer.finish(Finished("stop", 3, 1, 0, None), "stop", now=10.25)
    refused = metrics.timer()
    refused.finish(Finished("error", 3, 0, 0, None, refused="queue_full"), "error")
    s = _samples(metrics.render()[0].decode())
    assert _value(s, "latentkv_time_to_first_token_seconds_sum") == 0.25
    assert _value(s, "latentkv_e2e_request_latency_seconds_count") == 1
    assert _value(s, "latentkv_request_success_total", finished_reason="stop") == 1


def test_the_engine_state_is_read_at_each_scrape():
    state = {"stats": None}
    metrics = Metrics("m", lambda: Snapshot(state["stats"] is not None, state["stats"], (1.5, 2.5)))
    s = _samples(metrics.render()[0].decode())
    assert _value(s, "latentkv_model_loaded") == 0
    assert not [k for k in s if k[0] == "latentkv_requests_running"]
    state["stats"] = SchedulerStats(2, 1, 50, 60, 250, 1000, "tq4")
    s = _samples(metrics.render()[0].decode())
    assert _value(s, "latentkv_model_loaded", model_name="m") == 1
    assert _value(s, "latentkv_requests_running") == 2 and _value(s, "latentkv_requests_waiting") == 1
    assert _value(s, "latentkv_prompt_tokens_total") == 50
    assert _value(s, "latentkv_generation_tokens_per_second") == 2.5
    assert _value(s, "latentkv_kv_cache_bytes", tier="tq4") == 250
    assert _value(s, "latentkv_kv_cache_usage_perc") == 0.25


def test_openmetrics_when_asked():
    body, content_type = Metrics("m").render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
