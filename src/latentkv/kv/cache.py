"""The attention cache of one sequence: one latent row per token per layer, in a chosen tier.

Per token per layer the cache holds `c` (kv_lora_rank values, the RMS-normed latent) and `r`
(qk_rope_head_dim values, the RoPE'd shared key). Never per-head K/V. DSA models also keep the
indexer's keys (float32) for every layer that runs its own indexer ("full" layers).

One cache type, `SequenceCache`, in two storages behind one small interface (append / commit /
view / trim / nbytes / state / stored_rows); what a caller needs to know of its tier (bytes per
row, whether it compiles or fits the slot pool, which caches are stored alike) is `cache.tier`,
a `KVTier` resolved once (`resolve_tier`), never the class:

    LatentCache        f32, rows [c | r] side by side: the reference, byte-identical to the
                       engine before any tier existed
    PackedLatentCache  any tier of `latentkv.kv.codecs` (bf16, fp8, tq*, polar*, tq4-r8, ...):
                       c and r encoded separately, each with its own codec and scale(s)

`append` returns a reader over every row so far: the stored rows and their scales, data only.
The attention backend (`latentkv.attention`) reads them in their stored format, so no float
copy of a packed cache is ever built; the arithmetic (each codec's consumer, the recent
window's split and merge) is there, not here.

A packed cache may keep a full-precision window (`CacheConfig.recent_window` = W > 0): a query
at position p reads the rows of positions p - W + 1 .. p (itself and its W - 1 predecessors)
as exact float32 and every older row from the tier. The rule depends on the query's position
only, so a prompt prefilled in one pass sees exactly what token-by-token decoding sees. The
cache holds the float32 rows of the last W committed tokens per layer (W * 4 * (Lkv + R) bytes
per layer, whatever the context) on top of the tier's rows, which it stores for every token as
without a window. `state()` and the KV file hold the tier's rows only: the window is not part
of the bytes. After a resume (`from_state`) or a `trim` that reaches back past the rows it
holds, the window is refilled from the tier's decoded rows, so those rows are no longer exact
and the logits that follow are not bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv.codecs import GROUPED_CODECS, TIERS, Codec, EncodedRows, get_codec

# The device of a layout that only sizes rows (a plan, a KV file header's checks): torch's meta
# device, whose tensors have shapes and no storage. A cache that holds rows gets its device from
# the model (chosen once, in `runtime`); nothing here picks one.
SHAPES_ONLY = torch.device("meta")


@dataclass(frozen=True)
class CacheLayout:
    """What one sequence caches, derived from the model config."""

    num_layers: int
    row_width: int  # Lkv + R
    kv_lora_rank: int
    index_layers: tuple[int, ...]  # layers with their own indexer key cache
    index_head_dim: int
    device: torch.device = field(compare=False)  # where the rows live (not part of the identity)

    @classmethod
    def for_model(cls, cfg: ModelConfig, device: torch.device | str) -> CacheLayout:
        index_layers: tuple[int, ...] = ()
        index_dim = 0
        if cfg.dsa is not None:
            index_layers = tuple(i for i, t in enumerate(cfg.dsa.indexer_types) if t == "full")
            index_dim = cfg.dsa.index_head_dim
        return cls(
            cfg.num_layers, cfg.kv_row_width, cfg.kv_lora_rank, index_layers, index_dim, torch.device(device)
        )

    @property
    def index_bytes_per_token(self) -> int:
        """Bytes of DSA indexer keys per token (float32, on every layer with its own indexer)."""
        return len(self.index_layers) * self.index_head_dim * 4


class _Buffer:
    """A growable [capacity, width] buffer (amortised doubling, no per-token reallocation).

    The capacity axis is marked dynamic for torch.compile, so a compiled decode step
    (`latentkv.models.compiled`) is not recompiled each time a buffer doubles.
    """

    # The storage is always an inference tensor, whether made inside a forward pass or not: one
    # kind of tensor for the compiled step's guards. Writes happen in inference mode (a
    # compiled step is traced in it already and must not enter it again).

    def __init__(
        self, width: int, dtype: torch.dtype = torch.float32, capacity: int = 64, *, device: torch.device
    ):
        with torch.inference_mode():
            self.data = _dynamic_rows(torch.empty(capacity, width, dtype=dtype, device=device))
        self.pool = None  # a `latentkv.kv.slots.SlotPool` whose slot `data` is, if any
        self.fixed: int | None = None  # the capacity `fix` set (then the storage never grows)

    def bind(self, data: torch.Tensor, pool=None) -> None:
        """Use `data` [capacity, width] as the storage: a slot of `pool` (which then grows it),
        or, with pool None, the buffer's own storage again."""
        self.data = data
        self.pool = pool

    def reserve(self, end: int, keep: int) -> None:
        """Make room for rows up to `end`, keeping the first `keep` rows."""
        if self.fixed is not None and end > self.fixed:
            raise ValueError(f"a cache fixed at {self.fixed} rows cannot hold {end}")
        if end > self.data.shape[0] and self.pool is not None:
            self.pool.grow_for(self, end)  # every slot grows, or the buffer gets its own storage back
        if end > self.data.shape[0]:
            with torch.inference_mode():
                grown = torch.empty(
                    max(end, 2 * self.data.shape[0]),
                    self.data.shape[1],
                    dtype=self.data.dtype,
                    device=self.data.device,
                )
                grown[:keep] = self.data[:keep]
            self.data = _dynamic_rows(grown)

    def fix(self, capacity: int, keep: int) -> None:
        """Hold exactly `capacity` rows from now on, keeping the first `keep`: storage that never
        grows, and is not marked dynamic, so a compiled step traces its size as a constant."""
        if self.fixed == capacity:
            return
        if self.pool is not None:
            raise ValueError("a buffer in a slot pool grows with the pool; it cannot be fixed")
        with torch.inference_mode():
            fixed = torch.empty(capacity, self.data.shape[1], dtype=self.data.dtype, device=self.data.device)
            fixed[:keep] = self.data[:keep]
        self.data, self.fixed = fixed, capacity

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        self.reserve(end, start)
        if (
            torch.compiler.is_compiling()
            or torch.compiler.is_exporting()
            or torch.is_inference_mode_enabled()
        ):
            self.data[start:end] = rows  # a forward pass, or one being traced
        else:  # e.g. re-encoding a KV file's rows
            with torch.inference_mode():
                self.data[start:end] = rows


