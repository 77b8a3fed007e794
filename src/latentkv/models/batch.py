"""A forward pass's work: B ragged segments, each sequence's new tokens continuing its cache.

`Batch` is what every entry point builds (`Model.forward`: one sequence; `decode_batch`: one
new token of each of B sequences; `prefill_batch`: B prompts) and what the one `Block`
forward (`latentkv.models.model`) runs over. The N = sum S_b new tokens go through everything
that does not read a cache as one [N, D] batch (norms, projections, RoPE at each token's own
position, router, experts, lm_head); what reads a cache is done by the batch's reads, one of
two, chosen when the batch is built:

    per sequence  each segment's rows appended to its cache and attended over it on its own,
                  tiled, with the DSA indexer's choice per query (a single sequence, prefill)
    padded        one new token per sequence (decode, B > 1): rows [B, T, W] padded (T = the
                  longest context), DSA top-k per sequence and attention in one batched pass;
                  caches stored alike are written together (one encode per group), and float32
                  caches placed in a `SlotPool` are written with one op per layer and read as a
                  view of the pool

What is guaranteed: a batch of one sequence is the single-sequence pass, bit for bit. In a
larger batch, a sequence's logits are its single-sequence pass's up to float32 rounding: the
same formulas, but dense products over N rows and attention over padded rows sum in an order
that can depend on the batch's shape (tested within 1e-5 relative, alone and beside 15 other
sequences, on every tier and with DSA selecting). Not guaranteed: bitwise identity across batch
compositions (the CPU GEMM picks its kernel by the number of rows); DSA picks the same top-k
unless two indexer scores tie within that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from latentkv.attention import AttentionBackend, backend_for
from latentkv.attention import base as attention_base
from latentkv.kv.cache import CacheLayout, RowReader, SequenceCache
from latentkv.kv.slots import SlotPool
from latentkv.models.layers import Rope, RotaryTables

if TYPE_CHECKING:
    from latentkv.models.indexer import Indexer
    from latentkv.models.mla import MLA

Cache = SequenceCache


@dataclass
class Batch:
    """B segments: sequence b's sizes[b] new tokens (rows offsets[b].. of the pass) continue caches[b]."""

    tokens: torch.Tensor  # [N] int64
    caches: Sequence[Cache]
    sizes: list[int]
    rope: RotaryTables  # the N tokens' positions
    reads: _PerSequence | _Padded
    decode: bool = False  # one new token per sequence, B > 1: the decode paths (fused, batched MoE)
    offsets: list[int] = field(default_factory=list)
    # A few new tokens per sequence (speculative verify and draft passes): attention's dense
    # products take the one-token fused matrices row by row, as decode does (see `few`).
    few: bool = False

    @property
    def fused(self) -> bool:
        """Whether attention's projections take the fused decode matrices for every row."""
        return self.decode or self.few

    @property
    def decode_rows(self) -> bool:
        """Whether the MoE picks among its decode paths, as for one token of each of N sequences
        (its rows are independent): batched decode, and a `few`-token pass of more than one
        token (a lone token takes the one-token path either way)."""
        return self.decode or (self.few and self.tokens.shape[0] > 1)

    @property
    def last_rows(self) -> torch.Tensor:
        """Each segment's last row [B]."""
        last = [o + n - 1 for o, n in zip(self.offsets, self.sizes, strict=True)]
        return torch.tensor(last, device=self.tokens.device)

    def commit(self) -> None:
        for cache, n in zip(self.caches, self.sizes, strict=True):
            cache.commit(n)


# A pass of at most this many new tokens per sequence may take the fused decode matrices (`few`):
# on a small model a verify pass of N + 1 tokens is bound by per-op overhead, like a decode step.
# (--draft-tokens is at most 8: engine.speculative.MAX_DRAFT_TOKENS, plus the pending token.)
FEW_TOKENS = 9


