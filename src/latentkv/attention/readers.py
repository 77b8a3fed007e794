"""How the torch reference reads each kind of cached rows (`latentkv.kv.cache`'s readers).

A reader hands over one layer's stored rows and their scales, nothing more; the arithmetic is
here, one entry per reader kind:

    F32Rows       float32 rows [T, Lkv+R]: two plain matmuls, the reference arithmetic
                  (byte-identical to the engine before any tier existed)
    PackedRows    each part's codes and scales, read in place by its codec's consumer
                  (`latentkv.attention.consumers`), one pass with an online softmax
    WindowedRows  a packed tier's rows plus the float32 rows of the recent window: a query at
                  position p reads rows p - W + 1 .. p exactly and every older row from the
                  tier; the two parts are attended separately and merged through their
                  log-sum-exps, which is exactly one softmax over the union

    attend(query, reader, allowed, positions)   query [H, S, Lkv+R] (scaled) -> [H, S, Lkv]
    scores(query, reader, positions)            -> [H, S, T]: q_abs . c_t + q_rope . r_t
    context(weights, reader, positions)         weights [H, S, T] -> [H, S, Lkv]: sum_t w_t c_t

`positions` [S] are the queries' token positions. Only a windowed reader reads them (to know
which rows a query sees in full precision); without them it assumes the queries are the tokens
of the pass that made the reader, and refuses a slice of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from latentkv.attention import consumers
from latentkv.kv.cache import F32Rows, PackedRows, RowReader, WindowedRows


def attend(
    query: torch.Tensor,
    reader: RowReader,
    allowed: torch.Tensor | None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [H, S, Lkv+R] (scaled), allowed bool [S, T] or None -> context [H, S, Lkv]."""
    return _kind(reader).attend(query, reader, allowed, positions)


def scores(query: torch.Tensor, reader: RowReader, positions: torch.Tensor | None = None) -> torch.Tensor:
    """query [H, S, Lkv+R] -> [H, S, T]: q_abs . c_t + q_rope . r_t."""
    return _kind(reader).scores(query, reader, positions)


def context(weights: torch.Tensor, reader: RowReader, positions: torch.Tensor | None = None) -> torch.Tensor:
    """weights [H, S, T] -> [H, S, Lkv]: sum_t w_t c_t."""
    return _kind(reader).context(weights, reader, positions)


# --- float32 rows ----------------------------------------------------------------------------


def _scores_f32(query: torch.Tensor, reader: F32Rows, positions=None) -> torch.Tensor:
    return torch.matmul(query, reader.rows.T)


def _context_f32(weights: torch.Tensor, reader: F32Rows, positions=None) -> torch.Tensor:
    return torch.matmul(weights, reader.rows[:, : reader.kv_lora_rank])


def _attend_f32(
    query: torch.Tensor, reader: F32Rows, allowed: torch.Tensor | None, positions=None
) -> torch.Tensor:
    s = torch.matmul(query, reader.rows.T)  # [H, S, T]
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), reader.rows[:, : reader.kv_lora_rank])


# --- packed rows -----------------------------------------------------------------------------


def _scores_packed(query: torch.Tensor, reader: PackedRows, positions=None) -> torch.Tensor:
    n = reader.codec_c.width
    return consumers.scores(reader.codec_c, query[..., :n], reader.c) + consumers.scores(
        reader.codec_r, query[..., n:], reader.r
    )


def _context_packed(weights: torch.Tensor, reader: PackedRows, positions=None) -> torch.Tensor:
    return consumers.context(reader.codec_c, weights, reader.c)


def _attend_packed(
    query: torch.Tensor, reader: PackedRows, allowed: torch.Tensor | None, positions=None
) -> torch.Tensor:
    return consumers.attend(reader.codec_c, reader.codec_r, query, reader.c, reader.r, allowed)


# --- a packed tier with a float32 recent window --------------------------------------------


@dataclass(frozen=True)
class _Split:
    """The rows a block of queries reads from the tier and in float32, as columns of the reader."""

    tier: PackedRows  # rows some query reads from the tier
    tier_cols: slice | torch.Tensor
    tier_mask: torch.Tensor  # [S, To]: query s reads tier row j
    exact: torch.Tensor  # [Tn, Lkv+R] float32 rows some query reads exactly
    exact_cols: slice | torch.Tensor
    exact_mask: torch.Tensor  # [S, Tn]


def _query_positions(reader: WindowedRows, count: int, positions: torch.Tensor | None) -> torch.Tensor:
    if positions is not None:
        if positions.shape != (count,):
            raise ValueError(f"positions {tuple(positions.shape)} for {count} queries")
        return positions.to(torch.int64)
    if count != reader.query_count:
        raise ValueError(
            f"a cache with a recent window needs the positions of these {count} queries (its "
            f"reader was made for the {reader.query_count} tokens from position {reader.query_start})"
        )
    return torch.arange(reader.query_start, reader.query_start + count, device=reader.recent.device)