def _dynamic_rows(t: torch.Tensor) -> torch.Tensor:
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return t


# --- readers: what attention is handed of one layer's rows ------------------------------------
#
# Data only: the stored rows and their scales, as views of the cache's buffers. How to attend
# over them is the attention backend's (`latentkv.attention`: the torch reference's arithmetic is
# `attention/readers.py` over the codecs' consumers, `attention/consumers.py`).


class RowReader(Protocol):
    """T cached rows of one layer, as stored."""

    def __len__(self) -> int: ...

    def select(self, index: torch.Tensor) -> RowReader:
        """The rows at `index` [K] (DSA's top-k)."""
        ...


class F32Rows:
    """Float32 rows [T, Lkv+R] (c | r side by side)."""

    def __init__(self, rows: torch.Tensor, kv_lora_rank: int):
        self.rows = rows
        self.kv_lora_rank = kv_lora_rank

    def __len__(self) -> int:
        return self.rows.shape[0]

    def select(self, index: torch.Tensor) -> F32Rows:
        return F32Rows(self.rows.index_select(0, index), self.kv_lora_rank)


class PackedRows:
    """Encoded c and r rows (each its codes and scales) and the codecs that wrote them."""

    def __init__(self, c: EncodedRows, r: EncodedRows, codec_c: Codec, codec_r: Codec):
        self.c, self.r = c, r
        self.codec_c, self.codec_r = codec_c, codec_r

    def __len__(self) -> int:
        return len(self.c)

    def select(self, index: torch.Tensor) -> PackedRows:
        return PackedRows(self.c.select(index), self.r.select(index), self.codec_c, self.codec_r)

    def rows(self, start: int, stop: int) -> PackedRows:
        """Rows [start, stop) as views (no copy)."""
        return PackedRows(self.c.rows(start, stop), self.r.rows(start, stop), self.codec_c, self.codec_r)

    def decoded(self) -> torch.Tensor:
        """The rows decoded to float32 [T, Lkv+R] (what refills a recent window after a resume)."""
        return torch.cat([self.codec_c.decode(self.c), self.codec_r.decode(self.r)], dim=1)


