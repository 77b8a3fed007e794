"""Every tier through the whole model: one batched prefill then decode steps gives the logits of
token-by-token decoding, and the cache holds exactly the bytes its codecs promise."""

from __future__ import annotations

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import LatentCache
from latentkv.kv.codecs import TIERS, get_codec

N_TOKENS, N_PREFILL = 14, 9  # 14 > index_topk 8 of glm5-tiny-dsa: DSA selects from the packed rows


def _ids(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(2, vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(seed))


def _stored_bytes(cache) -> int:
    """What the row buffers hold for the committed tokens, measured from the tensors."""
    if isinstance(cache, LatentCache):
        return sum(
            cache.view(i).numel() * cache.view(i).element_size() for i in range(cache.layout.num_layers)
        )
    return cache.allocated_nbytes()


@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny"])
@pytest.mark.parametrize("tier", KV_CACHE_DTYPES)
def test_prefill_then_decode_equals_token_by_token(tier, name, ours):
    model = ours(name)
    cfg = model.cfg
    ids = _ids(seed=len(tier) * 31 + len(name), vocab=cfg.vocab_size)
    cache_cfg = CacheConfig(tier)

    batched = model.make_cache(model.tier(cache_cfg))
    logits = [model.forward(ids[:N_PREFILL], batched, all_logits=True)]
    logits += [model.forward(ids[t : t + 1], batched) for t in range(N_PREFILL, N_TOKENS)]
    batched_logits = torch.cat(logits)  # [N_TOKENS, vocab]

    stepped = model.make_cache(model.tier(cache_cfg))
    stepped_logits = torch.cat([model.forward(ids[t : t + 1], stepped) for t in range(N_TOKENS)])

    assert batched_logits.shape == stepped_logits.shape == (N_TOKENS, cfg.vocab_size)
    assert torch.isfinite(batched_logits).all()
    torch.testing.assert_close(batched_logits, stepped_logits, rtol=0, atol=1e-4)

    parts = TIERS[tier]  # the codec of c and the codec of r (the same but for the mixed tiers)
    per_layer = (
        get_codec(parts.c, cfg.kv_lora_rank).bytes_per_row
        + get_codec(parts.r, cfg.qk_rope_head_dim).bytes_per_row
    )
    for cache in (batched, stepped):
        assert cache.tier.name == tier
        assert cache.length == N_TOKENS
        assert cache.tier.bytes_per_token_layer == per_layer
        assert _stored_bytes(cache) == per_layer * cfg.num_layers * N_TOKENS == cache.nbytes()


@pytest.mark.parametrize("tier", ["fp8", "tq4", "polar4"])
def test_a_lossy_tier_changes_the_logits_but_not_the_shape(tier, ours):
    model = ours("glm5-tiny")
    ids = _ids(seed=7, vocab=model.cfg.vocab_size)
    f32 = model.forward(ids, model.make_cache(), all_logits=True)
    lossy = model.forward(ids, model.make_cache(model.tier(tier)), all_logits=True)
    assert lossy.shape == f32.shape
    assert 1e-4 < float((lossy - f32).abs().max()) < 5.0


def _prefill_then_decode(model, cache_cfg: CacheConfig, ids: torch.Tensor) -> torch.Tensor:
    cache = model.make_cache(model.tier(cache_cfg))
    logits = [model.forward(ids[:N_PREFILL], cache, all_logits=True)]
    logits += [model.forward(ids[t : t + 1], cache) for t in range(N_PREFILL, N_TOKENS)]
    return torch.cat(logits)


def _token_by_token(model, cache_cfg: CacheConfig, ids: torch.Tensor) -> torch.Tensor:
    cache = model.make_cache(model.tier(cache_cfg))
    return torch.cat([model.forward(ids[t : t + 1], cache) for t in range(N_TOKENS)])


@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny"])
@pytest.mark.parametrize(
    ("tier", "group", "window"),
    [
        ("tq4", None, 3),
        ("tq4-r8", None, 1),
        ("tq3-r16", None, 5),
        ("fp8", None, 4),
        ("tq4", 8, 0),
        ("polar4", 8, 2),
    ],
)
def test_variants_prefill_then_decode_equals_token_by_token(tier, group, window, name, ours):
    """Grouped radii and the recent window through the whole model: the window rule depends on each
    query's position only, so a batched prefill sees what token-by-token decoding sees (DSA's
    top-k included: 14 tokens > index_topk 8)."""
    model = ours(name)
    ids = _ids(seed=11 + window, vocab=model.cfg.vocab_size)
    cache_cfg = CacheConfig(tier, group_size=group, recent_window=window)
    batched, stepped = _prefill_then_decode(model, cache_cfg, ids), _token_by_token(model, cache_cfg, ids)
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, stepped, rtol=0, atol=1e-4)
    plain = _prefill_then_decode(model, CacheConfig(tier), ids)
    assert float((batched - plain).abs().max()) > 1e-4  # the variant is not the plain tier


@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny"])
def test_a_window_over_the_whole_context_gives_the_f32_logits(name, ours):
    model = ours(name)
    ids = _ids(seed=5, vocab=model.cfg.vocab_size)
    f32 = _prefill_then_decode(model, CacheConfig("f32"), ids)
    windowed = _prefill_then_decode(model, CacheConfig("tq3", recent_window=N_TOKENS), ids)
    torch.testing.assert_close(windowed, f32, rtol=0, atol=1e-5)


def test_a_long_prefill_tiled_by_mla_passes_the_positions(ours, monkeypatch):
    """MLA splits a long prefill into query tiles; each tile's positions reach the windowed reader."""
    from latentkv.models import mla

    model = ours("glm5-tiny")
    ids = _ids(seed=3, vocab=model.cfg.vocab_size)
    cache_cfg = CacheConfig("tq4", recent_window=4)
    whole = model.forward(ids, model.make_cache(model.tier(cache_cfg)), all_logits=True)
    monkeypatch.setattr(mla, "SCORE_BLOCK_ELEMENTS", 64)  # a handful of queries per tile
    tiled = model.forward(ids, model.make_cache(model.tier(cache_cfg)), all_logits=True)
    torch.testing.assert_close(tiled, whole, rtol=0, atol=1e-5)
