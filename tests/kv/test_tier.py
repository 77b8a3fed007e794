"""The tier resolved once (`KVTier`): one cache type whose tier answers what callers used to ask
of its class, from the one tier list in config.py."""

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import CacheLayout, LatentCache, SequenceCache, resolve_tier
from latentkv.kv.codecs import TIER_NAMES, TIERS
from latentkv.kv.slots import SlotPool

LAYOUT = CacheLayout(
    num_layers=2,
    row_width=64 + 16,
    kv_lora_rank=64,
    index_layers=(1,),
    index_head_dim=8,
    device=torch.device("cpu"),
)


def test_the_tier_table_derives_from_the_one_list():
    assert TIER_NAMES == KV_CACHE_DTYPES
    assert (TIERS["tq4-r8"].c, TIERS["tq4-r8"].r) == ("tq4", "fp8")
    assert (TIERS["polar4-r16"].c, TIERS["polar4-r16"].r) == ("polar4", "bf16")
    assert TIERS["fp8"] == ("fp8", "fp8")


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_a_resolved_tier_describes_the_cache_it_makes(name):
    tier = resolve_tier(LAYOUT, CacheConfig(name))
    cache = tier.make_cache()
    assert isinstance(cache, SequenceCache) and cache.tier is tier
    assert tier.exact == isinstance(cache, LatentCache) == (name == "f32")
    assert tier.poolable == (name == "f32")
    # every cache of the tier carries the one tier object it was made from
    again = tier.make_cache()
    assert again.tier is tier and type(again) is type(cache) and again is not cache
    rows = torch.randn(3, LAYOUT.row_width, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for layer in range(LAYOUT.num_layers):
            cache.append(layer, rows)
        cache.append_index_keys(1, torch.randn(3, 8))
        cache.commit(3)
    # the tier's byte arithmetic is what the cache's tensors hold
    assert cache.allocated_nbytes() == cache.nbytes() == 3 * LAYOUT.num_layers * tier.bytes_per_token_layer
    assert tier.bytes_per_token * 3 == cache.nbytes() + cache.index_nbytes() == cache.nbytes() + 3 * 8 * 4
    restored = tier.from_state(cache.state())
    assert type(restored) is type(cache) and restored.length == 3 and restored.tier is tier
    assert all(
        torch.equal(a, b) for a, b in zip(restored.state().values(), cache.state().values(), strict=True)
    )


def test_tier_keys_group_caches_stored_alike():
    keys = {name: resolve_tier(LAYOUT, CacheConfig(name)).key for name in KV_CACHE_DTYPES}
    assert len(set(keys.values())) == len(keys)  # every tier stores its rows its own way
    assert resolve_tier(LAYOUT, CacheConfig("tq4", rotation_seed=1)).key != keys["tq4"]
    assert resolve_tier(LAYOUT).key == keys["f32"]


def test_a_tier_that_cannot_store_the_rows_is_refused_with_the_widths():
    odd = CacheLayout(
        num_layers=1,
        row_width=24 + 8,
        kv_lora_rank=24,
        index_layers=(),
        index_head_dim=0,
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="kv_lora_rank 24"):
        resolve_tier(odd, CacheConfig("tq4"))


def test_the_slot_pool_takes_only_poolable_caches():
    pool = SlotPool(LAYOUT, 2)
    assert pool.place(resolve_tier(LAYOUT).make_cache())
    assert not pool.place(resolve_tier(LAYOUT, CacheConfig("bf16")).make_cache())
