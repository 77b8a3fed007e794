"""Speculative decoding on real models: greedy output is token-identical with drafting on and
off, in every KV tier, on the trained fixture (drafts mostly right) and on a random tiny model
with a random MTP layer (drafts mostly wrong); rollback leaves the caches as plain decoding does.
"""

from __future__ import annotations

import json

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.engine.generate import generate
from latentkv.engine.sampling import SamplingParams
from latentkv.engine.speculative import SpeculativeConfig, SpeculativeDecoder
from latentkv.models.registry import builtin_path
from latentkv.models.synthetic import write_random_checkpoint
from latentkv.models.weights import load_model
from latentkv.tokenizer import Tokenizer

FIXTURE = builtin_path("fixture")
FAST_TIERS = (
    "f32",
    "q8s",
    "q4s",
    "tq4",
)  # the reference, the recommended tiers (README) and tq4; the rest are slow
TIER_PARAMS = [t if t in FAST_TIERS else pytest.param(t, marks=pytest.mark.slow) for t in KV_CACHE_DTYPES]


@pytest.fixture(scope="module")
def fixture_model():
    return load_model(FIXTURE, device="cpu")


@pytest.fixture(scope="module")
def fixture_prompt() -> list[int]:
    text = (FIXTURE / "heldout.txt").read_text(encoding="utf-8")[:4000]
    return Tokenizer(FIXTURE).encode(text)[200:260]


