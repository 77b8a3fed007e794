"""The reference attention backend: torch ops over the cache's stored rows.

One sequence: `readers.attend` (attention/readers.py) over its reader (f32 rows in two matmuls; packed rows tiled, each
codec's consumer, `consumers.py`, reading the stored format; a recent window's two parts merged).
A batch of decode tokens stored alike: the rows padded to [B, T, W] (zero past each end) and
attended in one batched pass, f32 rows as they are and packed rows through the same consumers
(`_attend_packed` is `consumers.attend`'s one-tile arithmetic over the padded codes); past
BATCH_ATTEND_ELEMENTS, or for readers of mixed kinds, each sequence on its own.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from latentkv.attention import base
from latentkv.attention.base import register_backend
from latentkv.attention.consumers import consumer_for
from latentkv.attention.readers import attend as attend_rows
from latentkv.kv.cache import F32Rows, KVTier, PackedRows, RowReader
from latentkv.kv.codecs import EncodedRows


class TorchReference:
    """Serves every tier on every device torch runs on: the reference for other backends."""

    name = "torch"

    def refuse(self, tier: KVTier, device: torch.device) -> str | None:
        return None

    def attend(
        self,
        query: torch.Tensor,
        reader: RowReader,
        allowed: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [H, S, Lkv+R] over one sequence's rows -> [H, S, Lkv]."""
        return attend_rows(query, reader, allowed, positions)

    def attend_selected(
        self, query: torch.Tensor, reader: RowReader, index: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, 1, Lkv+R] over the rows at `index` [K]: gathered (`select`), then attended."""
        return attend_rows(query, reader.select(index), None, positions)

    def attend_batch(
        self, query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, B, Lkv+R], one reader per sequence (stored alike), blocked [B, T'] (True:
        not attended; T' >= every reader's length) -> context [H, B, Lkv]."""
        return _attend_group(query, readers, blocked)

    def attend_padded(
        self, query: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None, kv_lora_rank: int
    ) -> torch.Tensor:
        """query [H, B, W] over padded float32 rows [B, T, W] -> [H, B, Lkv]."""
        return _attend_f32(query.transpose(0, 1), rows, blocked, kv_lora_rank).transpose(0, 1)


def _attend_group(
    query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
) -> torch.Tensor:
    """Context [H, B, Lkv] of readers of one tier; blocked [B, T'] with T' >= every reader's length."""
    B = len(readers)
    T = max(len(r) for r in readers)
    if blocked is not None:
        blocked = blocked[:, :T]
    kind = type(readers[0])
    if B * T * query.shape[-1] > base.BATCH_ATTEND_ELEMENTS or any(type(r) is not kind for r in readers):
        return _attend_each(query, readers, blocked)
    q = query.transpose(0, 1)  # [B, H, W]
    if kind is F32Rows:
        rows = pad_rows([r.rows for r in readers])  # [B, T, W]
        return _attend_f32(q, rows, blocked, readers[0].kv_lora_rank).transpose(0, 1)
    if kind is PackedRows:
        return _attend_packed(q, readers, blocked, T).transpose(0, 1)
    return _attend_each(query, readers, blocked)  # any other reader: one sequence at a time


def _attend_f32(
    q: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None, kv_lora_rank: int
) -> torch.Tensor:
    """q [B, H, W] over padded float32 rows [B, T, W] -> [B, H, Lkv]."""
    scores = torch.matmul(q, rows.transpose(1, 2))  # [B, H, T]
    if blocked is not None:
        scores.masked_fill_(blocked[:, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), rows[..., :kv_lora_rank])


def pad_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[T_b, ...] each -> [B, max T_b, ...], zero past each one's end (a view when B == 1; a
    plain stack, which skips the zero fill, when all have one length)."""
    if len(tensors) == 1:
        return tensors[0].unsqueeze(0)
    if all(t.shape[0] == tensors[0].shape[0] for t in tensors):
        return torch.stack(tensors)
    return pad_sequence(tensors, batch_first=True)


def _attend_packed(
    q: torch.Tensor, readers: list[PackedRows], blocked: torch.Tensor | None, T: int
) -> torch.Tensor:
    """q [B, H, n_c + n_r] over B packed readers of one codec pair -> [B, H, n_c].

    `consumers.attend`'s one-tile arithmetic over the padded rows: padding is zero
    codes with zero scales, which every consumer reads as finite values with factor 0."""
    codec_c, codec_r = readers[0].codec_c, readers[0].codec_r
    n = codec_c.width
    B, H, _ = q.shape
    s, vc, fc = None, None, None
    for codec, part, qp in ((codec_c, "c", q[..., :n]), (codec_r, "r", q[..., n:])):
        consumer = consumer_for(codec)
        encoded = [getattr(r, part) for r in readers]
        codes = pad_rows([e.codes for e in encoded]).view(B * T, -1)  # [B T, bytes]
        scales = pad_rows([e.scales for e in encoded]).view(B * T, -1)
        values, factor = consumer.read(codec, EncodedRows(codes, scales))
        values = values.view(B, T, codec.width)
        if consumer.rotated:
            qp = codec.rotation.rotate(qp.reshape(B * H, -1)).view(B, H, -1)
        block = torch.matmul(qp, values.transpose(1, 2))  # [B, H, T]
        if factor is not None:
            factor = factor.view(B, 1, T)
            block.mul_(factor)
        s = block if s is None else s.add_(block)
        if part == "c":
            vc, fc = values, factor
    if blocked is not None:
        s.masked_fill_(blocked[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if fc is not None:
        p = p * fc
    out = torch.matmul(p, vc)  # [B, H, n_c] in the working basis
    if consumer_for(codec_c).rotated:
        out = codec_c.rotation.unrotate(out.reshape(B * H, n)).view(B, H, n)
    return out


def _attend_each(query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None) -> torch.Tensor:
    """One sequence at a time (tiled, any tier), as single-sequence decode does."""
    parts = []
    for b, reader in enumerate(readers):
        position = torch.tensor(
            [len(reader) - 1], device=query.device
        )  # the new token's (a recent window reads it)
        if blocked is not None and bool(blocked[b, : len(reader)].any()):
            reader = reader.select((~blocked[b, : len(reader)]).nonzero().squeeze(1))
        parts.append(attend_rows(query[:, b : b + 1], reader, None, position))  # [H, 1, Lkv]
    return torch.cat(parts, dim=1)


REFERENCE = register_backend(TorchReference())
