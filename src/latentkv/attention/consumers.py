"""Native attention consumers: scores and context read straight from packed KV rows, the
arithmetic of the torch reference backend (`readers.py` applies it to each kind of reader).

For a query block q [..., n] and T encoded rows of one codec (width n):

    scores(codec, q, enc)   -> [..., T]   s_t = q . decode(row_t)
    context(codec, w, enc)  -> [..., n]   o   = sum_t w_t decode(row_t)

without rebuilding the float rows of the cache. Every codec is read in a working basis where
a row is `factor_t * values_t`, with the per-row factor kept out of the dot product:

    codec     basis     values_t (one tile at a time)       factor_t
    f32/bf16  rows      the stored values                   1
    fp8       rows      lut[byte]  (group scales folded in)  scale_t  (1 when grouped)
    tq*       rotated   level[code]                          radius_t / sqrt(n)
    polar*    rotated   unit vector from the angles          radius_t
    q8_0 .. q4_1  rows  levels x fp16 block scale (folded)  1
    hq8_0 ..      rotated  the same, of the rotated row         1
    q8s, wq4      rows  level[code] x block scale (folded)      1
    (tq* and polar* with grouped radii fold each group's radius into its values: factor 1)

    s_t = factor_t * (B q) . values_t          B = R (rotate) for tq / polar, identity otherwise
    o   = B^T sum_t (w_t factor_t) values_t    one unrotation per call, however large T is

The token axis is walked in tiles of `tile` rows, so the extra memory is one tile of unpacked
values plus one [M, tile] block of scores for M = prod(...) queries, whatever T is; prefill (many
queries) and decode (one) share the code. By default a tile holds as many rows as keep those two
within TILE_ELEMENTS float32 values (16 MB), and never fewer than DEFAULT_TILE: a decode step
(M = heads) reads up to ~7,000 rows of GLM-5's 512 + 64 in one tile, a plain softmax without the
running-max bookkeeping of the tiled loop (which costs ~0.3 ms a tile on a CPU core), while a
long prefill keeps tiles of 512. DSA reads
its top-k tokens the same way, from `enc.select(index)`. f32 rows are a free view of the cache and are read in one matmul.
The consumer is chosen by the codec's class through `CONSUMERS`, never by inspecting it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from latentkv.kv.codecs import (
    Bf16Codec,
    BlockCodec,
    Codec,
    EncodedRows,
    F32Codec,
    Fp8Codec,
    PolarCodec,
    RotatedBlockCodec,
    SearchedBlockCodec,
    TurboCodec,
)

DEFAULT_TILE = 512  # the fewest rows in a tile
TILE_ELEMENTS = 4 * 1024 * 1024  # float32 values of one tile's unpacked rows plus its scores


def tile_rows(queries: int, width: int, tile: int | None = None) -> int:
    """Rows per tile: `tile` when given, else as many as keep the unpacked rows [tile, width]
    and the scores [queries, tile] within TILE_ELEMENTS values, at least DEFAULT_TILE."""
    if tile is not None:
        return tile
    return max(DEFAULT_TILE, TILE_ELEMENTS // (width + queries))


# (codec, rows of one tile) -> (values [Tt, n] in the working basis, factor [Tt] or None)
TileReader = Callable[[Codec, EncodedRows], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Consumer:
    """How attention reads one codec family's rows."""

    read: TileReader
    rotated: bool = False  # working basis is R x: rotate queries, unrotate the context
    tiled: bool = True  # False: `read` is a free view, so the whole cache is one tile


def _read_f32(codec: F32Codec, enc: EncodedRows) -> tuple[torch.Tensor, None]:
    return codec.values(enc.codes), None


def _read_bf16(codec: Bf16Codec, enc: EncodedRows) -> tuple[torch.Tensor, None]:
    return codec.values(enc.codes).to(torch.float32), None


