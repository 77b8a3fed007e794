"""The oracle per KV tier: transformers once per model, our engine once per tier, f32 the gate."""

from __future__ import annotations

import json

import pytest

from latentkv.cli import main
from latentkv.config import CacheConfig
from latentkv.eval import oracle

ROW_KEYS = {
    "name",
    "kv_cache_dtype",
    "weight_dtype",
    "tf",
    "greedy",
    "greedy_prefix",
    "max_abs_logit_diff",
    "reference_matches",
    "seconds",
    "ok",
}


@pytest.fixture(autouse=True)
def clean_kv_env(monkeypatch):
    for name in ("KV8", "KV_TQ", "KV_TQ_POLAR"):
        monkeypatch.delenv(name, raising=False)


def _oracle(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = main(["oracle", "--model", "glm5-tiny", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out)


def test_rows_are_model_by_tier_and_f32_stays_exact(capsys):
    code, rows = _oracle(capsys, "--kv-cache-dtype", "fp8,tq4,polar4")
    assert code == 0
    assert [(r["name"], r["kv_cache_dtype"]) for r in rows] == [
        ("glm5-tiny", "f32"),  # the gate always runs, first
        ("glm5-tiny", "fp8"),
        ("glm5-tiny", "tq4"),
        ("glm5-tiny", "polar4"),
    ]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["reference_matches"]
        hits, total = map(int, r["tf"].split("/"))
        assert total == 32 and 0 <= hits <= 32
        hits, total = map(int, r["greedy"].split("/"))
        assert total == 20 and r["greedy_prefix"] <= hits
    f32 = rows[0]
    assert f32["ok"] is True and f32["tf"] == "32/32" and f32["greedy"] == "20/20"
    assert f32["greedy_prefix"] == 20 and f32["max_abs_logit_diff"] <= 1e-4
    for r in rows[1:]:
        assert r["ok"] is None  # lossy tiers are reported, never gated
        assert r["max_abs_logit_diff"] > 1e-4


def test_no_flag_is_f32_only_as_before(capsys):
    code, rows = _oracle(capsys)
    assert code == 0
    assert [r["kv_cache_dtype"] for r in rows] == ["f32"]
    code = main(["oracle", "--model", "glm5-tiny"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0].split() == [
        "model",
        "tf",
        "greedy",
        "max_abs_logit_diff",
        "reference",
        "result",
    ]
    assert out.splitlines()[1].split()[:3] == ["glm5-tiny", "32/32", "20/20"]


def test_the_tier_table(capsys):
    code = main(["oracle", "--model", "glm5-tiny", "--kv-cache-dtype", "bf16"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[0].split()[:3] == ["model", "kv", "tf"]
    assert lines[1].split()[:2] == ["glm5-tiny", "f32"] and lines[1].endswith("ok")
    assert lines[2].split()[:2] == ["glm5-tiny", "bf16"] and lines[2].endswith("-")


def test_transformers_runs_once_per_model_and_our_engine_once_per_tier(monkeypatch, checkpoint):
    calls = {"hf": 0, "ours": []}
    real_hf, real_ours = oracle.hf_reference, oracle.ours

    def hf(*args, **kwargs):
        calls["hf"] += 1
        return real_hf(*args, **kwargs)

    def ours(model, prompt, sequence, cache=None):
        calls["ours"].append(cache.kv_cache_dtype)
        return real_ours(model, prompt, sequence, cache)

    monkeypatch.setattr(oracle, "hf_reference", hf)
    monkeypatch.setattr(oracle, "ours", ours)
    caches = [CacheConfig(t) for t in ("f32", "bf16", "tq3")]
    rows = oracle.check_tiers(oracle.SPECS["glm5-tiny-dsa"], checkpoint("glm5-tiny-dsa"), None, caches)
    assert calls == {"hf": 1, "ours": ["f32", "bf16", "tq3"]}
    assert [r.kv_cache_dtype for r in rows] == ["f32", "bf16", "tq3"]
    assert rows[0].ok and rows[0].tf == "32/32" and rows[0].greedy == "20/20"


def test_only_an_f32_failure_fails_the_command(monkeypatch, capsys):
    real = oracle.ours

    def nudged(model, prompt, sequence, cache=None):
        greedy, logits = real(model, prompt, sequence, cache)
        if cache.kv_cache_dtype == target:
            logits = logits.clone()
            logits[3, 7] += 10 * oracle.LOGIT_TOLERANCE
        return greedy, logits

    monkeypatch.setattr(oracle, "ours", nudged)
    target = "tq4"  # a lossy tier that drifts: reported, exit 0
    code, rows = _oracle(capsys, "--kv-cache-dtype", "f32,tq4")
    assert code == 0 and [r["ok"] for r in rows] == [True, None]
    target = "f32"  # the gate drifts: exit 1
    code, rows = _oracle(capsys, "--kv-cache-dtype", "f32,tq4")
    assert code == 1 and [r["ok"] for r in rows] == [False, None]


def test_the_environment_alias_adds_its_tier_to_the_gate(monkeypatch, capsys):
    monkeypatch.setenv("KV8", "1")
    code, rows = _oracle(capsys)
    assert code == 0
    assert [r["kv_cache_dtype"] for r in rows] == ["f32", "fp8"]


def test_weight_formats_report_beside_the_f32_gate(checkpoint):
    caches = [CacheConfig("f32")]
    rows = oracle.check_tiers(
        oracle.SPECS["glm5-tiny"], checkpoint("glm5-tiny"), None, caches, "f32", ("int8", "int4")
    )
    assert [(r.weight_dtype, r.kv_cache_dtype) for r in rows] == [
        ("f32", "f32"),
        ("int8", "f32"),
        ("int4", "f32"),
    ]
    assert rows[0].ok is True and rows[1].ok is None and rows[2].ok is None  # only f32 gates
    # quantized weights move the logits, int4 more than int8, yet stay close to the reference
    assert 0 < rows[1].max_abs_logit_diff < rows[2].max_abs_logit_diff < 1.0