class WindowedRows:
    """A packed tier's rows plus the float32 rows of the recent window (see the module docstring):
    a query at position p reads row t exactly when p - W < pos_t, from the tier otherwise. Row
    positions are 0..T-1, or, after `select` (DSA), the selected indices."""

    def __init__(
        self,
        packed: PackedRows,
        recent: torch.Tensor,
        recent_start: int,
        window: int,
        query_start: int,
        query_count: int,
        positions: torch.Tensor | None = None,
    ):
        self.packed = packed
        self.recent = recent  # [Tr, Lkv+R] f32: the exact rows of positions recent_start ..
        self.recent_start = recent_start
        self.window = window
        self.query_start, self.query_count = query_start, query_count  # the pass that made the reader
        self.positions = positions  # [T] int64, or None for 0..T-1

    def __len__(self) -> int:
        return len(self.packed)

    def select(self, index: torch.Tensor) -> WindowedRows:
        positions = index if self.positions is None else self.positions.index_select(0, index)
        return WindowedRows(
            self.packed.select(index),
            self.recent,
            self.recent_start,
            self.window,
            self.query_start,
            self.query_count,
            positions.to(torch.int64),
        )


# --- caches ------------------------------------------------------------------------------


class SequenceCache:
    """The cache of one sequence in any tier: length bookkeeping and the DSA indexer keys here,
    the rows in a storage subclass (`LatentCache`, `PackedLatentCache`).

    Writes during a forward pass land after `length`; `commit(n)` makes them part of the
    cache once every layer has written its n rows. Readers returned by `append` see the
    committed rows plus the rows of the pass in progress, which is what causal attention needs.
    """

    def __init__(self, tier: KVTier):
        self.tier = tier  # how the rows are stored (resolved once, for the model: `resolve_tier`)
        self.layout = layout = tier.layout
        self.length = 0
        self.fixed: int | None = None  # the capacity `fix_capacity` gave every buffer, if any
        self._index = {
            layer: _Buffer(layout.index_head_dim, device=layout.device) for layer in layout.index_layers
        }

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store indexer keys [S, D] for this pass; return all keys so far [T, D]."""
        self._index[layer].write(self.length, keys)
        return self._index[layer].data[: self.length + keys.shape[0]]

    def index_keys(self, layer: int) -> torch.Tensor:
        return self._index[layer].data[: self.length]

    def append(self, layer: int, rows: torch.Tensor) -> RowReader:
        raise NotImplementedError

    @staticmethod
    def append_each(caches: Sequence[SequenceCache], layer: int, rows: torch.Tensor) -> list[RowReader]:
        """`append` of row b of rows [B, Lkv+R] to caches[b] (caches stored alike: one tier key)."""
        return [cache.append(layer, rows[b : b + 1]) for b, cache in enumerate(caches)]

    def commit(self, n: int) -> None:
        self.length += n

    def reserve(self, n: int) -> None:
        """Grow every buffer to hold `n` more tokens now, so the pass that writes them does not
        (a compiled decode step keeps buffer growth out of its graph)."""
        for buffer in self._buffers_in_use():
            buffer.reserve(self.length + n, self.length)

    def fix_capacity(self, capacity: int) -> None:
        """Give every buffer storage for exactly `capacity` tokens, now and from now on (the
        committed rows kept). A compiled decode step does this for a small model's caches
        (`latentkv.models.compiled`): with sizes that never change, its graph takes them as
        constants instead of one symbolic size per buffer, each read back every step."""
        if capacity < self.length:
            raise ValueError(f"cannot fix a cache of {self.length} tokens at {capacity}")
        for buffer in self._buffers_in_use():
            buffer.fix(capacity, self.length)
        self.fixed = capacity

    def _buffers_in_use(self) -> list[_Buffer]:
        return list(self._index.values())

    def storage(self) -> list[torch.Tensor]:
        """The tensors every row and indexer key is stored in, in a fixed order for the cache's
        type and tier: what an exported decode step takes as its inputs (`models.compiled`)."""
        return [b.data for b in self._buffers_in_use()]

    @contextmanager
    def stored_in(self, storage: Sequence[torch.Tensor], length: int) -> Iterator[None]:
        """Read and write `storage` (tensors shaped as `storage()`'s) as this cache's, at `length`
        tokens, until the block ends; then the cache's own tensors and length are back. An exported
        decode step is traced through a cache this way, its inputs standing in for the storage."""
        buffers = self._buffers_in_use()
        if len(storage) != len(buffers):
            raise ValueError(f"{len(storage)} tensors for a cache stored in {len(buffers)}")
        own, own_length = [b.data for b in buffers], self.length
        try:
            for b, t in zip(buffers, storage, strict=True):
                b.data = t
            self.length = length
            yield
        finally:
            for b, t in zip(buffers, own, strict=True):
                b.data = t
            self.length = own_length

    def hold_for_rollback(self, n: int) -> None:
        """Expect `trim` to take back up to n just-committed tokens (speculative decoding's
        rejected drafts); only a recent window needs to prepare (see PackedLatentCache)."""

    def trim(self, length: int) -> None:
        """Forget every token from `length` on (a diverging prompt keeps the common prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} tokens to {length}")
        self.length = length

    def nbytes(self) -> int:
        """Bytes of latent rows in use (indexer keys are reported by `index_nbytes`)."""
        return self.length * self.layout.num_layers * self.tier.bytes_per_token_layer

    def index_nbytes(self) -> int:
        return self.length * self.layout.index_bytes_per_token

    def _index_state(self) -> dict[str, torch.Tensor]:
        return {f"index.{i}": self.index_keys(i).clone() for i in self.layout.index_layers}

    def _load_index_state(self, state: dict[str, torch.Tensor]) -> None:
        for i in self.layout.index_layers:
            self._index[i].write(0, state[f"index.{i}"])


class LatentCache(SequenceCache):
    """Float32 rows [c | r]: the reference storage."""

    def __init__(self, tier: KVTier):
        super().__init__(tier)
        layout = tier.layout
        self._rows = [_Buffer(layout.row_width, device=layout.device) for _ in range(layout.num_layers)]

    def _buffers_in_use(self) -> list[_Buffer]:
        return [*self._rows, *super()._buffers_in_use()]

    def append(self, layer: int, rows: torch.Tensor) -> F32Rows:
        """Store rows [S, Lkv+R] for the tokens of this pass; return a reader over every row so far."""
        self._rows[layer].write(self.length, rows)
        return F32Rows(self._rows[layer].data[: self.length + rows.shape[0]], self.layout.kv_lora_rank)

    def view(self, layer: int) -> torch.Tensor:
        """The committed rows of one layer, [T, Lkv+R] (f32)."""
        return self._rows[layer].data[: self.length]

    def stored_rows(self, layer: int, start: int, end: int) -> list[tuple[str, torch.Tensor]]:
        """(part name, rows [n, k]) of positions [start, end) as the KV file records them."""
        rows = self.view(layer)[start:end]  # [n, Lkv+R] f32
        n = self.layout.kv_lora_rank
        return [(f"c_codes.{layer}", rows[:, :n]), (f"r_codes.{layer}", rows[:, n:])]

    def allocated_nbytes(self) -> int:
        """Bytes the committed rows occupy, measured from the row tensors themselves."""
        return sum(self.view(i).numel() * 4 for i in range(self.layout.num_layers))

    def state(self) -> dict[str, torch.Tensor]:
        """The committed contents as plain tensors (copies), keyed by name."""
        out = {f"rows.{i}": self.view(i).clone() for i in range(self.layout.num_layers)}
        out.update(self._index_state())
        return out

    @classmethod
    @torch.inference_mode()
    def from_state(cls, tier: KVTier, state: dict[str, torch.Tensor]) -> LatentCache:
        cache = cls(tier)
        for i in range(tier.layout.num_layers):
            cache._rows[i].write(0, state[f"rows.{i}"])
        cache._load_index_state(state)
        cache.length = state["rows.0"].shape[0]
        return cache


class PackedLatentCache(SequenceCache):
    """Rows encoded by a codec: c and r each as (uint8 codes, float32 scales) per token; with
    `recent_window` W > 0, also the float32 rows of the last W tokens (see the module docstring)."""

    def __init__(self, tier: KVTier):
        super().__init__(tier)
        layout, codec_c, codec_r = tier.layout, tier.codec_c, tier.codec_r
        if tier.recent_window < 0:
            raise ValueError(f"recent_window must be >= 0, got {tier.recent_window}")
        self.codec_c, self.codec_r = codec_c, codec_r
        self.recent_window = tier.recent_window
        self.spare = 0  # exact rows held past the window, so a trim of that many stays exact
        # the exact rows of the last <= W (+ spare) committed tokens, per layer: positions length - len .. length - 1
        self._recent = [
            torch.empty(0, layout.row_width, device=layout.device) for _ in range(layout.num_layers)
        ]
        self._pending: list[torch.Tensor | None] = [None] * layout.num_layers  # held + this pass's rows
        self._buffers = [
            tuple(
                _Buffer(width, dtype, device=layout.device)
                for width, dtype in (
                    (codec_c.code_bytes, torch.uint8),
                    (codec_c.scale_count, torch.float32),
                    (codec_r.code_bytes, torch.uint8),
                    (codec_r.scale_count, torch.float32),
                )
            )
            for _ in range(layout.num_layers)
        ]

    def _buffers_in_use(self) -> list[_Buffer]:
        return [b for layer in self._buffers for b in layer] + super()._buffers_in_use()

    def append(self, layer: int, rows: torch.Tensor) -> PackedRows:
        """Encode rows [S, Lkv+R] of this pass; return a reader over every row so far."""
        return self._append_encoded(layer, rows, *self._encode(rows))

    @staticmethod
    def append_each(caches: Sequence[PackedLatentCache], layer: int, rows: torch.Tensor) -> list[PackedRows]:
        """`append` of row b of rows [B, Lkv+R] to caches[b], for caches stored alike (the same
        codecs): the B rows are encoded in one call, which gives each row the bytes it gets
        alone (every codec encodes rows independently; tested)."""
        c, r = caches[0]._encode(rows)
        return [
            cache._append_encoded(layer, rows[b : b + 1], c.rows(b, b + 1), r.rows(b, b + 1))
            for b, cache in enumerate(caches)
        ]

    def _encode(self, rows: torch.Tensor) -> tuple[EncodedRows, EncodedRows]:
        n = self.layout.kv_lora_rank
        return self.codec_c.encode(rows[:, :n]), self.codec_r.encode(rows[:, n:])

    def _append_encoded(self, layer: int, rows: torch.Tensor, c: EncodedRows, r: EncodedRows) -> PackedRows:
        """`append` of rows [S, Lkv+R] whose encoding (c and r) is done; `rows` itself is kept
        only by a recent window."""
        for buffer, part in zip(self._buffers[layer], (c.codes, c.scales, r.codes, r.scales), strict=True):
            buffer.write(self.length, part)
        packed = self._reader(layer, self.length + rows.shape[0])
        if not self.recent_window:
            return packed
        held = self._recent[layer]
        self._pending[layer] = pending = torch.cat([held, rows.to(torch.float32)])
        return WindowedRows(
            packed, pending, self.length - len(held), self.recent_window, self.length, rows.shape[0]
        )

    def commit(self, n: int) -> None:
        super().commit(n)
        if not self.recent_window:
            return
        for layer, pending in enumerate(self._pending):
            if pending is None:  # a layer this pass did not write: rebuild its window from the tier
                self._refill(layer)
                continue
            # pending: the rows held before the pass, then the pass's; keep up to the committed length
            kept = pending[: len(self._recent[layer]) + n]
            self._recent[layer] = kept[-(self.recent_window + self.spare) :].clone()
            self._pending[layer] = None

    def hold_for_rollback(self, n: int) -> None:
        """Hold the exact rows of n tokens more than the window: a trim of up to n tokens then
        leaves the window's rows exact (not decoded from the tier), as if never written."""
        self.spare = max(self.spare, n)

    def trim(self, length: int) -> None:
        old = self.length
        super().trim(length)
        if not self.recent_window:
            return
        for layer in range(self.layout.num_layers):
            held = self._recent[layer]  # positions old - len(held) .. old - 1
            start = old - len(held)
            want = max(0, length - self.recent_window)  # the window now starts here
            exact = held[max(0, want - start) : max(0, length - start)]
            if want >= start:
                self._recent[layer] = exact.clone()
            else:  # the window reaches back past the exact rows held: the older ones come from the tier
                decoded = self._reader(layer, start).rows(want, min(start, length)).decoded()
                self._recent[layer] = torch.cat([decoded, exact])
            self._pending[layer] = None

    def _refill(self, layer: int) -> None:
        """The window of `layer` from the tier's rows, decoded (after a resume: no exact rows left)."""
        start = max(0, self.length - self.recent_window)
        self._recent[layer] = self._reader(layer, self.length).rows(start, self.length).decoded()
        self._pending[layer] = None

    def window_nbytes(self) -> int:
        """Bytes of the float32 window rows held (W rows per layer at most; 0 without a window)."""
        return sum(t.numel() * 4 for t in self._recent)

    def _reader(self, layer: int, end: int) -> PackedRows:
        codes_c, scales_c, codes_r, scales_r = (b.data[:end] for b in self._buffers[layer])
        return PackedRows(
            EncodedRows(codes_c, scales_c), EncodedRows(codes_r, scales_r), self.codec_c, self.codec_r
        )

    def view(self, layer: int) -> PackedRows:
        """The committed rows of one layer, still encoded."""
        return self._reader(layer, self.length)

    def stored_rows(self, layer: int, start: int, end: int) -> list[tuple[str, torch.Tensor]]:
        """(part name, rows [n, k]) of positions [start, end) as the KV file records them."""
        rows = self.view(layer)
        return [
            (f"c_codes.{layer}", rows.c.codes[start:end]),
            (f"c_scales.{layer}", rows.c.scales[start:end]),
            (f"r_codes.{layer}", rows.r.codes[start:end]),
            (f"r_scales.{layer}", rows.r.scales[start:end]),
        ]

    def allocated_nbytes(self) -> int:
        """Bytes the row buffers hold for the committed tokens, measured from the tensors themselves."""
        total = 0
        for layer in range(self.layout.num_layers):
            rows = self.view(layer)
            for t in (rows.c.codes, rows.c.scales, rows.r.codes, rows.r.scales):
                total += t.numel() * t.element_size()
        return total

    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i in range(self.layout.num_layers):
            rows = self.view(i)
            out[f"c_codes.{i}"], out[f"c_scales.{i}"] = rows.c.codes.clone(), rows.c.scales.clone()
            out[f"r_codes.{i}"], out[f"r_scales.{i}"] = rows.r.codes.clone(), rows.r.scales.clone()
        out.update(self._index_state())
        return out

    @classmethod
    @torch.inference_mode()
    def from_state(cls, tier: KVTier, state: dict[str, torch.Tensor]) -> PackedLatentCache:
        """A cache holding `state()`'s rows; a recent window is refilled from their decoded values."""
        cache = cls(tier)
        layout = tier.layout
        for i in range(layout.num_layers):
            parts = (state[f"{k}.{i}"] for k in ("c_codes", "c_scales", "r_codes", "r_scales"))
            for buffer, part in zip(cache._buffers[i], parts, strict=True):
                buffer.write(0, part)
        cache._load_index_state(state)
        cache.length = state["c_codes.0"].shape[0]
        if cache.recent_window:
            for i in range(layout.num_layers):
                cache._refill(i)
        return cache


def codecs_for(layout: CacheLayout, cfg: CacheConfig) -> tuple[Codec, Codec]:
    """The codec pair (c, r) a tier uses; raises ValueError if the widths don't suit it.

    The group size applies to c; r is grouped too when its codec takes groups and the group
    size divides its width, else it keeps one scale per row (a bf16 r has no scales at all).
    """
    tier = TIERS[cfg.kv_cache_dtype]
    rope_width = layout.row_width - layout.kv_lora_rank
    group = cfg.group_size
    group_r = group if group and tier.r in GROUPED_CODECS and rope_width % group == 0 else None
    try:
        codec_c = get_codec(tier.c, layout.kv_lora_rank, seed=cfg.rotation_seed, group_size=group)
        codec_r = get_codec(tier.r, rope_width, seed=cfg.rotation_seed, group_size=group_r)
    except ValueError as exc:
        raise ValueError(
            f"--kv-cache-dtype {cfg.kv_cache_dtype} cannot store this model's latent rows "
            f"(kv_lora_rank {layout.kv_lora_rank}, qk_rope_head_dim {rope_width}): {exc}"
        ) from None
    return codec_c, codec_r


@dataclass(frozen=True, eq=False)
class KVTier:
    """A `--kv-cache-dtype` resolved for one model's rows, once: its codecs (with every parameter
    that changes the bytes), bytes per row, what it can do, and the cache it makes."""

    name: str
    codec_c: Codec
    codec_r: Codec
    layout: CacheLayout
    recent_window: int = 0
    # Equal for caches stored alike (same storage and codec parameters): a batch reads and
    # encodes those together. Plain data (made once), so a compiled step can guard on it.
    key: tuple = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "key", (self.exact, repr(self.params())))

    @property
    def exact(self) -> bool:
        """Rows kept as float32 [c | r] as they are (f32, the reference storage)."""
        return self.name == "f32"

    @property
    def poolable(self) -> bool:
        """Whether caches of this tier can be placed in a `kv.slots.SlotPool` (float32 rows)."""
        return self.exact

    @property
    def bytes_per_token_layer(self) -> int:
        """Bytes of one token's latent row in one layer: c's and r's codes and scales."""
        return self.codec_c.bytes_per_row + self.codec_r.bytes_per_row

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in a cache of this tier: its rows in every layer and its indexer keys."""
        return self.bytes_per_token_layer * self.layout.num_layers + self.layout.index_bytes_per_token

    def params(self) -> dict:
        """Each part's codec parameters (what the KV file records)."""
        return {"c": self.codec_c.params(), "r": self.codec_r.params()}

    def codec_params(self) -> dict:
        """The codecs as reports name them: `params()`, or just the name of the reference storage."""
        return {"name": "f32"} if self.exact else self.params()

    def for_layout(self, layout: CacheLayout) -> KVTier:
        """This tier (the same codecs) over other rows of the same widths: the MTP draft layer's."""
        return dataclasses.replace(self, layout=layout)

    def make_cache(self) -> SequenceCache:
        """An empty cache of this tier."""
        if self.exact:  # every row is already exact: a recent window changes nothing
            return LatentCache(self)
        return PackedLatentCache(self)

    def from_state(self, state: dict[str, torch.Tensor]) -> SequenceCache:
        """A cache of this tier holding a `state()` of one (rows stored in this tier)."""
        if self.exact:
            return LatentCache.from_state(self, state)
        return PackedLatentCache.from_state(self, state)


def resolve_tier(layout: CacheLayout, cfg: CacheConfig | None = None) -> KVTier:
    """The tier of `cfg` (f32 when None) for `layout`'s rows; ValueError if it cannot store them.
    Called once at a boundary (`Model.tier`, a KV file's own tier), never per cache."""
    if cfg is None or cfg.kv_cache_dtype == "f32":
        f32 = (
            get_codec("f32", layout.kv_lora_rank),
            get_codec("f32", layout.row_width - layout.kv_lora_rank),
        )
        return KVTier("f32", *f32, layout)
    return KVTier(cfg.kv_cache_dtype, *codecs_for(layout, cfg), layout, cfg.recent_window)