def _split(reader: WindowedRows, qpos: torch.Tensor) -> _Split:
    """Which rows the queries at positions qpos [S] read from the tier, which in float32. Row
    positions are 0..T-1, or, after `select` (DSA), the selected indices."""
    T, first_exact = len(reader), qpos - reader.window + 1  # [S]: each query's oldest exact position
    packed, positions, recent = reader.packed, reader.positions, reader.recent
    if positions is None:  # rows 0..T-1: the tier part is a prefix, the exact part a suffix
        old_end = min(max(int(qpos.max()) - reader.window + 1, 0), T)
        new_start = min(max(int(first_exact.min()), 0), T)
        old_cols, new_cols = slice(0, old_end), slice(new_start, T)
        old, old_pos = packed.rows(0, old_end), torch.arange(old_end, device=qpos.device)
        new_pos = torch.arange(new_start, T, device=qpos.device)
    else:  # DSA's selection, in its own order
        is_old = positions[None, :] < first_exact[:, None]  # [S, T]
        old_cols = is_old.any(dim=0).nonzero().squeeze(1)
        new_cols = (~is_old).any(dim=0).nonzero().squeeze(1)
        old, old_pos = packed.select(old_cols), positions.index_select(0, old_cols)
        new_pos = positions.index_select(0, new_cols)
    at = new_pos - reader.recent_start  # rows of `recent`
    if len(at) and (int(at.min()) < 0 or int(at.max()) >= len(recent)):
        held = f"{reader.recent_start}..{reader.recent_start + len(recent) - 1}"
        raise RuntimeError(
            f"the window holds positions {held}, not {int(new_pos.min())}..{int(new_pos.max())}"
        )
    # a suffix of the rows is a slice of `recent` (a view); a selection gathers its rows
    exact = recent[at] if positions is not None else recent[len(recent) - len(at) :]
    return _Split(
        tier=old,
        tier_cols=old_cols,
        tier_mask=old_pos[None, :] < first_exact[:, None],  # [S, To]
        exact=exact,
        exact_cols=new_cols,
        exact_mask=new_pos[None, :] >= first_exact[:, None],  # [S, Tn]
    )


def _mask(
    allowed: torch.Tensor | None, cols: slice | torch.Tensor, part: torch.Tensor
) -> torch.Tensor | None:
    """allowed [S, T] restricted to `cols`, and'ed with a part's own mask [S, len(cols)]; None if all True."""
    mask = part if allowed is None else allowed[:, cols] & part
    return None if bool(mask.all()) else mask


def _attend_windowed(
    query: torch.Tensor,
    reader: WindowedRows,
    allowed: torch.Tensor | None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    split = _split(reader, _query_positions(reader, query.shape[1], positions))
    codec_c, codec_r = split.tier.codec_c, split.tier.codec_r
    parts = []
    if len(split.tier):
        mask = _mask(allowed, split.tier_cols, split.tier_mask)
        parts.append(consumers.attend_with_lse(codec_c, codec_r, query, split.tier.c, split.tier.r, mask))
    if len(split.exact):
        mask = _mask(allowed, split.exact_cols, split.exact_mask)
        parts.append(consumers.attend_f32_with_lse(query, split.exact, codec_c.width, mask))
    return parts[0][0] if len(parts) == 1 else consumers.merge(parts)


def _scores_windowed(
    query: torch.Tensor, reader: WindowedRows, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Each query's window columns from the float32 rows, the rest from the tier."""
    split = _split(reader, _query_positions(reader, query.shape[1], positions))
    out = _scores_packed(query, reader.packed)  # [H, S, T]
    exact = torch.matmul(query.to(torch.float32), split.exact.T)  # [H, S, Tn]
    cols = split.exact_cols
    out[..., cols] = torch.where(split.exact_mask, exact, out[..., cols])
    return out


def _context_windowed(
    weights: torch.Tensor, reader: WindowedRows, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Each query's window rows read in float32, the rest from the tier."""
    split = _split(reader, _query_positions(reader, weights.shape[1], positions))
    cols, n = split.exact_cols, reader.packed.codec_c.width
    tier_w = weights.clone()
    tier_w[..., cols] = torch.where(split.exact_mask, 0.0, tier_w[..., cols])
    exact_w = torch.where(split.exact_mask, weights[..., cols], 0.0)  # [H, S, Tn]
    return _context_packed(tier_w, reader.packed) + torch.matmul(exact_w, split.exact[:, :n])


# --- one entry per reader kind -----------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    attend: Callable[..., torch.Tensor]
    scores: Callable[..., torch.Tensor]
    context: Callable[..., torch.Tensor]


KINDS: dict[type, _Kind] = {
    F32Rows: _Kind(_attend_f32, _scores_f32, _context_f32),
    PackedRows: _Kind(_attend_packed, _scores_packed, _context_packed),
    WindowedRows: _Kind(_attend_windowed, _scores_windowed, _context_windowed),
}


def _kind(reader: RowReader) -> _Kind:
    kind = KINDS.get(type(reader))
    if kind is None:
        known = ", ".join(cls.__name__ for cls in KINDS)
        raise ValueError(f"the torch reference reads no {type(reader).__name__}; it reads {known}")
    return kind
