"""Every tier through the whole model: one batched prefill then decode steps gives the logits of
token-by-token decoding, and the cache holds exactly the bytes its codecs promise."""

from __future__ import annotations

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import LatentCache
from latentkv.kv.codecs import get_codec

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

    batched = model.make_cache(cache_cfg)
    logits = [model.forward(ids[:N_PREFILL], batched, all_logits=True)]
    logits += [model.forward(ids[t : t + 1], batched) for t in range(N_PREFILL, N_TOKENS)]
    batched_logits = torch.cat(logits)  # [N_TOKENS, vocab]

    stepped = model.make_cache(cache_cfg)
    stepped_logits = torch.cat([model.forward(ids[t : t + 1], stepped) for t in range(N_TOKENS)])

    assert batched_logits.shape == stepped_logits.shape == (N_TOKENS, cfg.vocab_size)
    assert torch.isfinite(batched_logits).all()
    torch.testing.assert_close(batched_logits, stepped_logits, rtol=0, atol=1e-4)

    per_layer = (
        get_codec(tier, cfg.kv_lora_rank).bytes_per_row + get_codec(tier, cfg.qk_rope_head_dim).bytes_per_row
    )
    for cache in (batched, stepped):
        assert cache.codec == tier
        assert cache.length == N_TOKENS
        assert cache.bytes_per_token_layer() == per_layer
        assert _stored_bytes(cache) == per_layer * cfg.num_layers * N_TOKENS == cache.nbytes()


@pytest.mark.parametrize("tier", ["fp8", "tq4", "polar4"])
def test_a_lossy_tier_changes_the_logits_but_not_the_shape(tier, ours):
    model = ours("glm5-tiny")
    ids = _ids(seed=7, vocab=model.cfg.vocab_size)
    f32 = model.forward(ids, model.make_cache(), all_logits=True)
    lossy = model.forward(ids, model.make_cache(CacheConfig(tier)), all_logits=True)
    assert lossy.shape == f32.shape
    assert 1e-4 < float((lossy - f32).abs().max()) < 5.0
