"""`eval ppl`: one-pass window scoring equals token-by-token decode over the same tier; the
per-window statistics against float64 references; the CLI's JSON and its errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from latentkv.cli import main
from latentkv.config import CacheConfig
from latentkv.eval import ppl

# Prefill and decode over one tier store bit-identical rows (each row is encoded alone) and differ
# only in float32 summation order; the logits of the tiny models are O(1), so 1e-4 is ample.
DECODE_ATOL = 1e-4


def _ids(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids: torch.Tensor, tier: CacheConfig) -> torch.Tensor:
    cache = model.make_cache(model.tier(tier))
    return torch.cat([model.forward(ids[t : t + 1], cache) for t in range(ids.shape[0])])


# glm5-tiny-dsa selects index_topk 8 of the 24 tokens, so DSA's selection is exercised too.
@pytest.mark.parametrize("name", ["glm5-tiny", "glm5-tiny-dsa"])
@pytest.mark.parametrize("tier", ["f32", "bf16", "fp8", "tq4", "polar4"])
def test_window_scoring_equals_token_by_token_decode(tier, name, ours):
    model = ours(name)
    ids = _ids(24, seed=len(tier) + 13 * len(name))
    cache = CacheConfig(tier)
    one_pass = ppl.score_window(model, ids, model.tier(cache))
    stepped = _decode(model, ids, cache)
    assert one_pass.shape == stepped.shape == (24, model.cfg.vocab_size)
    torch.testing.assert_close(one_pass, stepped, rtol=0, atol=DECODE_ATOL)
    if tier != "f32":  # the tier is really in the path: its logits are not the f32 cache's
        assert float((one_pass - ppl.score_window(model, ids, model.tier())).abs().max()) > 1e-5

    # the window's NLL from the one pass against a float64 reference over the decoded logits
    reference = ppl.score_window(model, ids, model.tier())[:-1]
    score = ppl.compare(reference, one_pass[:-1], ids[1:])
    log_q = torch.log_softmax(stepped[:-1].double(), dim=-1)
    assert score.nll == pytest.approx(float(-log_q[torch.arange(23), ids[1:]].sum()), abs=1e-3)


def test_compare_against_a_float64_reference():
    g = torch.Generator().manual_seed(5)
    p_logits, q_logits = torch.randn(300, 50, generator=g) * 3, torch.randn(300, 50, generator=g) * 3
    targets = torch.randint(0, 50, (300,), generator=g)
    s = ppl.compare(p_logits, q_logits, targets)  # 300 rows: crosses the ROW_CHUNK of 256
    p = np.exp(p_logits.double().numpy())
    p /= p.sum(1, keepdims=True)
    q = np.exp(q_logits.double().numpy())
    q /= q.sum(1, keepdims=True)
    assert s.kl == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-9)
    assert s.nll == pytest.approx(float(-np.log(q[np.arange(300), targets.numpy()]).sum()), rel=1e-9)
    assert s.agree == int((p.argmax(1) == q.argmax(1)).sum())

    same = ppl.compare(p_logits, p_logits.clone(), targets)
    assert same.kl == 0.0 and same.agree == 300


def test_windows_are_non_overlapping_and_spread_evenly():
    ids = list(range(1000))
    w = ppl.make_windows(ids, 64)
    assert w.shape == (15, 64)  # the 40-token tail is dropped
    assert torch.equal(w.flatten(), torch.arange(960))
    picked = ppl.make_windows(ids, 64, max_windows=3)
    assert [int(r[0]) for r in picked] == [0, 7 * 64, 14 * 64]  # first, middle, last
    with pytest.raises(ValueError, match="fewer than one window"):
        ppl.make_windows(ids[:50], 64)


def test_default_contexts():
    assert ppl.default_contexts(4096) == [256, 1024]
    assert ppl.default_contexts(1024) == [256, 1024]
    assert ppl.default_contexts(512) == [256, 512]
    assert ppl.default_contexts(128) == [128]


def test_score_context_and_summary(ours):
    model = ours("glm5-tiny")
    windows = ppl.make_windows(_ids(6 * 32, seed=3).tolist(), 32)
    tiers = [CacheConfig("fp8"), CacheConfig("tq3")]  # f32 joins as the reference
    scores = ppl.score_context(model, windows, tiers)
    summary = ppl.summarize(scores, model.layout, resamples=300, seed=1)
    rows = {r["tier"]: r for r in summary["tiers"]}
    assert list(rows) == ["f32", "fp8", "tq3"]
    assert summary["tokens_scored"] == 6 * 31 and summary["windows"] == 6

    f32 = rows["f32"]
    assert f32["kld"] == 0.0 and f32["top1"] == 1.0 and f32["delta_ppl_pct"] == 0.0
    assert f32["delta_ppl_pct_ci"] == [0.0, 0.0] and f32["kld_ci"] == [0.0, 0.0]
    assert f32["bytes_per_token_layer"] == 4 * (32 + 8)
    # ppl from the per-window sums, recomputed from logits by hand
    total = 0.0
    for w in windows:
        log_q = torch.log_softmax(ppl.score_window(model, w, model.tier()).double(), dim=-1)
        total -= float(log_q[torch.arange(31), w[1:]].sum())
    assert f32["ppl"] == pytest.approx(np.exp(total / (6 * 31)), rel=1e-9)
    for r in rows.values():
        lo, hi = r["ppl_ci"]
        assert lo <= r["ppl"] <= hi
    assert rows["tq3"]["kld"] > rows["fp8"]["kld"] > 0  # 3 bits distort more than 8
    assert rows["tq3"]["top1"] < 1.0
    assert rows["tq3"]["bytes_per_token_layer"] < rows["fp8"]["bytes_per_token_layer"] < 160


def test_one_window_has_no_interval(ours):
    model = ours("glm5-tiny")
    scores = ppl.score_context(model, ppl.make_windows(_ids(16, seed=4).tolist(), 16), [CacheConfig("fp8")])
    summary = ppl.summarize(scores, model.layout)
    assert all(r["ppl_ci"] is None for r in summary["tiers"])


def test_unigram_baseline_by_hand(tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps([3, 1, 0]))
    counts = ppl.load_token_counts(path, vocab_size=3)
    # add-one: p = (4/7, 2/7, 1/7); ppl over targets [0, 1, 2] = 7 / 8^(1/3) = 3.5
    assert ppl.unigram_ppl(counts, [torch.tensor([0, 1]), torch.tensor([2])]) == pytest.approx(3.5)
    assert len(ppl.load_token_counts(path, vocab_size=5)) == 5  # ids past the list: count 0
    path.write_text(json.dumps({"0": 3}))
    with pytest.raises(ValueError, match="JSON list"):
        ppl.load_token_counts(path, 3)


# --- the CLI ---------------------------------------------------------------------------------

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 12


@pytest.fixture(autouse=True)
def _no_kv_env(monkeypatch):
    for name in ("KV8", "KV_TQ", "KV_TQ_POLAR"):
        monkeypatch.delenv(name, raising=False)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", "ppl", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_shape(capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    code, out, err = _run(
        capsys, "builtin:tiny", "--text", str(text), "--context", "32,64", "--max-windows", "3",
        "--kv-cache-dtype", "fp8,tq4", "--bootstrap", "50", "--json",
    )  # fmt: skip
    assert code == 0, err
    payload = json.loads(out)
    assert payload["bootstrap"] == {"unit": "window", "resamples": 50, "seed": 0, "level": 0.95}
    assert payload["text_tokens"] == len(TEXT.encode())  # the byte-level tokenizer
    assert [c["context"] for c in payload["contexts"]] == [32, 64]
    for ctx in payload["contexts"]:
        assert ctx["windows"] == 3 and ctx["tokens_scored"] == 3 * (ctx["context"] - 1)
        assert ctx["unigram_ppl"] is None  # builtin:tiny ships no training counts
        assert [r["tier"] for r in ctx["tiers"]] == ["f32", "fp8", "tq4"]
        for r in ctx["tiers"]:
            assert set(r) >= {"ppl", "ppl_ci", "delta_ppl_pct", "delta_ppl_pct_ci", "kld", "kld_ci", "top1"}
            assert r["tokens"] == ctx["tokens_scored"]
    assert "window 3/3" in err  # progress on stderr


def test_cli_defaults_to_heldout_and_reports_the_unigram(capsys, tmp_path, tiny_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "heldout.txt").write_text(TEXT)
    counts = np.bincount(np.frombuffer(TEXT.encode(), dtype=np.uint8), minlength=256)
    (model / "train_token_counts.json").write_text(json.dumps(counts.tolist()))
    code, out, err = _run(capsys, str(model), "--context", "64", "--kv-cache-dtype", "f32", "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["text"] == str(model / "heldout.txt")
    ctx = payload["contexts"][0]
    assert ctx["windows"] == len(TEXT) // 64
    # a unigram fitted on this very text beats a random model's near-uniform ppl over 256 bytes
    assert 1 < ctx["unigram_ppl"] < 40 < ctx["tiers"][0]["ppl"]


def test_cli_table(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out, _ = _run(
        capsys, "builtin:tiny", "--text", str(text), "--context", "64", "--kv-cache-dtype", "fp8"
    )
    assert code == 0
    assert "| KV | B/token/layer | ppl [95% CI]" in out and "| fp8 | 48 |" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["builtin:tiny"], "ships no heldout.txt"),
        (["builtin:tiny", "--text", "/nonexistent/x.txt"], "no such file"),
        (["builtin:tiny", "--text", "{text}", "--context", "8192"], "the model's maximum"),
        (["builtin:tiny", "--text", "{text}", "--context", "4000"], "fewer than one window"),
        (["builtin:tiny", "--text", "{text}", "--kv-cache-dtype", "int3"], "unknown --kv-cache-dtype"),
    ],
)
def test_cli_errors(capsys, tmp_path, argv, message):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out, err = _run(capsys, *(a.format(text=text) for a in argv))
    assert code == 2 and out == ""
    assert message in err


def test_cli_weight_formats_are_scored_against_f32_weights(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out, err = _run(
        capsys, "builtin:tiny", "--text", str(text), "--context", "64", "--max-windows", "3",
        "--weight-dtype", "int8,int4", "--bootstrap", "50", "--json",
    )  # fmt: skip
    assert code == 0, err
    payload = json.loads(out)
    assert payload["weight_dtype"] == ["f32", "int8", "int4"]
    rows = payload["contexts"][0]["tiers"]
    assert [(r["weights"], r["tier"]) for r in rows] == [("f32", "f32"), ("int8", "f32"), ("int4", "f32")]
    f32, int8, int4 = rows
    assert f32["kld"] == 0.0 and f32["top1"] == 1.0
    assert 0 < int8["kld"] < int4["kld"]  # 8 bits per weight beat 4
    assert int4["kld_ci"][0] <= int4["kld"] <= int4["kld_ci"][1]
    assert "weights: int4" in err  # the kernel line at start


def test_cli_weight_format_errors(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out, err = _run(capsys, "builtin:tiny", "--text", str(text), "--weight-dtype", "int8,int3")
    assert code == 2 and out == "" and "unknown weight dtype int3" in err


def test_score_from_scores_only_the_later_positions(ours):
    """--score-from S: the sums cover positions S .. N-2 only (predicting tokens S+1 .. N-1), each
    position still seeing the whole window before it; checked against float64 sums of the full logits."""
    model = ours("glm5-tiny")
    windows = torch.stack([_ids(20, seed=41), _ids(20, seed=42)])
    tiers = [CacheConfig("f32"), CacheConfig("q4s")]
    scores = ppl.score_context(model, windows, tiers, score_from=12)
    assert scores.tokens_per_window == 7 and scores.score_from == 12
    for w in range(2):
        full_ref = ppl.score_window(model, windows[w], model.tier(tiers[0])).double()
        full = ppl.score_window(model, windows[w], model.tier(tiers[1])).double()
        log_p, log_q = torch.log_softmax(full_ref[12:-1], -1), torch.log_softmax(full[12:-1], -1)
        targets = windows[w, 13:]
        assert scores.nll[1, w] == pytest.approx(float(-log_q[torch.arange(7), targets].sum()), abs=1e-3)
        assert scores.kl[1, w] == pytest.approx(float((log_p.exp() * (log_p - log_q)).sum()), abs=1e-4)
    assert ppl.summarize(scores, model.layout, resamples=0)["tokens_scored"] == 14
    with pytest.raises(ValueError, match="--score-from 19: must be 0 .. 18"):
        ppl.score_context(model, windows, tiers, score_from=19)