def _read_fp8(codec: Fp8Codec, enc: EncodedRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    values = codec.values(enc.codes)  # [Tt, n]
    if codec.scale_count == 1:
        return values, enc.scales[:, 0]
    grouped = values.view(len(enc), codec.scale_count, codec.group) * enc.scales[..., None]
    return grouped.view(len(enc), codec.width), None


def _read_turbo(codec: TurboCodec, enc: EncodedRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    if codec.group_size is not None:  # one radius per group: fold them into the values
        return codec.rotated_rows(enc), None
    return codec.rotated_values(enc.codes), enc.scales[:, 0] / math.sqrt(codec.width)


def _read_polar(codec: PolarCodec, enc: EncodedRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    if codec.group_size is not None:
        return codec.rotated_rows(enc), None
    return codec.unit_vectors(enc.codes), enc.scales[:, 0]


def _read_blocks(codec: BlockCodec | SearchedBlockCodec, enc: EncodedRows) -> tuple[torch.Tensor, None]:
    # each block's fp16 scale multiplies its integer levels as they are widened to float32
    return codec.block_values(enc.codes), None


CONSUMERS: dict[type[Codec], Consumer] = {
    F32Codec: Consumer(_read_f32, tiled=False),
    Bf16Codec: Consumer(_read_bf16),
    Fp8Codec: Consumer(_read_fp8),
    TurboCodec: Consumer(_read_turbo, rotated=True),
    PolarCodec: Consumer(_read_polar, rotated=True),
    BlockCodec: Consumer(_read_blocks),
    RotatedBlockCodec: Consumer(_read_blocks, rotated=True),
    SearchedBlockCodec: Consumer(_read_blocks),
}


def consumer_for(codec: Codec) -> Consumer:
    consumer = CONSUMERS.get(type(codec))
    if consumer is None:
        known = ", ".join(cls.__name__ for cls in CONSUMERS)
        raise ValueError(f"no attention consumer for {type(codec).__name__}; registered: {known}")
    return consumer


def _spans(total: int, tile: int, consumer: Consumer) -> Iterator[tuple[int, int]]:
    step = tile if consumer.tiled else max(total, 1)
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _check(codec: Codec, enc: EncodedRows, tile: int | None) -> None:
    codec.check_encoded(enc)
    if tile is not None and tile < 1:
        raise ValueError(f"tile must be positive, got {tile}")


def scores(codec: Codec, q: torch.Tensor, enc: EncodedRows, *, tile: int | None = None) -> torch.Tensor:
    """q [..., n] against T packed rows -> float32 [..., T]: q . decode(row_t)."""
    _check(codec, enc, tile)
    consumer = consumer_for(codec)
    if q.shape[-1] != codec.width:
        raise ValueError(f"queries of width {q.shape[-1]} against {codec.name} rows of width {codec.width}")
    lead = q.shape[:-1]
    qb = q.reshape(-1, codec.width).to(torch.float32)  # [M, n]
    if consumer.rotated:
        qb = codec.rotation.rotate(qb)
    out = torch.empty(qb.shape[0], len(enc), dtype=torch.float32, device=q.device)  # [M, T]
    for start, stop in _spans(len(enc), tile_rows(qb.shape[0], codec.width, tile), consumer):
        values, factor = consumer.read(codec, enc.rows(start, stop))  # [Tt, n], [Tt]
        block = qb @ values.T  # [M, Tt]
        if factor is not None:
            block.mul_(factor)
        out[:, start:stop] = block
    return out.view(*lead, len(enc))


def context(codec: Codec, w: torch.Tensor, enc: EncodedRows, *, tile: int | None = None) -> torch.Tensor:
    """Weights w [..., T] over T packed rows -> float32 [..., n]: sum_t w_t decode(row_t)."""
    _check(codec, enc, tile)
    consumer = consumer_for(codec)
    if w.shape[-1] != len(enc):
        raise ValueError(f"weights over {w.shape[-1]} tokens for {len(enc)} rows")
    lead = w.shape[:-1]
    wb = w.reshape(math.prod(lead), len(enc)).to(torch.float32)  # [M, T]
    acc = torch.zeros(
        wb.shape[0], codec.width, dtype=torch.float32, device=w.device
    )  # [M, n] in the working basis
    for start, stop in _spans(len(enc), tile_rows(wb.shape[0], codec.width, tile), consumer):
        values, factor = consumer.read(codec, enc.rows(start, stop))  # [Tt, n], [Tt]
        wt = wb[:, start:stop]
        if factor is not None:
            wt = wt * factor
        acc.addmm_(wt, values)
    if consumer.rotated:
        acc = codec.rotation.unrotate(acc)
    return acc.view(*lead, codec.width)


def attend(
    codec_c: Codec,
    codec_r: Codec,
    query: torch.Tensor,
    c: EncodedRows,
    r: EncodedRows,
    allowed: torch.Tensor | None = None,
    *,
    tile: int | None = None,
) -> torch.Tensor:
    """Fused MLA attention over packed rows, one pass with an online softmax.

    query [H, S, n_c + n_r] (q_abs | q_rope, already scaled); c, r: T packed rows of each part;
    allowed: optional bool [S, T] mask. Returns the latent context [H, S, n_c]:

        o = sum_t softmax_t(q_c . c_t + q_r . r_t) c_t

    Each tile of c is unpacked once and serves both the score and the context (calling
    `scores` then `context` would unpack it twice); the running max / normaliser keep memory
    at one tile however long T is.
    """
    return _attend(codec_c, codec_r, query, c, r, allowed, tile, want_lse=False)[0]


def attend_with_lse(
    codec_c: Codec,
    codec_r: Codec,
    query: torch.Tensor,
    c: EncodedRows,
    r: EncodedRows,
    allowed: torch.Tensor | None = None,
    *,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend`, plus the log-sum-exp of each query's scores [H, S] (-inf where nothing is allowed),
    so that attention over two disjoint sets of rows can be merged exactly (`merge`)."""
    out, lse = _attend(codec_c, codec_r, query, c, r, allowed, tile, want_lse=True)
    assert lse is not None
    return out, lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over disjoint row sets, each (context [H, S, n], lse [H, S]) -> the context over
    their union: sum_i out_i exp(lse_i - lse) with lse = log sum_i exp(lse_i). A part with no
    allowed row (lse -inf) contributes nothing, whatever its (NaN) context."""
    lses = torch.stack([lse for _, lse in parts])  # [P, H, S]
    total = torch.logsumexp(lses, dim=0)  # [H, S]
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = torch.zeros_like(parts[0][0])
    for (ctx, _), weight in zip(parts, torch.exp(lses - safe), strict=True):
        out += torch.where(weight[..., None] > 0, ctx * weight[..., None], 0.0)
    return out


def attend_f32_with_lse(
    query: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_with_lse` over float32 rows [T, Lkv + R] (the full-precision recent window):
    query [H, S, Lkv + R] (scaled), allowed bool [S, T] or None -> (context [H, S, Lkv], lse [H, S])."""
    if query.shape[-1] != rows.shape[1]:
        raise ValueError(f"queries of width {query.shape[-1]} against rows of width {rows.shape[1]}")
    s = torch.matmul(query.to(torch.float32), rows.T)  # [H, S, T]
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, S]
    return torch.matmul(torch.softmax(s, dim=-1), rows[:, :kv_lora_rank]), lse


def _attend(
    codec_c: Codec,
    codec_r: Codec,
    query: torch.Tensor,
    c: EncodedRows,
    r: EncodedRows,
    allowed: torch.Tensor | None,
    tile: int | None,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(codec_c, c, tile)
    _check(codec_r, r, tile)
    cons_c, cons_r = consumer_for(codec_c), consumer_for(codec_r)
    H, S, width = query.shape
    n = codec_c.width
    if width != n + codec_r.width or len(c) != len(r):
        raise ValueError(
            f"query width {width} / rows {len(c)}, {len(r)} do not match codecs {codec_c}, {codec_r}"
        )
    qc = query[..., :n].reshape(H * S, n).to(torch.float32)  # [M, n_c]
    qr = query[..., n:].reshape(H * S, codec_r.width).to(torch.float32)  # [M, n_r]
    if cons_c.rotated:
        qc = codec_c.rotation.rotate(qc)
    if cons_r.rotated:
        qr = codec_r.rotation.rotate(qr)
    M = H * S
    tile = tile_rows(M, width, tile)
    if len(c) <= tile:  # one tile: a plain softmax, without the running-max bookkeeping
        vc, fc = cons_c.read(codec_c, c)
        vr, fr = cons_r.read(codec_r, r)
        s = _scaled(qc @ vc.T, fc).add_(_scaled(qr @ vr.T, fr))  # [M, T]
        if allowed is not None:
            s.view(H, S, -1).masked_fill_(~allowed, float("-inf"))
        lse = torch.logsumexp(s, dim=-1).view(H, S) if want_lse else None
        out = _scaled(torch.softmax(s, dim=-1), fc) @ vc  # [M, n_c]
        if cons_c.rotated:
            out = codec_c.rotation.unrotate(out)
        return out.view(H, S, n), lse
    device = query.device
    best = torch.full((M, 1), float("-inf"), device=device)  # running max of the scores
    norm = torch.zeros(M, 1, device=device)  # running sum of exp(score - best)
    acc = torch.zeros(
        M, n, device=device
    )  # running sum of exp(score - best) * factor * values, working basis
    for start in range(0, len(c), tile):
        stop = min(start + tile, len(c))
        vc, fc = cons_c.read(codec_c, c.rows(start, stop))  # [Tt, n_c], [Tt]
        vr, fr = cons_r.read(codec_r, r.rows(start, stop))
        sc, sr = qc @ vc.T, qr @ vr.T  # [M, Tt]
        if fc is not None:
            sc.mul_(fc)
        if fr is not None:
            sr.mul_(fr)
        s = sc.add_(sr)
        if allowed is not None:
            s.view(H, S, -1).masked_fill_(~allowed[:, start:stop], float("-inf"))
        new_best = torch.maximum(best, s.max(dim=-1, keepdim=True).values)
        safe = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)  # all masked so far
        p = torch.exp(s - safe)  # [M, Tt]
        rescale = torch.exp(best - safe)
        norm = norm * rescale + p.sum(dim=-1, keepdim=True)
        if fc is not None:
            p.mul_(fc)
        acc = acc * rescale + p @ vc
        best = new_best
    out = acc / norm
    if cons_c.rotated:
        out = codec_c.rotation.unrotate(out)
    lse = (best + torch.log(norm)).view(H, S) if want_lse else None
    return out.view(H, S, n), lse


def _scaled(block: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """block [M, Tt] times a per-row factor [Tt] (in place), or unchanged when there is none."""
    return block if factor is None else block.mul_(factor)