def few(sizes: Sequence[int]) -> bool:
    """Whether a speculative pass of segments `sizes` runs attention's fused decode products."""
    return max(sizes) <= FEW_TOKENS


def one_sequence(
    rope: Rope, tokens: torch.Tensor, cache: Cache, position: int | None = None, speculative: bool = False
) -> Batch:
    """`tokens` [S] continuing `cache` (positions from cache.length, or from `position` for a
    cache whose rows start past position 0: the MTP draft layer's, `latentkv.models.mtp`).
    `speculative`: a verify or draft pass, which takes the fused products when S is `few`."""
    S = tokens.shape[0]
    tables = rope.tables(cache.length if position is None else position, S)
    reads = _PerSequence([cache], [None], [tables], backend_for(cache.tier, tokens.device))
    return Batch(tokens, [cache], [S], tables, reads, offsets=[0], few=speculative and few([S]))


def prefill(
    rope: Rope,
    prompts: Sequence[torch.Tensor],
    caches: Sequence[Cache],
    starts: Sequence[int] | None = None,
    speculative: bool = False,
) -> Batch:
    """One prompt [S_b] per cache, each continuing its cache (at positions from its length, or
    from starts[b] for caches whose rows start past position 0, as in `one_sequence`);
    `speculative` as in `one_sequence`."""
    sizes = [p.shape[0] for p in prompts]
    starts = [c.length for c in caches] if starts is None else list(starts)
    offsets = [sum(sizes[:b]) for b in range(len(sizes))]
    device = prompts[0].device
    positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, sizes, strict=True)])
    tables = rope.at(positions)
    parts = [slice(o, o + n) for o, n in zip(offsets, sizes, strict=True)]
    ropes = [RotaryTables(tables.cos[p], tables.sin[p]) for p in parts]  # each sequence's own positions
    reads = _PerSequence(list(caches), parts, ropes, backend_for(caches[0].tier, device))
    few_rows = speculative and few(sizes)
    return Batch(torch.cat(list(prompts)), caches, sizes, tables, reads, offsets=offsets, few=few_rows)


def decode(
    rope: Rope, tokens: torch.Tensor, caches: Sequence[Cache], pool: SlotPool | None, slots: list[int] | None
) -> Batch:
    """One new token [B] per cache (B > 1); `slots`: the caches' slots in `pool`, in order
    (`pool_slots`), or None when the step runs on their own buffers."""
    lengths = [c.length for c in caches]
    ends = [n + 1 for n in lengths]
    T = max(ends)
    device = tokens.device
    positions = torch.tensor(lengths, dtype=torch.long, device=device)
    tables = rope.at(positions)
    blocked = None
    if min(ends) < T:
        blocked = (
            torch.arange(T, device=device)[None, :] >= torch.tensor(ends, device=device)[:, None]
        )  # [B, T]
    if slots is None:
        store: _OwnBuffers | _Slots = _OwnBuffers(caches, _tier_groups(caches), device)
    else:  # the pool's caches are float32, stored alike
        store = _Slots(pool, slots, positions, T, backend_for(caches[0].tier, device))
    reads = _Padded(tables, ends, blocked, store)
    return Batch(tokens, caches, [1] * len(caches), tables, reads, decode=True)


