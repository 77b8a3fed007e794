"""The attention cache of one sequence: one latent row per token per layer, in a chosen tier.

Per token per layer the cache holds `c` (kv_lora_rank values, the RMS-normed latent) and `r`
(qk_rope_head_dim values, the RoPE'd shared key). Never per-head K/V. DSA models also keep the
indexer's keys (float32) for every layer that runs its own indexer ("full" layers).

Two storages share one small interface (append / commit / view / trim / nbytes / state):

    LatentCache        f32, rows [c | r] side by side: the reference, byte-identical to the
                       engine before any tier existed
    PackedLatentCache  any codec of `latentkv.kv.codecs` (bf16, fp8, tq*, polar*): c and r
                       encoded separately, each with its own scale(s)

`append` returns a reader over every row so far; attention asks the reader for
`scores(query)` and `context(weights)`, which read the stored format directly (see
`latentkv.kv.attention`), so no float copy of a packed cache is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv import attention
from latentkv.kv.codecs import Codec, EncodedRows, get_codec


@dataclass(frozen=True)
class CacheLayout:
    """What one sequence caches, derived from the model config."""

    num_layers: int
    row_width: int  # Lkv + R
    kv_lora_rank: int
    index_layers: tuple[int, ...]  # layers with their own indexer key cache
    index_head_dim: int

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> CacheLayout:
        index_layers: tuple[int, ...] = ()
        index_dim = 0
        if cfg.dsa is not None:
            index_layers = tuple(i for i, t in enumerate(cfg.dsa.indexer_types) if t == "full")
            index_dim = cfg.dsa.index_head_dim
        return cls(cfg.num_layers, cfg.kv_row_width, cfg.kv_lora_rank, index_layers, index_dim)


class _Buffer:
    """A growable [capacity, width] buffer (amortised doubling, no per-token reallocation)."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32, capacity: int = 64):
        self.data = torch.empty(capacity, width, dtype=dtype)

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if end > self.data.shape[0]:
            grown = torch.empty(max(end, 2 * self.data.shape[0]), self.data.shape[1], dtype=self.data.dtype)
            grown[:start] = self.data[:start]
            self.data = grown
        self.data[start:end] = rows


# --- readers: what attention sees of one layer's rows ------------------------------------


