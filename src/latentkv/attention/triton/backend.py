"""The Triton attention backend: decode steps on a CUDA device through `decode.mla_decode`.

Serves every tier whose two codecs have a kernel format (all but polar*) on CUDA devices, for
one new token per sequence: `attend` with one query and no mask, `attend_batch` (B sequences
stored alike, their `blocked` mask turned into each sequence's list of rows), `attend_padded`
(a slot pool's float32 rows, one view per sequence). Everything else it is handed (a prefill's
many queries, a cache with a float32 recent window) goes to the torch reference on the same
device. `refuse` explains the pairs it does not serve; `backend_for` then picks the reference.

Nothing here imports triton until a kernel runs.
"""

from __future__ import annotations

import importlib.util

import torch

from latentkv.attention.base import register_backend
from latentkv.attention.reference import REFERENCE
from latentkv.attention.triton.formats import refusal
from latentkv.kv.cache import F32Rows, KVTier, PackedRows, RowReader
from latentkv.kv.codecs import get_codec


class TritonDecode:
    """Decode attention by the Triton kernels on CUDA; the rest through the torch reference."""

    name = "triton"

    def __init__(self, precision: str = "bf16"):
        self.precision = precision  # the quantized tiers'; f32 rows always take float32 products

    def refuse(self, tier: KVTier, device: torch.device) -> str | None:
        """None when the kernels read caches of `tier` (its codecs, its recent window) on `device`."""
        if device.type != "cuda":
            return f"needs a CUDA device (not {device.type})"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if tier.recent_window:
            return "a cache with a float32 recent window is read by the torch reference"
        reason = refusal(tier.codec_c) or refusal(tier.codec_r)
        return None if reason is None else f"tier {tier.name}: {reason}"

    def attend(
        self,
        query: torch.Tensor,
        reader: RowReader,
        allowed: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [H, S, Lkv+R]: one decode token over plain or packed rows runs the kernel."""
        if query.shape[1] != 1 or allowed is not None or not _servable([reader]):
            return REFERENCE.attend(query, reader, allowed, positions)
        return self._decode(query, [reader], None)

    def attend_selected(
        self, query: torch.Tensor, reader: RowReader, index: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, 1, Lkv+R] over the rows at `index` (DSA's top-k), gathered first."""
        return self.attend(query, reader.select(index), None, positions)

    def attend_batch(
        self, query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, B, Lkv+R], one reader per sequence, blocked [B, T'] (True: not attended)."""
        if not _servable(readers):
            return REFERENCE.attend_batch(query, readers, blocked)
        return self._decode(query, readers, blocked)

    def attend_padded(
        self, query: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None, kv_lora_rank: int
    ) -> torch.Tensor:
        """query [H, B, W] over padded float32 rows [B, T, W] (a slot pool's) -> [H, B, Lkv]."""
        readers = [F32Rows(rows[b], kv_lora_rank) for b in range(rows.shape[0])]
        return self._decode(query, readers, blocked)

    def _decode(
        self, query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
    ) -> torch.Tensor:
        """The kernel over B readers of one kind: query [H, B, W] -> context [H, B, Lkv]."""
        from latentkv.attention.triton.decode import SequenceRows, mla_decode

        first = readers[0]
        if isinstance(first, F32Rows):
            n = first.kv_lora_rank
            codec_c, codec_r = _f32_codecs(n, first.rows.shape[1] - n)
            rows = [SequenceRows(r.rows[:, :n], None, r.rows[:, n:], None) for r in readers]
            precision = "ieee"
        else:
            codec_c, codec_r = first.codec_c, first.codec_r
            rows = [SequenceRows(r.c.codes, r.c.scales, r.r.codes, r.r.scales) for r in readers]
            precision = self.precision
        lengths, index = _rows_attended(readers, blocked, query.device)
        out, _ = mla_decode(
            query.transpose(0, 1), codec_c, codec_r, rows, lengths, index, precision=precision
        )
        return out.transpose(0, 1)  # [H, B, Lkv]


def _servable(readers: list[RowReader]) -> bool:
    """Readers the kernel reads: all plain f32 rows, or all packed rows of one codec pair."""
    first = readers[0]
    if isinstance(first, F32Rows):
        return all(isinstance(r, F32Rows) for r in readers)
    if not isinstance(first, PackedRows) or tier_codec_refusal(first) is not None:
        return False
    return all(
        isinstance(r, PackedRows) and r.codec_c is first.codec_c and r.codec_r is first.codec_r
        for r in readers
    )


def tier_codec_refusal(reader: PackedRows) -> str | None:
    return refusal(reader.codec_c) or refusal(reader.codec_r)


_F32_CODECS: dict[tuple[int, int], tuple] = {}


def _f32_codecs(n_c: int, n_r: int) -> tuple:
    """The f32 codec pair of rows [c | r] (one pair per width, so the launcher's caches hit)."""
    if (n_c, n_r) not in _F32_CODECS:
        _F32_CODECS[(n_c, n_r)] = (get_codec("f32", n_c), get_codec("f32", n_r))
    return _F32_CODECS[(n_c, n_r)]


def _rows_attended(
    readers: list[RowReader], blocked: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lengths [B], index [B, K] or None): every row of each reader, or, under a mask, the rows
    it leaves (in ascending order: a stable sort puts the unblocked columns first)."""
    lengths = torch.tensor([len(r) for r in readers], dtype=torch.int32)
    if blocked is None:
        return lengths.to(device), None
    T = max(len(r) for r in readers)
    past = torch.arange(T, device=device)[None, :] >= lengths.to(device)[:, None]  # [B, T]
    hidden = blocked[:, :T] | past  # a reader's rows end at its length, whatever the mask says
    index = torch.sort(hidden.to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)  # [B, T]
    return (~hidden).sum(dim=1).to(torch.int32), index


TRITON = register_backend(TritonDecode())  # tried before the reference, which serves the rest
