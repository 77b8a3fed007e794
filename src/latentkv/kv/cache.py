"""LatentCache: the attention cache of one sequence, one latent row per token per layer.

Per token per layer the cache holds `c` (kv_lora_rank values, the RMS-normed latent) and `r`
(qk_rope_head_dim values, the RoPE'd shared key), stored side by side as one row
`[c | r]` of width Lkv + R. Never per-head K/V. DSA models also keep the indexer's keys for
every layer that runs its own indexer ("full" layers).

The interface is small on purpose (append / view / trim / nbytes / state) so that a quantized
storage format can replace the f32 rows without the model noticing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latentkv.config import ModelConfig


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


class _Rows:
    """A growable [T, width] float32 buffer (amortised doubling, no per-token reallocation)."""

    def __init__(self, width: int, capacity: int = 64):
        self.data = torch.empty(capacity, width, dtype=torch.float32)

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if end > self.data.shape[0]:
            grown = torch.empty(max(end, 2 * self.data.shape[0]), self.data.shape[1], dtype=torch.float32)
            grown[:start] = self.data[:start]
            self.data = grown
        self.data[start:end] = rows

    def nbytes(self, length: int) -> int:
        return length * self.data.shape[1] * self.data.element_size()


class LatentCache:
    """f32 latent rows for one sequence.

    Writes during a forward pass land after `length`; `commit(n)` makes them part of the
    cache once every layer has written its n rows. Reads (`view`) see the committed rows plus
    the rows written by the pass in progress, which is what causal attention needs.
    """

    codec = "f32"

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.length = 0
        self._rows = [_Rows(layout.row_width) for _ in range(layout.num_layers)]
        self._index = {layer: _Rows(layout.index_head_dim) for layer in layout.index_layers}

    # --- the interface the model uses ----------------------------------------------------
    def append(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Store rows [S, Lkv+R] for the tokens of this pass; return every row so far [T, Lkv+R]."""
        self._rows[layer].write(self.length, rows)
        return self._rows[layer].data[: self.length + rows.shape[0]]

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store indexer keys [S, D] for this pass; return all keys so far [T, D]."""
        self._index[layer].write(self.length, keys)
        return self._index[layer].data[: self.length + keys.shape[0]]

    def commit(self, n: int) -> None:
        self.length += n

    def view(self, layer: int) -> torch.Tensor:
        """The committed rows of one layer, [T, Lkv+R] (f32)."""
        return self._rows[layer].data[: self.length]

    def index_keys(self, layer: int) -> torch.Tensor:
        return self._index[layer].data[: self.length]

    def trim(self, length: int) -> None:
        """Forget every token from `length` on (a diverging prompt keeps the common prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} tokens to {length}")
        self.length = length

    # --- accounting and persistence ------------------------------------------------------
    def bytes_per_token_layer(self) -> int:
        return self.layout.row_width * 4

    def index_bytes_per_token(self) -> int:
        return len(self.layout.index_layers) * self.layout.index_head_dim * 4

    def nbytes(self) -> int:
        """Bytes of latent rows in use (indexer keys are reported by `index_nbytes`)."""
        return self.length * self.layout.num_layers * self.bytes_per_token_layer()

    def index_nbytes(self) -> int:
        return self.length * self.index_bytes_per_token()

    def state(self) -> dict[str, torch.Tensor]:
        """The committed contents as plain tensors (copies), keyed by name."""
        out = {f"rows.{i}": self.view(i).clone() for i in range(self.layout.num_layers)}
        out.update({f"index.{i}": self.index_keys(i).clone() for i in self.layout.index_layers})
        return out

    @classmethod
    def from_state(cls, layout: CacheLayout, state: dict[str, torch.Tensor]) -> LatentCache:
        cache = cls(layout)
        length = state["rows.0"].shape[0]
        for i in range(layout.num_layers):
            cache._rows[i].write(0, state[f"rows.{i}"])
        for i in layout.index_layers:
            cache._index[i].write(0, state[f"index.{i}"])
        cache.length = length
        return cache
