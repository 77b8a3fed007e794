"""The MTP draft layer: loaded from the checkpoint, and computing what it was trained to compute.

The reference is independent of our model code: transformers' main model and the training
script's own MTP module (tools/train_fixture.py's `MTPLayer`, built on transformers' decoder
layer) in float64, from the raw safetensors weights, following the training forward
(`losses`): m_i = eh_proj([enorm(embed(x_{i+1})) | hnorm(h_i)]), one block, shared_head.norm,
lm_head.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from latentkv.kv.codecs import TIERS
from latentkv.models.registry import builtin_path

FIXTURE = builtin_path("fixture")
TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_fixture.py"
# float32 (ours) against float64 (reference) logits of magnitude ~10: float32 rounding (measured
# 1.1e-5 on x86-64 AVX2); a wrong norm, order or position would be off by far more.
TOLERANCE = 1e-4


def _train_module():
    spec = importlib.util.spec_from_file_location("train_fixture", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fixture_model():
    from latentkv.models.weights import load_model

    return load_model(FIXTURE, device="cpu")


def _reference_mtp_logits(ids: torch.Tensor) -> torch.Tensor:
    """float64 logits [S-1, vocab] of the MTP layer at positions 0..S-2 (predicting x_{i+2})."""
    import transformers

    train = _train_module()
    main = transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURE, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    config = main.config
    config._experts_implementation = "eager"  # the MTP block too: grouped matmuls take no float64
    n = config.num_hidden_layers
    mtp = train.MTPLayer(config, n).double().eval()
    prefix = f"model.layers.{n}."
    raw = {
        k[len(prefix) :]: v
        for k, v in load_file(FIXTURE / "model.safetensors").items()
        if k.startswith(prefix)
    }
    own = {"enorm.", "hnorm.", "eh_proj."}
    state = {}
    for name, t in raw.items():
        if name.startswith("shared_head.norm."):
            state["head_norm." + name.removeprefix("shared_head.norm.")] = t.double()
        elif any(name.startswith(o) for o in own):
            state[name] = t.double()
        else:
            state["block." + name] = t.double()
    mtp.load_state_dict(state, strict=True)
    with torch.no_grad():
        x = ids[None]
        h = main.model(input_ids=x).last_hidden_state  # after the final norm, as in training
        e = main.model.embed_tokens(x[:, 1:])
        m = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h[:, :-1])], dim=-1))
        pos = torch.arange(m.shape[1])[None]
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(
            config=config,
            inputs_embeds=m,
            attention_mask=None,
            past_key_values=None,
            position_ids=pos,
            allow_is_causal_skip=False,
        )
        m, _ = mtp.block(
            m, attention_mask=mask, position_ids=pos, position_embeddings=main.model.rotary_emb(m, pos)
        )
        return main.lm_head(mtp.head_norm(m))[0]


def test_fixture_loads_its_mtp_layer(fixture_model):
    mtp = fixture_model.mtp
    assert mtp is not None
    assert mtp.cfg.num_layers == 1 and mtp.cfg.mlp_layer_types == ("sparse",)
    assert (mtp.eh_proj.out_features, mtp.eh_proj.in_features) == (256, 512)
    assert mtp.block.indexer is not None  # GLM-5's MTP layer runs its own DSA indexer


def test_tiny_model_has_no_mtp_layer(ours):
    assert ours("glm5-tiny").mtp is None


@pytest.mark.slow  # ~10-30 s: transformers loads the fixture in float64
def test_mtp_logits_match_float64_reference(fixture_model, helpers):
    ids = helpers.random_ids(48, seed=1701, vocab=fixture_model.cfg.vocab_size)
    want = _reference_mtp_logits(ids)
    cache = fixture_model.make_cache()
    _, h = fixture_model.forward(ids, cache, hidden=True)
    draft_cache = fixture_model.make_draft_cache()
    got, _ = fixture_model.draft(ids[1:], h[:-1], draft_cache, 0)
    assert got.shape == want.shape == (47, fixture_model.cfg.vocab_size)
    assert (got.double() - want).abs().max().item() <= TOLERANCE
    assert draft_cache.length == 47


def test_mtp_decode_one_position_at_a_time_matches_one_pass(fixture_model, helpers):
    """The draft layer's own cache: positions fed one by one (as drafting does) give the logits
    of one pass over all of them (causal attention over its rows)."""
    ids = helpers.random_ids(24, seed=1702, vocab=fixture_model.cfg.vocab_size)
    _, h = fixture_model.forward(ids, fixture_model.make_cache(), hidden=True)
    whole, _ = fixture_model.draft(ids[1:], h[:-1], fixture_model.make_draft_cache(), 0)
    cache = fixture_model.make_draft_cache()
    first, _ = fixture_model.draft(ids[1:10], h[:9], cache, 0)
    rows = [first] + [
        fixture_model.draft(ids[i + 1 : i + 2], h[i : i + 1], cache, i)[0] for i in range(9, 23)
    ]
    assert (torch.cat(rows) - whole).abs().max().item() <= 1e-4


def test_mtp_last_only_is_the_last_row(fixture_model, helpers):
    """`last_only` (what drafting asks for: the lm_head over one row) gives the last row of the
    full pass's logits and states, and the cache the same rows."""
    m = fixture_model
    ids = helpers.random_ids(20, seed=1704, vocab=m.cfg.vocab_size)
    _, h = m.forward(ids, m.make_cache(), hidden=True)
    for start, stop in ((0, 19), (5, 7), (10, 11)):  # the prefix's backlog, a round's, one draft
        full_cache, last_cache = m.make_draft_cache(), m.make_draft_cache()
        if start:
            m.draft(ids[1 : start + 1], h[:start], full_cache, 0)
            m.draft(ids[1 : start + 1], h[:start], last_cache, 0)
        full, full_h = m.draft(ids[start + 1 : stop + 1], h[start:stop], full_cache, start)
        last, last_h = m.draft(ids[start + 1 : stop + 1], h[start:stop], last_cache, start, last_only=True)
        assert last.shape == (1, m.cfg.vocab_size) and last_h.shape == (1, m.cfg.hidden_size)
        torch.testing.assert_close(last, full[-1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last_h, full_h[-1:], rtol=0, atol=0)
        assert last_cache.length == full_cache.length == stop
        torch.testing.assert_close(last_cache.view(0), full_cache.view(0), rtol=0, atol=0)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_mtp_cache_in_every_tier(fixture_model, helpers, tier):
    """The draft layer's rows are one more layer in the tier's format: its logits stay close to
    the f32 cache's (the tier's own distortion), and the cache reports the tier."""
    ids = helpers.random_ids(32, seed=1703, vocab=fixture_model.cfg.vocab_size)
    _, h = fixture_model.forward(ids, fixture_model.make_cache(), hidden=True)
    f32, _ = fixture_model.draft(ids[1:], h[:-1], fixture_model.make_draft_cache(), 0)
    cache = fixture_model.make_draft_cache(fixture_model.tier(tier))
    got, _ = fixture_model.draft(ids[1:], h[:-1], cache, 0)
    assert cache.tier.name == tier
    assert cache.layout.num_layers == 1
    top = f32.argmax(-1)
    assert (got.argmax(-1) == top).float().mean().item() >= 0.5
    assert torch.isfinite(got).all()


def test_draft_batch_equals_one_sequence_passes(fixture_model, helpers):
    """Three sequences' draft-layer passes in one batch (ragged, each cache at its own offset):
    each sequence's last logits are its own pass's, to float32 rounding."""
    m = fixture_model
    seqs = [helpers.random_ids(n, seed=1710 + n, vocab=m.cfg.vocab_size) for n in (9, 14, 5)]
    hidden = [m.forward(ids, m.make_cache(), hidden=True)[1] for ids in seqs]
    starts = [0, 3, 1]  # the draft caches start at these positions (a resumed conversation's)
    alone, caches = [], []
    for ids, h, start in zip(seqs, hidden, starts, strict=True):
        logits, _ = m.draft(ids[start + 1 :], h[start:-1], m.make_draft_cache(), start)
        alone.append(logits[-1])
        caches.append(m.make_draft_cache())
    logits, _ = m.draft_batch(
        [ids[start + 1 :] for ids, start in zip(seqs, starts, strict=True)],
        [h[start:-1] for h, start in zip(hidden, starts, strict=True)],
        caches,
        starts,
    )
    assert logits.shape == (3, m.cfg.vocab_size)
    torch.testing.assert_close(logits, torch.stack(alone), rtol=0, atol=1e-4)
    assert [c.length for c in caches] == [len(ids) - 1 - s for ids, s in zip(seqs, starts, strict=True)]