class RowReader(Protocol):
    """T cached rows of one layer, read by attention without rebuilding them."""

    def __len__(self) -> int: ...

    def select(self, index: torch.Tensor) -> RowReader:
        """The rows at `index` [K] (DSA's top-k)."""
        ...

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """query [H, S, Lkv+R] -> [H, S, T]: q_abs . c_t + q_rope . r_t."""
        ...

    def context(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [H, S, T] -> [H, S, Lkv]: sum_t w_t c_t."""
        ...

    def attend(self, query: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """query [H, S, Lkv+R] (scaled), allowed bool [S, T] or None -> context [H, S, Lkv]."""
        ...


class F32Rows:
    """Float32 rows [T, Lkv+R]: two plain matmuls (the reference arithmetic)."""

    def __init__(self, rows: torch.Tensor, kv_lora_rank: int):
        self.rows = rows
        self.kv_lora_rank = kv_lora_rank

    def __len__(self) -> int:
        return self.rows.shape[0]

    def select(self, index: torch.Tensor) -> F32Rows:
        return F32Rows(self.rows.index_select(0, index), self.kv_lora_rank)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        return torch.matmul(query, self.rows.T)

    def context(self, weights: torch.Tensor) -> torch.Tensor:
        return torch.matmul(weights, self.rows[:, : self.kv_lora_rank])

    def attend(self, query: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        scores = self.scores(query)  # [H, S, T]
        if allowed is not None:
            scores.masked_fill_(~allowed, float("-inf"))
        return self.context(torch.softmax(scores, dim=-1))


class PackedRows:
    """Encoded c and r rows, read through the codecs' native consumers."""

    def __init__(self, c: EncodedRows, r: EncodedRows, codec_c: Codec, codec_r: Codec):
        self.c, self.r = c, r
        self.codec_c, self.codec_r = codec_c, codec_r

    def __len__(self) -> int:
        return len(self.c)

    def select(self, index: torch.Tensor) -> PackedRows:
        return PackedRows(self.c.select(index), self.r.select(index), self.codec_c, self.codec_r)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        n = self.codec_c.width
        return attention.scores(self.codec_c, query[..., :n], self.c) + attention.scores(
            self.codec_r, query[..., n:], self.r
        )

    def context(self, weights: torch.Tensor) -> torch.Tensor:
        return attention.context(self.codec_c, weights, self.c)

    def attend(self, query: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        return attention.attend(self.codec_c, self.codec_r, query, self.c, self.r, allowed)


# --- caches ------------------------------------------------------------------------------


class _SequenceCache:
    """Length bookkeeping and the DSA indexer keys, shared by every storage.

    Writes during a forward pass land after `length`; `commit(n)` makes them part of the
    cache once every layer has written its n rows. Readers returned by `append` see the
    committed rows plus the rows of the pass in progress, which is what causal attention needs.
    """

    codec = "f32"

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.length = 0
        self._index = {layer: _Buffer(layout.index_head_dim) for layer in layout.index_layers}

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store indexer keys [S, D] for this pass; return all keys so far [T, D]."""
        self._index[layer].write(self.length, keys)
        return self._index[layer].data[: self.length + keys.shape[0]]

    def index_keys(self, layer: int) -> torch.Tensor:
        return self._index[layer].data[: self.length]

    def commit(self, n: int) -> None:
        self.length += n

    def trim(self, length: int) -> None:
        """Forget every token from `length` on (a diverging prompt keeps the common prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} tokens to {length}")
        self.length = length

    def bytes_per_token_layer(self) -> int:
        raise NotImplementedError

    def index_bytes_per_token(self) -> int:
        return len(self.layout.index_layers) * self.layout.index_head_dim * 4

    def nbytes(self) -> int:
        """Bytes of latent rows in use (indexer keys are reported by `index_nbytes`)."""
        return self.length * self.layout.num_layers * self.bytes_per_token_layer()

    def index_nbytes(self) -> int:
        return self.length * self.index_bytes_per_token()

    def _index_state(self) -> dict[str, torch.Tensor]:
        return {f"index.{i}": self.index_keys(i).clone() for i in self.layout.index_layers}

    def _load_index_state(self, state: dict[str, torch.Tensor]) -> None:
        for i in self.layout.index_layers:
            self._index[i].write(0, state[f"index.{i}"])


class LatentCache(_SequenceCache):
    """Float32 rows [c | r]: the reference storage."""

    codec = "f32"

    def __init__(self, layout: CacheLayout):
        super().__init__(layout)
        self._rows = [_Buffer(layout.row_width) for _ in range(layout.num_layers)]

    def append(self, layer: int, rows: torch.Tensor) -> F32Rows:
        """Store rows [S, Lkv+R] for the tokens of this pass; return a reader over every row so far."""
        self._rows[layer].write(self.length, rows)
        return F32Rows(self._rows[layer].data[: self.length + rows.shape[0]], self.layout.kv_lora_rank)

    def view(self, layer: int) -> torch.Tensor:
        """The committed rows of one layer, [T, Lkv+R] (f32)."""
        return self._rows[layer].data[: self.length]

    def bytes_per_token_layer(self) -> int:
        return self.layout.row_width * 4

    def codec_params(self) -> dict:
        return {"name": "f32"}

    def allocated_nbytes(self) -> int:
        """Bytes the committed rows occupy, measured from the row tensors themselves."""
        return sum(self.view(i).numel() * 4 for i in range(self.layout.num_layers))

    def state(self) -> dict[str, torch.Tensor]:
        """The committed contents as plain tensors (copies), keyed by name."""
        out = {f"rows.{i}": self.view(i).clone() for i in range(self.layout.num_layers)}
        out.update(self._index_state())
        return out

    @classmethod
    def from_state(cls, layout: CacheLayout, state: dict[str, torch.Tensor]) -> LatentCache:
        cache = cls(layout)
        for i in range(layout.num_layers):
            cache._rows[i].write(0, state[f"rows.{i}"])
        cache._load_index_state(state)
        cache.length = state["rows.0"].shape[0]
        return cache


class PackedLatentCache(_SequenceCache):
    """Rows encoded by a codec: c and r each as (uint8 codes, float32 scales) per token."""

    def __init__(self, layout: CacheLayout, codec_c: Codec, codec_r: Codec):
        super().__init__(layout)
        self.codec = codec_c.name
        self.codec_c, self.codec_r = codec_c, codec_r
        self._buffers = [
            tuple(
                _Buffer(width, dtype)
                for width, dtype in (
                    (codec_c.code_bytes, torch.uint8),
                    (codec_c.scale_count, torch.float32),
                    (codec_r.code_bytes, torch.uint8),
                    (codec_r.scale_count, torch.float32),
                )
            )
            for _ in range(layout.num_layers)
        ]

    def append(self, layer: int, rows: torch.Tensor) -> PackedRows:
        """Encode rows [S, Lkv+R] of this pass; return a reader over every row so far."""
        n = self.layout.kv_lora_rank
        c, r = self.codec_c.encode(rows[:, :n]), self.codec_r.encode(rows[:, n:])
        for buffer, part in zip(self._buffers[layer], (c.codes, c.scales, r.codes, r.scales), strict=True):
            buffer.write(self.length, part)
        return self._reader(layer, self.length + rows.shape[0])

    def _reader(self, layer: int, end: int) -> PackedRows:
        codes_c, scales_c, codes_r, scales_r = (b.data[:end] for b in self._buffers[layer])
        return PackedRows(
            EncodedRows(codes_c, scales_c), EncodedRows(codes_r, scales_r), self.codec_c, self.codec_r
        )

    def view(self, layer: int) -> PackedRows:
        """The committed rows of one layer, still encoded."""
        return self._reader(layer, self.length)

    def bytes_per_token_layer(self) -> int:
        return self.codec_c.bytes_per_row + self.codec_r.bytes_per_row

    def codec_params(self) -> dict:
        return {"c": self.codec_c.params(), "r": self.codec_r.params()}

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
    def from_state(
        cls, layout: CacheLayout, codec_c: Codec, codec_r: Codec, state: dict[str, torch.Tensor]
    ) -> PackedLatentCache:
        cache = cls(layout, codec_c, codec_r)
        for i in range(layout.num_layers):
            parts = (state[f"{k}.{i}"] for k in ("c_codes", "c_scales", "r_codes", "r_scales"))
            for buffer, part in zip(cache._buffers[i], parts, strict=True):
                buffer.write(0, part)
        cache._load_index_state(state)
        cache.length = state["c_codes.0"].shape[0]
        return cache


def codecs_for(layout: CacheLayout, cfg: CacheConfig) -> tuple[Codec, Codec]:
    """The codec pair (c, r) a tier uses; raises ValueError if the widths don't suit it.

    A group size that does not divide the rope width leaves r with one scale per row.
    """
    rope_width = layout.row_width - layout.kv_lora_rank
    group_r = cfg.group_size if cfg.group_size and rope_width % cfg.group_size == 0 else None
    try:
        codec_c = get_codec(
            cfg.kv_cache_dtype, layout.kv_lora_rank, seed=cfg.rotation_seed, group_size=cfg.group_size
        )
        codec_r = get_codec(cfg.kv_cache_dtype, rope_width, seed=cfg.rotation_seed, group_size=group_r)
    except ValueError as exc:
        raise ValueError(
            f"--kv-cache-dtype {cfg.kv_cache_dtype} cannot store this model's latent rows "
            f"(kv_lora_rank {layout.kv_lora_rank}, qk_rope_head_dim {rope_width}): {exc}"
        ) from None
    return codec_c, codec_r


def make_cache(layout: CacheLayout, cfg: CacheConfig | None = None) -> LatentCache | PackedLatentCache:
    """An empty cache of the configured tier (f32, the reference, when none is given)."""
    if cfg is None or cfg.kv_cache_dtype == "f32":
        return LatentCache(layout)
    return PackedLatentCache(layout, *codecs_for(layout, cfg))