class _PerSequence:
    """Each segment appended to its own cache and attended over it alone (tiled), as one
    sequence's pass does; `selected` is each segment's DSA choice."""

    def __init__(
        self,
        caches: list[Cache],
        parts: list[slice | None],  # each segment's rows of the pass (None: all of them)
        ropes: list[RotaryTables],
        backend: AttentionBackend,
    ):
        self.caches, self.parts, self.ropes, self.backend = caches, parts, ropes, backend
        self._positions: list[torch.Tensor | None] = [None] * len(caches)  # each segment's, made once

    def attend(
        self,
        layer: int,
        attn: MLA,
        indexer: Indexer | None,
        h: torch.Tensor,
        k_in: torch.Tensor | None,
        query: torch.Tensor,
        rows: torch.Tensor,
        q_resid: torch.Tensor | None,
        rope: RotaryTables,
        selected: list | None,
    ) -> tuple[torch.Tensor, list]:
        """-> (context [H, N, Lkv], the segments' DSA choices for the layers that share them)."""
        if selected is None:
            selected = [None] * len(self.caches)
        keys = indexer.keys(k_in, rope) if indexer is not None else None
        context = []
        for b, (cache, p) in enumerate(zip(self.caches, self.parts, strict=True)):
            if p is not None:  # one of several segments: its rows
                rows_b, query_b, h_b = rows[p], query[:, p], h[p]
                keys_b = None if keys is None else keys[p]
                q_b = None if q_resid is None else q_resid[p]
            else:
                rows_b, query_b, h_b, keys_b, q_b = rows, query, h, keys, q_resid
            reader = cache.append(layer, rows_b)
            if indexer is not None:
                cached = cache.append_index_keys(layer, keys_b)
                selected[b] = indexer.select(h_b, q_b, self.ropes[b], cached, cache.length)
            if self._positions[b] is None:  # every layer reads the same positions
                n = query_b.shape[1]
                self._positions[b] = torch.arange(cache.length, cache.length + n, device=query.device)
            positions = self._positions[b]
            context.append(attn.context(query_b, reader, cache.length, selected[b], self.backend, positions))
        return (context[0] if len(context) == 1 else torch.cat(context, dim=1)), selected


