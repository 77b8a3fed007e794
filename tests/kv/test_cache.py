"""LatentCache: append / commit / view / trim / state, growth, and the byte accounting."""

from __future__ import annotations

import pytest
import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv.cache import CacheLayout, LatentCache, resolve_tier

LAYOUT = CacheLayout(
    num_layers=3,
    row_width=5,
    kv_lora_rank=3,
    index_layers=(0, 2),
    index_head_dim=4,
    device=torch.device("cpu"),
)


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _fill(cache: LatentCache, n: int, seed: int) -> dict[str, torch.Tensor]:
    """One pass of n tokens through every layer, as the model does; returns what was written."""
    written = {}
    for layer in range(cache.layout.num_layers):
        rows = _rows(n, cache.layout.row_width, seed + layer)
        cache.append(layer, rows)
        written[f"rows.{layer}"] = rows
    for layer in cache.layout.index_layers:
        keys = _rows(n, cache.layout.index_head_dim, seed + 100 + layer)
        cache.append_index_keys(layer, keys)
        written[f"index.{layer}"] = keys
    cache.commit(n)
    return written


def _merge(a: dict, b: dict) -> dict:
    return {k: torch.cat([a[k], b[k]]) for k in a}


def test_append_returns_committed_plus_new_rows_and_commit_publishes_them():
    cache = LatentCache(resolve_tier(LAYOUT))
    first = _fill(cache, 4, seed=0)
    new = _rows(2, 5, seed=9)
    seen = cache.append(1, new)
    assert torch.equal(seen.rows, torch.cat([first["rows.1"], new]))  # an F32Rows reader
    assert cache.length == 4
    assert torch.equal(cache.view(1), first["rows.1"])  # not committed yet
    keys = _rows(2, 4, seed=10)
    assert torch.equal(cache.append_index_keys(2, keys), torch.cat([first["index.2"], keys]))
    cache.commit(2)
    assert cache.length == 6
    assert torch.equal(cache.view(1), torch.cat([first["rows.1"], new]))
    assert torch.equal(cache.index_keys(2), torch.cat([first["index.2"], keys]))


def test_growth_past_the_initial_capacity_keeps_every_row():
    cache = LatentCache(resolve_tier(LAYOUT))
    written = _fill(cache, 50, seed=0)
    for step in range(3):  # 50 -> 90 -> 130 -> 300 rows: several reallocations
        written = _merge(written, _fill(cache, (40, 40, 170)[step], seed=10 * (step + 1)))
    assert cache.length == 300
    for layer in range(3):
        assert torch.equal(cache.view(layer), written[f"rows.{layer}"])
    for layer in (0, 2):
        assert torch.equal(cache.index_keys(layer), written[f"index.{layer}"])


@pytest.mark.parametrize("tier_name", ["f32", "bf16"])
def test_fixed_capacity_keeps_every_row_and_never_grows(tier_name):
    """`fix_capacity` (the compiled step's caches): every buffer holds exactly that many tokens,
    unmarked for torch.compile (sizes the graph takes as constants), with the committed rows kept;
    later writes land in place, and one past the capacity is refused, not grown into."""
    tier = resolve_tier(LAYOUT, CacheConfig(tier_name))
    cache, plain = tier.make_cache(), tier.make_cache()
    _fill(cache, 50, seed=0)
    _fill(plain, 50, seed=0)
    cache.fix_capacity(200)
    assert cache.fixed == 200
    buffers = cache._buffers_in_use()
    assert buffers and all(b.data.shape[0] == 200 for b in buffers)
    assert not any(hasattr(b.data, "_dynamo_weak_dynamic_indices") for b in buffers)
    _fill(cache, 150, seed=7)
    _fill(plain, 150, seed=7)
    assert all(b.data.shape[0] == 200 for b in cache._buffers_in_use())
    assert cache.state().keys() == plain.state().keys()
    for name, value in plain.state().items():
        assert torch.equal(cache.state()[name], value), name
    with pytest.raises(ValueError, match="fixed at 200 rows"):
        _fill(cache, 1, seed=9)
    with pytest.raises(ValueError, match="cannot fix a cache of 200 tokens at 100"):
        cache.fix_capacity(100)


@pytest.mark.parametrize("tier_name", ["f32", "bf16"])
def test_stored_in_reads_and_writes_other_tensors_then_gives_the_cache_back(tier_name):
    """`stored_in` (an exported decode step is traced through it): inside, rows and keys go to
    the tensors handed in at the length given; after, on an error too, the cache's own tensors
    and length are back, untouched by what was written inside."""
    tier = resolve_tier(LAYOUT, CacheConfig(tier_name))
    cache = tier.make_cache()
    _fill(cache, 20, seed=0)
    cache.fix_capacity(64)
    own = [t.clone() for t in cache.storage()]
    other = [torch.zeros_like(t) for t in cache.storage()]
    with cache.stored_in(other, 5):
        assert cache.length == 5 and all(a is b for a, b in zip(cache.storage(), other, strict=True))
        _fill(cache, 3, seed=1)
    assert cache.length == 20  # (rows past the length are uninitialized: compared up to it)
    assert all(torch.equal(a[:20], b[:20]) for a, b in zip(cache.storage(), own, strict=True))
    assert any(bool(t[5:8].any()) for t in other) and not any(bool(t[8:].any()) for t in other)
    with pytest.raises(RuntimeError, match="inside"), cache.stored_in(other, 2):
        raise RuntimeError("inside")
    assert cache.length == 20 and all(
        torch.equal(a[:20], b[:20]) for a, b in zip(cache.storage(), own, strict=True)
    )
    with pytest.raises(ValueError, match="1 tensors for a cache stored in"), cache.stored_in(other[:1], 2):
        pass


