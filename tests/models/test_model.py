"""One model, many ways through the cache: the same logits whether a sequence is prefilled at once,
in chunks, decoded token by token, tiled, restored from a saved state, or re-grown after a trim."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from latentkv.eval import oracle
from latentkv.kv.cache import LatentCache
from latentkv.models import indexer as indexer_module
from latentkv.models import mla as mla_module

SPEC_NAMES = list(oracle.SPECS)
N = 40  # > glm5-tiny-dsa's index_topk of 8, so the indexer selects on most positions
EXACT = 1e-5  # f32 logits, same engine, different association of the same sums


def _prefill(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, model.make_cache(), all_logits=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_decode_token_by_token_equals_prefill(name, ours, helpers):
    model = ours(name)
    ids = helpers.random_ids(N, seed=1 + SPEC_NAMES.index(name))
    full = _prefill(model, ids)
    cache = model.make_cache()
    stepped = torch.cat([model.forward(ids[i : i + 1], cache) for i in range(N)])
    assert cache.length == N
    assert _max_diff(stepped, full) <= EXACT


@pytest.mark.parametrize("name", SPEC_NAMES)
@pytest.mark.parametrize("split", [1, 7, 8, 9, 25, N - 1])
def test_two_chunk_prefill_equals_one_pass(name, split, ours, helpers):
    """Splits around index_topk (8) catch an off-by-one in where selection starts."""
    model = ours(name)
    ids = helpers.random_ids(N, seed=11 + SPEC_NAMES.index(name))
    full = _prefill(model, ids)
    cache = model.make_cache()
    first = model.forward(ids[:split], cache, all_logits=True)
    rest = model.forward(ids[split:], cache, all_logits=True)
    assert _max_diff(torch.cat([first, rest]), full) <= EXACT


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_uneven_chunks_then_decode_equals_one_pass(name, ours, helpers):
    model = ours(name)
    ids = helpers.random_ids(N, seed=21 + SPEC_NAMES.index(name))
    full = _prefill(model, ids)
    cache = model.make_cache()
    parts, start = [], 0
    for size in (3, 1, 12, 5):
        parts.append(model.forward(ids[start : start + size], cache, all_logits=True))
        start += size
    parts += [model.forward(ids[i : i + 1], cache) for i in range(start, N)]
    assert _max_diff(torch.cat(parts), full) <= EXACT


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_last_logits_only_is_the_last_row(name, ours, helpers):
    model = ours(name)
    ids = helpers.random_ids(17, seed=31)
    full = _prefill(model, ids)
    last = model.forward(ids, model.make_cache())
    assert last.shape == (1, model.cfg.vocab_size)
    assert _max_diff(last, full[-1:]) <= EXACT


def test_dsa_selection_changes_the_logits(ours, helpers):
    """Guard for the tests above: on glm5-tiny-dsa the indexer really prunes attention, so a model
    with index_topk raised past the context gives different logits beyond position 8."""
    model = ours("glm5-tiny-dsa")
    ids = helpers.random_ids(N, seed=41)
    sparse = _prefill(model, ids)
    saved = [b.indexer.topk for b in model.blocks if b.indexer is not None]
    assert saved and all(k == 8 for k in saved)
    try:
        for b in model.blocks:
            if b.indexer is not None:
                b.indexer.topk = 10_000
        dense = _prefill(model, ids)
    finally:
        for b in model.blocks:
            if b.indexer is not None:
                b.indexer.topk = 8
    # Up to 8 tokens of context every token is selected either way.
    assert _max_diff(sparse[:8], dense[:8]) <= EXACT
    assert _max_diff(sparse[8:], dense[8:]) > 1e-3


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_tiled_prefill_equals_untiled(name, ours, helpers, monkeypatch):
    """Long prompts tile the score blocks along the queries; force tiny tiles on a short prompt."""
    model = ours(name)
    ids = helpers.random_ids(N, seed=51 + SPEC_NAMES.index(name))
    full = _prefill(model, ids)
    # Tiles of 3 queries in attention (H=4 heads x T<=40 keys) and of 2 in the indexer (16 heads).
    monkeypatch.setattr(mla_module, "SCORE_BLOCK_ELEMENTS", 3 * 4 * N)
    monkeypatch.setattr(indexer_module, "INDEX_BLOCK_ELEMENTS", 2 * 16 * N)
    assert _max_diff(_prefill(model, ids), full) <= EXACT
    cache = model.make_cache()
    chunked = torch.cat(
        [model.forward(ids[:13], cache, all_logits=True), model.forward(ids[13:], cache, all_logits=True)]
    )
    assert _max_diff(chunked, full) <= EXACT


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_cache_state_round_trip_continues_identically(name, ours, helpers):
    model = ours(name)
    ids = helpers.random_ids(N, seed=61 + SPEC_NAMES.index(name))
    full = _prefill(model, ids)
    cache = model.make_cache()
    model.forward(ids[:25], cache)
    restored = LatentCache.from_state(cache.tier, cache.state())
    assert restored.length == 25
    rest = model.forward(ids[25:], restored, all_logits=True)
    assert _max_diff(rest, full[25:]) <= EXACT


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_trim_then_regrow_equals_one_pass(name, ours, helpers):
    """A diverging continuation: keep a prefix, overwrite the rest with other tokens."""
    model = ours(name)
    ids = helpers.random_ids(N, seed=71 + SPEC_NAMES.index(name))
    other = helpers.random_ids(N, seed=72 + SPEC_NAMES.index(name))
    cache = model.make_cache()
    model.forward(torch.cat([ids[:15], other[15:]]), cache)
    cache.trim(15)
    rest = model.forward(ids[15:], cache, all_logits=True)
    assert cache.length == N
    assert _max_diff(rest, _prefill(model, ids)[15:]) <= EXACT


def test_context_past_max_position_embeddings_is_refused(ours, helpers, monkeypatch):
    model = ours("glm5-tiny")
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, max_position_embeddings=16))
    cache = model.make_cache()
    model.forward(helpers.random_ids(16, seed=81), cache)  # exactly at the limit is fine
    with pytest.raises(ValueError, match="exceeds the model's maximum of 16"):
        model.forward(helpers.random_ids(1, seed=82), cache)


def test_make_cache_declares_the_indexer_layers(ours):
    dsa = ours("glm5-tiny-dsa")
    types = dsa.cfg.dsa.indexer_types
    assert dsa.layout.index_layers == tuple(i for i, t in enumerate(types) if t == "full") == (0, 2)
    assert ours("dsv3-tiny").layout.index_layers == ()
    assert ours("dsv3-tiny").cfg.dsa is None


def test_num_parameters_equals_the_checkpoint_tensor_count(ours, checkpoint):
    """Against the checkpoint's own count (kv_b is split, gate/up fused: the totals are the same)."""
    from safetensors.torch import load_file

    model = ours("glm5-tiny")
    total = sum(t.numel() for t in load_file(checkpoint("glm5-tiny") / "model.safetensors").values())
    assert model.num_parameters() == total