@pytest.fixture(scope="module")
def random_mtp_model(tmp_path_factory):
    """builtin:tiny's shape with random weights and a random MTP layer; index_topk 8 so the DSA
    indexer selects (and its keys are rolled back) after a few tokens."""
    cfg = json.loads((builtin_path("tiny") / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, index_topk=8)
    directory = write_random_checkpoint(cfg, tmp_path_factory.mktemp("tiny-mtp"), seed=17)
    return load_model(directory, device="cpu")


def _both(model, prompt, tier, n_tokens, draft_tokens, window=0):
    cache_cfg = CacheConfig(tier, recent_window=window)
    plain_cache = model.make_cache(model.tier(cache_cfg))
    plain = generate(model, prompt, n_tokens, SamplingParams(), cache=plain_cache, stop_ids=())
    spec_cache = model.make_cache(model.tier(cache_cfg))
    spec = generate(
        model,
        prompt,
        n_tokens,
        SamplingParams(),
        cache=spec_cache,
        stop_ids=(),
        speculative=SpeculativeConfig(draft_tokens=draft_tokens, adaptive=False),
    )
    return plain, plain_cache, spec, spec_cache


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_fixture_greedy_identical_every_tier(fixture_model, fixture_prompt, tier):
    plain, plain_cache, spec, spec_cache = _both(fixture_model, fixture_prompt, tier, 24, 3)
    assert spec.tokens == plain.tokens
    assert spec_cache.length == plain_cache.length == len(fixture_prompt) + 24 - 1
    stats = spec.stats.speculative
    assert stats.rounds >= 1 and stats.acceptance[0] > 0.3  # the trained draft layer is mostly right


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_random_mtp_greedy_identical_every_tier(random_mtp_model, tier):
    prompt = torch.randint(2, 256, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, plain_cache, spec, spec_cache = _both(random_mtp_model, prompt, tier, 30, 2)
    assert spec.tokens == plain.tokens
    assert spec_cache.length == plain_cache.length
    assert spec.stats.speculative.rounds >= 10


def test_rollback_leaves_the_rows_plain_decoding_writes(fixture_model, fixture_prompt):
    """f32: after drafting, every layer's rows and the DSA keys are those of plain decoding
    (to float32 rounding: the verify pass computes several positions at once)."""
    _, plain_cache, spec, spec_cache = _both(fixture_model, fixture_prompt, "f32", 20, 2)
    for layer in range(fixture_model.cfg.num_layers):
        torch.testing.assert_close(spec_cache.view(layer), plain_cache.view(layer), rtol=0, atol=1e-4)
    for layer in spec_cache.layout.index_layers:
        torch.testing.assert_close(
            spec_cache.index_keys(layer), plain_cache.index_keys(layer), rtol=0, atol=1e-4
        )


@pytest.mark.parametrize("tier", ["tq4", "fp8"])
def test_recent_window_stays_exact_across_rollbacks(fixture_model, fixture_prompt, tier):
    """With a float32 window over the last 8 tokens, rolled-back rows must come back exact, not
    decoded from the tier: the next logits then agree with plain decoding's to float32 rounding
    (measured: 1e-6 exact, 2e-3 with tq4 rows refilled from the tier, 3e-4 with fp8)."""
    plain, plain_cache, spec, spec_cache = _both(fixture_model, fixture_prompt, tier, 24, 3, window=8)
    assert spec.tokens == plain.tokens
    assert sum(spec.stats.speculative.accepted) < sum(spec.stats.speculative.proposed)
    token = torch.tensor(plain.tokens[-1:])
    want = fixture_model.forward(token, plain_cache)
    got = fixture_model.forward(token, spec_cache)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)  # measured ~1e-6; tq4 refilled: ~2e-3


def test_draft_cache_matches_a_fresh_pass(fixture_model, fixture_prompt):
    """After rounds with rejections, the MTP cache's rows are those of one pass of the draft
    layer over the final sequence with the main model's hidden states (nothing stale kept)."""
    cache = fixture_model.make_cache()
    cfg = SpeculativeConfig(draft_tokens=3, adaptive=False)
    dec = SpeculativeDecoder(fixture_model, cache, SamplingParams(), cfg)
    out = [dec.start(fixture_prompt)]
    while len(out) < 20:
        out += dec.step(20 - len(out))
    assert sum(dec.stats.accepted) < sum(dec.stats.proposed)  # drafts were rejected: rows rolled back
    seq = torch.tensor(fixture_prompt + out)
    _, h = fixture_model.forward(seq, fixture_model.make_cache(), hidden=True)
    fresh = fixture_model.make_draft_cache()
    n = dec.draft_cache.length
    fixture_model.draft(seq[1 : n + 1], h[:n], fresh, 0)
    torch.testing.assert_close(dec.draft_cache.view(0), fresh.view(0), rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_name", ["fixture_model", "random_mtp_model"])
@pytest.mark.parametrize("n", [1, 2, 4, 9, 10])
def test_verify_pass_matches_the_general_forward(request, fixture_prompt, model_name, n):
    """`Model.verify` of n tokens (at most `batch.FEW_TOKENS`: the fused decode products, as a
    one-token step takes them) gives the logits, hidden states and cache rows of the general
    per-head pass (`forward(all_logits=True, hidden=True)`) to float32 rounding; on the random
    model the DSA indexer selects (index_topk 8 < the context)."""
    model = request.getfixturevalue(model_name)
    prompt = torch.tensor(fixture_prompt[:40]) % model.cfg.vocab_size
    tokens = torch.tensor(fixture_prompt[40 : 40 + n]) % model.cfg.vocab_size
    caches = [model.make_cache(), model.make_cache()]
    for cache in caches:
        model.forward(prompt, cache)
    want_logits, want_h = model.forward(tokens, caches[0], all_logits=True, hidden=True)
    got_logits, got_h = model.verify(tokens, caches[1])
    assert got_logits.shape == (n, model.cfg.vocab_size) and got_h.shape == want_h.shape
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)  # measured ~1e-6
    torch.testing.assert_close(got_h, want_h, rtol=1e-4, atol=1e-5)
    assert caches[1].length == caches[0].length == 40 + n
    for layer in range(model.cfg.num_layers):
        torch.testing.assert_close(caches[1].view(layer), caches[0].view(layer), rtol=0, atol=1e-5)


def test_few_token_passes_take_the_fused_products(fixture_model):
    """The fast path is chosen for speculative passes of at most FEW_TOKENS tokens only: a
    plain forward (prefill) keeps the per-head products whatever its length."""
    from latentkv.models import batch as batches

    def fused(n, speculative):
        tokens = torch.zeros(n, dtype=torch.long)
        return batches.one_sequence(
            fixture_model.rope, tokens, fixture_model.make_cache(), speculative=speculative
        ).fused

    assert fused(2, True) and fused(batches.FEW_TOKENS, True)
    assert not fused(batches.FEW_TOKENS + 1, True)
    assert not fused(2, False)
    segments = [torch.zeros(n, dtype=torch.long) for n in (3, 2)]
    caches = [fixture_model.make_cache() for _ in segments]
    assert batches.prefill(fixture_model.rope, segments, caches, speculative=True).fused
    assert not batches.prefill(fixture_model.rope, segments, caches).fused