class _Padded:
    """One new token per sequence, read over padded rows in one batched pass (module docstring)."""

    def __init__(
        self, rope: RotaryTables, ends: list[int], blocked: torch.Tensor | None, store: _OwnBuffers | _Slots
    ):
        self.rope, self.ends, self.blocked, self.store = rope, ends, blocked, store

    def attend(
        self,
        layer: int,
        attn: MLA,
        indexer: Indexer | None,
        h: torch.Tensor,
        k_in: torch.Tensor | None,
        query: torch.Tensor,
        rows: torch.Tensor,
        q_resid: torch.Tensor | None,
        rope: RotaryTables,
        selected: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (context [H, B, Lkv], the DSA choice as a `blocked` mask [B, T], shared layers reuse it)."""
        readers = self.store.rows(layer, rows)
        if indexer is not None:
            keys = self.store.keys(layer, indexer.keys(k_in, rope))  # new keys [B, D_i]
            selected = indexer.select_batch(h, q_resid, rope, keys, self.ends, self.blocked)
        blocked = self.blocked if selected is None else selected
        return self.store.attend(query, readers, blocked), selected


class _OwnBuffers:
    """A step's caches each in their own buffers: B appends per layer, read through readers.
    Packed caches stored alike have their new rows encoded in one call per group."""

    def __init__(self, caches: Sequence[Cache], groups: list[list[int]], device: torch.device):
        self.caches, self.groups = caches, groups
        self.backends = [backend_for(caches[members[0]].tier, device) for members in groups]

    def rows(self, layer: int, rows: torch.Tensor) -> list[RowReader]:
        readers: list[RowReader | None] = [None] * len(self.caches)
        for members in self.groups:
            group = [self.caches[b] for b in members]
            if len(members) == len(self.caches):
                part = rows
            elif len(members) == 1:
                part = rows[members[0] : members[0] + 1]
            else:
                part = rows[torch.tensor(members, device=rows.device)]
            got = group[0].append_each(group, layer, part)  # packed caches encode a group in one call
            for b, reader in zip(members, got, strict=True):
                readers[b] = reader
        return readers

    def keys(self, layer: int, keys: torch.Tensor) -> list[torch.Tensor]:
        return [
            cache.append_index_keys(layer, k) for cache, k in zip(self.caches, keys.split(1), strict=True)
        ]

    def attend(
        self, query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, B, Lkv+R] (scaled), one reader per sequence, blocked bool [B, T] (True: not
        attended; None: every row of every reader) -> context [H, B, Lkv]; each group of
        sequences stored alike is read together (padded)."""
        if len(self.groups) == 1:
            return self.backends[0].attend_batch(query, readers, blocked)
        H, B, _ = query.shape
        out = None
        for members, backend in zip(self.groups, self.backends, strict=True):
            index = torch.tensor(members, device=query.device)
            part = backend.attend_batch(
                query[:, index], [readers[b] for b in members], None if blocked is None else blocked[index]
            )
            if out is None:
                out = part.new_empty(H, B, part.shape[-1])
            out[:, index] = part
        return out


class _Slots:
    """A step's float32 caches all placed in one `SlotPool`: one write per layer, the padded
    rows read straight from the pool ([B, T, width], zero or masked past each end)."""

    def __init__(
        self, pool: SlotPool, slots: list[int], positions: torch.Tensor, T: int, backend: AttentionBackend
    ):
        self.pool, self.T, self.backend = pool, T, backend
        self.flat = pool.flat_index(slots, positions)
        contiguous = slots[-1] - slots[0] == len(slots) - 1  # (slots are in order: see decode_batch)
        self.index = (
            slice(slots[0], slots[-1] + 1) if contiguous else torch.tensor(slots, device=positions.device)
        )

    def rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        return self._store(self.pool.rows[layer], rows)

    def keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        return self._store(self.pool.keys[layer], keys)

    def attend(self, query: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
        """query [H, B, W] over the padded rows `rows` gave -> [H, B, Lkv]."""
        return self.backend.attend_padded(query, rows, blocked, self.pool.layout.kv_lora_rank)

    def _store(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.pool.write(tensor, self.flat, rows)
        return self.pool.padded(tensor, self.index, self.T)


def pool_slots(
    layout: CacheLayout, pool: SlotPool | None, caches: Sequence[Cache], T: int
) -> list[int] | None:
    """The caches' slots when a step can run on the pool: all placed, padded reads within
    BATCH_ATTEND_ELEMENTS, and room for T rows (growing the pool may hand the caches their own
    buffers back instead, then None)."""
    if pool is None:
        return None
    slots = [pool.slot_of(c) for c in caches]
    if None in slots:
        return None
    width = max(layout.row_width, layout.index_head_dim)
    if len(caches) * T * width > attention_base.BATCH_ATTEND_ELEMENTS or not pool.reserve(T):
        return None
    return slots


def _tier_groups(caches: Sequence[Cache]) -> list[list[int]]:
    """Indices of the caches stored alike (one tier key), in batch order."""
    groups: dict[tuple, list[int]] = {}
    for b, cache in enumerate(caches):
        groups.setdefault(cache.tier.key, []).append(b)
    return list(groups.values())


def check_batch(
    cfg_vocab: int,
    limit: int,
    layout: CacheLayout,
    tokens: torch.Tensor,
    caches: Sequence[Cache],
    sizes: Sequence[int],
) -> list[int]:
    """The caches' lengths, after checking that cache b can take the next sizes[b] of `tokens`
    (int64 [sum sizes]): at least one cache, none twice, ids in the vocabulary, caches of this
    model, contexts within its maximum. Shared by every entry point."""
    if not caches:
        raise ValueError("0 caches: a batch needs at least one")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("the same cache appears twice in one batch")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg_vocab):
        raise ValueError(f"token ids out of range for a vocabulary of {cfg_vocab}: {tokens.tolist()[:8]}")
    lengths = [c.length for c in caches]
    for c, n, size in zip(caches, lengths, sizes, strict=True):
        if c.layout != layout:
            raise ValueError(f"a cache of layout {c.layout} does not belong to this model ({layout})")
        if n + size > limit:
            raise ValueError(f"context of {n + size} tokens exceeds the model's maximum of {limit}")
    return lengths