@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny"])
def test_fused_decode_matches_the_per_head_path(name, checkpoint, monkeypatch):
    """Decode's fused matrices (absorbed query, fused output, every-expert MoE) against the same
    checkpoint loaded with fusing off: same logits to float32 rounding, DSA selecting."""
    from latentkv.models import mla, moe
    from latentkv.models.weights import load_model

    fused = load_model(checkpoint(name), device="cpu")
    assert all(b.attn._o_fused is not None for b in fused.blocks)
    monkeypatch.setattr(mla, "FUSED_DECODE_MAX_BYTES", 0)
    monkeypatch.setattr(moe, "EVERY_EXPERT_DECODE_MAX_BYTES", 0)
    plain = load_model(checkpoint(name), device="cpu")
    assert all(b.attn._o_fused is None and b.attn._q_fused is None for b in plain.blocks)
    assert all(getattr(b.mlp, "_every", None) is None for b in plain.blocks)
    prompt = torch.randint(2, fused.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(11))
    caches = [m.make_cache() for m in (fused, plain)]
    for m, c in zip((fused, plain), caches, strict=True):
        m.forward(prompt, c)
    token = torch.tensor([4])
    for _ in range(6):
        a, b = fused.forward(token, caches[0]), plain.forward(token, caches[1])
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
        token = a[-1].argmax().view(1)
