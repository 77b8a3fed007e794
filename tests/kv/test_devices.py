"""Every KV tier follows the device of its rows: codecs, caches, the slot pool and the torch
reference's attention, checked on torch's meta device without a GPU.

A meta tensor has a shape, a dtype and a device but no storage, and torch refuses an op that
mixes it with a CPU tensor (a CPU scalar aside). So a codec table left on the CPU, or an
intermediate made without `device=`, fails here as it would on a CUDA device, and every output
must come back on meta with the shape and dtype the CPU gives.

What depends on the rows' values cannot run on meta: the recent window's split of rows between
the tier and float32 (`attention/readers._split`: which positions each query reads exactly is
`int(positions.max())`, a value) and a blocked row's gather in a batch read one sequence at a
time. Those are run on CPU rows with torch's default device set to meta instead: a tensor made
without a device would then be a meta tensor, and the result would fail or differ from the run
without the default.
"""

from __future__ import annotations

import pytest
import torch

from latentkv.attention import consumers, readers
from latentkv.attention.reference import REFERENCE
from latentkv.config import GROUPED_KV_CACHE_DTYPES, KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import CacheLayout, KVTier, PackedLatentCache, resolve_tier
from latentkv.kv.codecs import get_codec
from latentkv.kv.codecs.base import PerDevice
from latentkv.kv.slots import SlotPool

META = torch.device("meta")
CPU = torch.device("cpu")
N_C, N_R = 64, 16  # kv_lora_rank, qk_rope_head_dim: powers of two, so every tier stores them
H, S = 3, 2  # heads, queries of a pass

# every tier, and the grouped ones again with one scale per 16 values
CONFIGS = [CacheConfig(name) for name in KV_CACHE_DTYPES] + [
    CacheConfig(name, group_size=16) for name in GROUPED_KV_CACHE_DTYPES
]
IDS = [c.kv_cache_dtype + (f":g{c.group_size}" if c.group_size else "") for c in CONFIGS]


def _layout(device: torch.device) -> CacheLayout:
    return CacheLayout(
        num_layers=2,
        row_width=N_C + N_R,
        kv_lora_rank=N_C,
        index_layers=(1,),
        index_head_dim=8,
        device=device,
    )


def _tier(cfg: CacheConfig, device: torch.device, window: int = 0) -> KVTier:
    return resolve_tier(
        _layout(device), CacheConfig(cfg.kv_cache_dtype, group_size=cfg.group_size, recent_window=window)
    )


def _rows(n: int, width: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    if device == META:
        return torch.empty(n, width, device=META)
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed), device=device)


def _fill(cache, passes: tuple[int, ...], device: torch.device) -> list:
    """Passes of n tokens through every layer (as the model writes them); the last pass's readers."""
    seen = []
    for p, n in enumerate(passes):
        seen = [cache.append(layer, _rows(n, N_C + N_R, device, seed=10 * p + layer)) for layer in range(2)]
        cache.append_index_keys(1, _rows(n, 8, device, seed=100 + p))
        cache.commit(n)
    return seen


def _on_meta(*tensors: torch.Tensor) -> bool:
    return all(t.device == META for t in tensors)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_every_codec_encodes_and_decodes_on_meta(cfg):
    tier = _tier(cfg, META)
    for codec, width in ((tier.codec_c, N_C), (tier.codec_r, N_R)):
        enc = codec.encode(torch.empty(5, width, device=META))
        assert _on_meta(enc.codes, enc.scales), codec
        assert (enc.codes.shape, enc.codes.dtype) == ((5, codec.code_bytes), torch.uint8)
        assert (enc.scales.shape, enc.scales.dtype) == ((5, codec.scale_count), torch.float32)
        out = codec.decode(enc)
        assert out.device == META and (out.shape, out.dtype) == ((5, width), torch.float32)
        empty = codec.empty(3, device=META)
        assert _on_meta(empty.codes, empty.scales) and len(empty) == 3


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_a_cache_of_every_tier_lives_on_meta(cfg):
    tier = _tier(cfg, META)
    cache = tier.make_cache()
    seen = _fill(cache, (5, 70), META)  # 75 rows: every buffer grows past its first 64
    assert cache.length == 75 and all(len(r) == 75 for r in seen)
    state = cache.state()
    assert _on_meta(*state.values())
    assert state["index.1"].shape == (75, 8)
    if tier.exact:
        assert state["rows.0"].shape == (75, N_C + N_R)
    else:
        assert state["c_codes.0"].shape == (75, tier.codec_c.code_bytes)
        assert state["r_scales.1"].shape == (75, tier.codec_r.scale_count)
    assert cache.allocated_nbytes() == 75 * 2 * tier.bytes_per_token_layer
    cache.trim(40)
    again = tier.from_state(state)
    assert again.length == 75 and _on_meta(*again.state().values())
    if not tier.exact:  # a batch of caches stored alike, encoded in one call
        caches = [tier.make_cache() for _ in range(3)]
        got = PackedLatentCache.append_each(caches, 0, torch.empty(3, N_C + N_R, device=META))
        assert [len(r) for r in got] == [1, 1, 1]
        assert _on_meta(*(t for r in got for t in (r.c.codes, r.c.scales, r.r.codes, r.r.scales)))


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_attention_reads_every_tier_on_meta(cfg):
    tier = _tier(cfg, META)
    caches = [tier.make_cache() for _ in range(3)]
    reader = _fill(caches[0], (9, S), META)[0]  # T = 11 rows
    T = len(reader)
    query = torch.empty(H, S, N_C + N_R, device=META)
    allowed = torch.empty(S, T, dtype=torch.bool, device=META)
    for got, shape in (
        (readers.attend(query, reader, None), (H, S, N_C)),
        (readers.attend(query, reader, allowed), (H, S, N_C)),
        (readers.scores(query, reader), (H, S, T)),
        (readers.context(torch.empty(H, S, T, device=META), reader), (H, S, N_C)),
    ):
        assert got.device == META and got.shape == shape and got.dtype == torch.float32
    if not tier.exact:  # the packed consumers' tiled loop (4 rows a tile), its log-sum-exp and merge
        args = (tier.codec_c, tier.codec_r, query, reader.c, reader.r, allowed)
        out, lse = consumers.attend_with_lse(*args, tile=4)
        assert _on_meta(out, lse) and out.shape == (H, S, N_C) and lse.shape == (H, S)
        merged = consumers.merge(
            [(out, lse), consumers.attend_f32_with_lse(query, torch.empty(4, N_C + N_R, device=META), N_C)]
        )
        assert merged.device == META and merged.shape == (H, S, N_C)
    # a batched decode step over three sequences of different lengths, padded
    batch = [_fill(c, (n,), META)[0] for c, n in zip(caches[1:], (4, 7), strict=True)]
    got = REFERENCE.attend_batch(torch.empty(H, 3, N_C + N_R, device=META), [reader, *batch], None)
    assert got.device == META and got.shape == (H, 3, N_C)