def test_many_single_row_appends_match_one_big_append():
    one, many = LatentCache(resolve_tier(LAYOUT)), LatentCache(resolve_tier(LAYOUT))
    written = _fill(one, 200, seed=3)
    for i in range(200):
        for layer in range(3):
            many.append(layer, written[f"rows.{layer}"][i : i + 1])
        for layer in (0, 2):
            many.append_index_keys(layer, written[f"index.{layer}"][i : i + 1])
        many.commit(1)
    assert torch.equal(one.view(2), many.view(2))
    assert torch.equal(one.index_keys(0), many.index_keys(0))


def test_trim_forgets_the_tail_and_later_writes_overwrite_it():
    cache = LatentCache(resolve_tier(LAYOUT))
    first = _fill(cache, 10, seed=0)
    cache.trim(6)
    assert cache.length == 6
    assert torch.equal(cache.view(0), first["rows.0"][:6])
    second = _fill(cache, 3, seed=50)
    assert torch.equal(cache.view(0), torch.cat([first["rows.0"][:6], second["rows.0"]]))
    assert torch.equal(cache.index_keys(2), torch.cat([first["index.2"][:6], second["index.2"]]))
    cache.trim(0)
    assert cache.length == 0
    assert cache.view(1).shape == (0, 5)


@pytest.mark.parametrize("length", [-1, 11, 100])
def test_trim_outside_the_cache_is_refused(length):
    cache = LatentCache(resolve_tier(LAYOUT))
    _fill(cache, 10, seed=0)
    with pytest.raises(ValueError, match=f"cannot trim a cache of 10 tokens to {length}"):
        cache.trim(length)
    assert cache.length == 10


def test_state_round_trip():
    cache = LatentCache(resolve_tier(LAYOUT))
    written = _merge(_fill(cache, 70, seed=0), _fill(cache, 5, seed=7))
    state = cache.state()
    assert set(state) == {"rows.0", "rows.1", "rows.2", "index.0", "index.2"}
    for key, value in written.items():
        assert torch.equal(state[key], value), key
    restored = LatentCache.from_state(resolve_tier(LAYOUT), state)
    assert restored.length == 75
    for layer in range(3):
        assert torch.equal(restored.view(layer), cache.view(layer))
    # The restored cache keeps growing like any other.
    more = _fill(restored, 60, seed=20)
    assert torch.equal(restored.view(1), torch.cat([written["rows.1"], more["rows.1"]]))
    assert torch.equal(restored.index_keys(0), torch.cat([written["index.0"], more["index.0"]]))


def test_state_is_a_copy_and_excludes_uncommitted_rows():
    cache = LatentCache(resolve_tier(LAYOUT))
    written = _fill(cache, 4, seed=0)
    cache.append(0, _rows(3, 5, seed=99))  # a pass in progress
    state = cache.state()
    assert state["rows.0"].shape == (4, 5)
    state["rows.0"].zero_()
    assert torch.equal(cache.view(0), written["rows.0"])


def test_state_of_an_empty_cache_round_trips():
    state = LatentCache(resolve_tier(LAYOUT)).state()
    restored = LatentCache.from_state(resolve_tier(LAYOUT), state)
    assert restored.length == 0
    written = _fill(restored, 2, seed=0)
    assert torch.equal(restored.view(2), written["rows.2"])


def test_byte_accounting_is_f32_rows_and_index_keys_separately():
    cache = LatentCache(resolve_tier(LAYOUT))
    _fill(cache, 7, seed=0)
    cache.append(0, _rows(2, 5, seed=1))  # uncommitted rows are not counted
    assert cache.tier.bytes_per_token_layer == 4 * 5
    assert cache.nbytes() == 4 * 5 * 3 * 7
    assert cache.layout.index_bytes_per_token == 4 * 4 * 2
    assert cache.tier.bytes_per_token == 4 * 5 * 3 + 4 * 4 * 2
    assert cache.index_nbytes() == 4 * 4 * 2 * 7
    assert cache.tier.name == "f32"


def test_layout_for_model_comes_from_the_config(helpers, checkpoint):
    cfg = ModelConfig.from_hf(checkpoint("glm5-tiny-dsa"))
    layout = CacheLayout.for_model(cfg, torch.device("cpu"))
    raw = helpers.read_config(checkpoint("glm5-tiny-dsa"))
    assert layout.row_width == raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert layout.kv_lora_rank == raw["kv_lora_rank"]
    assert layout.num_layers == raw["num_hidden_layers"]
    assert layout.index_layers == tuple(i for i, t in enumerate(raw["indexer_types"]) if t == "full")
    assert layout.index_head_dim == raw["index_head_dim"]
    dsv3 = CacheLayout.for_model(ModelConfig.from_hf(checkpoint("dsv3-tiny")), torch.device("cpu"))
    assert dsv3.index_layers == ()
    assert LatentCache(resolve_tier(dsv3)).layout.index_bytes_per_token == 0