def test_a_slot_pool_lives_on_meta():
    tier = _tier(CacheConfig("f32"), META)
    pool = SlotPool(tier.layout, slots=2, capacity=4)
    caches = [tier.make_cache() for _ in range(2)]
    assert all(pool.place(c) for c in caches)
    seen = [_fill(c, (3, 6), META)[0] for c in caches]  # 9 rows: the pool grows every slot
    assert pool.capacity >= 9 and all(len(r) == 9 for r in seen)
    assert _on_meta(*pool.rows, *pool.keys.values(), *(r.rows for r in seen))
    padded = pool.padded(pool.rows[0], slice(0, 2), 9)
    assert padded.device == META and padded.shape == (2, 9, N_C + N_R)
    flat = pool.flat_index([0, 1], torch.empty(2, dtype=torch.int64, device=META))
    with torch.inference_mode():  # as a forward pass writes
        SlotPool.write(pool.rows[0], flat, torch.empty(2, N_C + N_R, device=META))
    out = REFERENCE.attend_padded(torch.empty(H, 2, N_C + N_R, device=META), padded, None, N_C)
    assert out.device == META and out.shape == (H, 2, N_C)
    pool.release(caches[0])
    assert _on_meta(caches[0].view(0), caches[0].index_keys(1))


def _windowed_run(cfg: CacheConfig) -> list[torch.Tensor]:
    """A cache with a recent window of 4: two passes, a trim back past the exact rows held (the
    window refilled from the tier's decoded rows), every read of the window's split, and a
    batch read one sequence at a time with blocked rows (DSA's gather)."""
    cache = _tier(cfg, CPU, window=4).make_cache()
    reader = _fill(cache, (9, S), CPU)[0]
    g = torch.Generator().manual_seed(7)
    query = torch.randn(H, S, N_C + N_R, generator=g, device=CPU)
    weights = torch.softmax(torch.randn(H, S, len(reader), generator=g, device=CPU), dim=-1)
    picked = torch.tensor([8, 1, 10, 3], device=CPU)
    out = [
        readers.attend(query, reader, None),
        readers.scores(query, reader),
        readers.context(weights, reader),
        readers.attend(query[:, 1:], reader.select(picked), None, torch.tensor([10], device=CPU)),
    ]
    cache.trim(3)
    reader = _fill(cache, (2,), CPU)[0]
    blocked = torch.zeros(1, len(reader), dtype=torch.bool, device=CPU)
    blocked[0, 1] = True
    out.append(REFERENCE.attend_batch(query[:, :1], [reader], blocked))
    return [*out, *cache.state().values()]


@pytest.mark.parametrize(
    "cfg", [c for c in CONFIGS if c.kv_cache_dtype != "f32"], ids=[i for i in IDS if i != "f32"]
)
def test_a_recent_window_makes_nothing_on_the_default_device(cfg):
    """The window's split reads the positions' values, so it runs on CPU rows with torch's
    default device made meta: the same bytes as without, or a tensor fell to the default."""
    want = _windowed_run(cfg)
    with torch.device(META):
        got = _windowed_run(cfg)
    assert all(g.device == CPU and torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_check_can_fail(monkeypatch):
    """Were a codec to keep its tables on the CPU, meta rows would refuse them."""
    with pytest.raises(RuntimeError, match="device"):
        torch.arange(4) + torch.empty(4, device=META)
    monkeypatch.setattr(PerDevice, "on", lambda self, device: self.host)
    codec = get_codec("fp8", N_C)
    with pytest.raises(RuntimeError, match="device"):
        codec.decode(codec.encode(torch.empty(2, N_C, device=META)))
