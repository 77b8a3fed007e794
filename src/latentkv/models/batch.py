"""One decode step for B independent sequences: the model side of continuous batching.

Each sequence b has its own cache (any tier) holding T_b tokens, and one new token at position
T_b. Everything that does not read a cache runs once for the whole batch on [B, D] rows (norms,
projections, RoPE, router, experts, lm_head); what reads a cache is ragged:

    rows_b      cache_b.append(layer, new row b)         one write per sequence and layer
    padded      [B, T, W] rows (T = max_b T_b + 1), zero past each sequence's end
    DSA         I[b, t] = sum_h w_b[h] relu(q_b[h] . k_{b,t}),  top-k per sequence (T_b + 1 > k only)
    attention   softmax over each sequence's allowed tokens (its own length, its top-k), one bmm

so the per-sequence work per layer is the cache write alone (packed caches stored alike encode
the batch's new rows in one call, then each writes its own); scores, softmax and context are
one batched pass over the padded rows. Packed tiers are padded still encoded and unpacked once
per layer through the same codec consumers `latentkv.kv.attention` uses. Float32 caches placed
in a `SlotPool` (the server's) skip even the writes: one op per layer stores every new row, and
the padded rows are a view of the pool. When the padded values would exceed BATCH_ATTEND_ELEMENTS (long
contexts), or for a reader of any other kind, each sequence is read on its own through its
`RowReader.attend`, tiled as in a single-sequence decode. A batch may mix tiers: each group of
caches stored alike is read together.

What is guaranteed: a batch of one is `Model.forward` on its token, bit for bit. In a larger
batch, a sequence's logits are the single-sequence decode's up to float32 rounding: the same formulas, but dense products over B rows and
attention over padded rows sum in an order that can depend on the batch's shape (tested within
1e-5 relative of `Model.forward`, alone and beside 15 other sequences, on every tier and with
DSA selecting). Not guaranteed: bitwise identity across batch compositions (the CPU GEMM picks
its kernel by the number of rows); DSA picks the same top-k unless two indexer scores tie
within that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from latentkv.kv.attention import consumer_for
from latentkv.kv.cache import F32Rows, LatentCache, PackedLatentCache, PackedRows, RowReader
from latentkv.kv.codecs import EncodedRows
from latentkv.kv.slots import SlotPool
from latentkv.models.layers import RotaryTables, linear
from latentkv.models.moe import ExpertStore, MoE

if TYPE_CHECKING:
    from latentkv.models.indexer import Indexer
    from latentkv.models.model import Block, Model

# Padded attention / indexer reads hold at most this many float32 values ([B, T, width]);
# beyond it every sequence is read on its own (tiled), which bounds memory at long contexts.
BATCH_ATTEND_ELEMENTS = 8 * 1024 * 1024

# MoE in decode (see `moe_decode`): all experts at once while the layer's experts are this small,
# the chosen experts gathered while the copies stay under GATHER_BATCH_MAX_BYTES.
EVERY_EXPERT_MAX_BYTES = 16 * 1024 * 1024
# ... and the B tokens' B * k picks are at least this many per expert (all experts read once cost
# less than copying out B * k of them once the picks reach about half the experts; measured on tiny).
EVERY_EXPERT_MIN_PICKS = 0.5
GATHER_BATCH_MAX_BYTES = 64 * 1024 * 1024

Cache = LatentCache | PackedLatentCache


class _OwnBuffers:
    """A step's caches each in their own buffers: B appends per layer, read through readers.
    Packed caches stored alike have their new rows encoded in one call per group."""

    def __init__(self, caches: Sequence[Cache], groups: list[list[int]]):
        self.caches, self.groups = caches, groups

    def rows(self, layer: int, rows: torch.Tensor) -> list[RowReader]:
        readers: list[RowReader | None] = [None] * len(self.caches)
        for members in self.groups:
            group = [self.caches[b] for b in members]
            if len(group) > 1 and isinstance(group[0], PackedLatentCache):
                part = rows if len(members) == len(self.caches) else rows[torch.tensor(members)]
                got = PackedLatentCache.append_each(group, layer, part)
            else:
                got = [cache.append(layer, rows[b : b + 1]) for b, cache in zip(members, group, strict=True)]
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
        return attend(query, readers, blocked, self.groups)


class _Slots:
    """A step's float32 caches all placed in one `SlotPool`: one write per layer, the padded
    rows read straight from the pool ([B, T, width], zero or masked past each end)."""

    def __init__(self, pool: SlotPool, slots: list[int], positions: torch.Tensor, T: int):
        self.pool, self.T = pool, T
        self.flat = pool.flat_index(slots, positions)
        contiguous = slots[-1] - slots[0] == len(slots) - 1  # (slots are in order: see decode_batch)
        self.index = slice(slots[0], slots[-1] + 1) if contiguous else torch.tensor(slots)

    def rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        return self._store(self.pool.rows[layer], rows)

    def keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        return self._store(self.pool.keys[layer], keys)

    def attend(self, query: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
        """query [H, B, W] over the padded rows `rows` gave -> [H, B, Lkv]."""
        return _attend_f32(query.transpose(0, 1), rows, blocked, self.pool.layout.kv_lora_rank).transpose(
            0, 1
        )

    def _store(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.pool.write(tensor, self.flat, rows)
        return self.pool.padded(tensor, self.index, self.T)


@dataclass
class _Step:
    """What every layer of one batched step shares."""

    rope: RotaryTables  # the B positions
    ends: list[int]  # tokens each sequence attends over, the new one included
    blocked: torch.Tensor | None  # [B, T] True past a sequence's end; None when all have T
    store: _OwnBuffers | _Slots  # where the new rows go and how attention reads them


def decode_batch(
    model: Model, tokens: torch.Tensor, caches: Sequence[Cache], pool: SlotPool | None = None
) -> torch.Tensor:
    """tokens [B] (int64), one cache per sequence -> logits [B, vocab]; each cache gains one row.
    With `pool`, float32 caches placed in it are written and read there (see `_Slots`)."""
    lengths = _check(model, tokens, caches)
    if len(caches) == 1:  # one sequence: the single-sequence decode itself (fewer ops, bit for bit)
        return model.forward(tokens, caches[0])
    slots = _pool_slots(model, pool, caches, max(lengths) + 1)
    if slots is not None and slots != sorted(slots):  # run in slot order: the pool is then read by a slice
        order = sorted(range(len(caches)), key=slots.__getitem__)
        logits = decode_batch(model, tokens[order], [caches[b] for b in order], pool)
        return logits[torch.tensor(order).argsort()]
    ends = [n + 1 for n in lengths]
    T = max(ends)
    positions = torch.tensor(lengths, dtype=torch.long)
    rope = model.rope.at(positions)
    blocked = None
    if min(ends) < T:
        blocked = torch.arange(T)[None, :] >= torch.tensor(ends)[:, None]  # [B, T]
    store = _OwnBuffers(caches, _tier_groups(caches)) if slots is None else _Slots(pool, slots, positions, T)
    step = _Step(rope, ends, blocked, store)
    x = model.embed.index_select(0, tokens).float()  # [B, D]
    selected = None
    for i, block in enumerate(model.blocks):
        x, selected = _block(block, x, i, step, selected)
    for cache in caches:
        cache.commit(1)
    return linear(model.norm(x), model.lm_head)


def _check(model: Model, tokens: torch.Tensor, caches: Sequence[Cache]) -> list[int]:
    """The caches' lengths, after checking the batch is well formed (one token each)."""
    if tokens.dim() != 1 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be int64 [B], got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.shape[0] != len(caches):
        raise ValueError(f"{tokens.shape[0]} tokens for {len(caches)} caches (need one each, at least one)")
    return check_batch(model, tokens, caches, [1] * len(caches))


def check_batch(
    model: Model, tokens: torch.Tensor, caches: Sequence[Cache], sizes: Sequence[int]
) -> list[int]:
    """The caches' lengths, after checking that cache b can take the next sizes[b] of `tokens`
    (int64 [sum sizes]): at least one cache, none twice, ids in the vocabulary, caches of this
    model, contexts within its maximum. Shared by batched decode and batched prefill."""
    if not caches:
        raise ValueError("0 caches: a batch needs at least one")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("the same cache appears twice in one batch")
    vocab, limit = model.cfg.vocab_size, model.cfg.max_position_embeddings
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise ValueError(f"token ids out of range for a vocabulary of {vocab}: {tokens.tolist()[:8]}")
    lengths = [c.length for c in caches]
    for c, n, size in zip(caches, lengths, sizes, strict=True):
        if c.layout != model.layout:
            raise ValueError(f"a cache of layout {c.layout} does not belong to this model ({model.layout})")
        if n + size > limit:
            raise ValueError(f"context of {n + size} tokens exceeds the model's maximum of {limit}")
    return lengths


def _pool_slots(model: Model, pool: SlotPool | None, caches: Sequence[Cache], T: int) -> list[int] | None:
    """The caches' slots when a step can run on the pool: all placed, padded reads within
    BATCH_ATTEND_ELEMENTS, and room for T rows (growing the pool may hand the caches their own
    buffers back instead, then None)."""
    if pool is None:
        return None
    slots = [pool.slot_of(c) for c in caches]
    if None in slots:
        return None
    width = max(model.layout.row_width, model.layout.index_head_dim)
    if len(caches) * T * width > BATCH_ATTEND_ELEMENTS or not pool.reserve(T):
        return None
    return slots


def _tier_groups(caches: Sequence[Cache]) -> list[list[int]]:
    """Indices of the caches stored alike (same class and codec parameters), in batch order."""
    groups: dict[tuple, list[int]] = {}
    for b, cache in enumerate(caches):
        groups.setdefault((type(cache).__name__, repr(cache.codec_params())), []).append(b)
    return list(groups.values())


def _block(
    block: Block,
    x: torch.Tensor,
    layer: int,
    step: _Step,
    selected: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Block.__call__` for one new token in each of B sequences: x [B, D] -> [B, D].
    `selected` is the DSA choice as a `blocked` mask (True: not attended), shared layers reuse it."""
    h = block.attn_norm(x)
    parts = linear(h, block.w_in, block.b_in).split(block.split, dim=-1)
    query, rows, q_resid = block.attn.project(parts[0], parts[1], step.rope, decode=True)  # [H, B, W], [B, W]
    readers = step.store.rows(layer, rows)
    if block.indexer is not None:
        keys = step.store.keys(layer, block.indexer.keys(parts[2], step.rope))  # new keys [B, D_i]
        selected = _select(block.indexer, h, q_resid, step, keys)
    blocked = step.blocked if selected is None else selected
    x = block.attn.output(step.store.attend(query, readers, blocked), residual=x, decode=True)
    h = block.mlp_norm(x)
    x = moe_decode(block.mlp, h, residual=x) if isinstance(block.mlp, MoE) else block.mlp(h, residual=x)
    return x, selected


# --- DSA ----------------------------------------------------------------------------------


def _select(
    indexer: Indexer,
    x: torch.Tensor,
    q_resid: torch.Tensor,
    step: _Step,
    keys: list[torch.Tensor] | torch.Tensor,
) -> torch.Tensor | None:
    """Each sequence's DSA choice as a `blocked` mask [B, T]: True except at its top-k (all its
    tokens while it has at most k). None when no sequence has more than k tokens. `keys`: each
    sequence's [T_b, D_i], or already padded [B, T, D_i] (a slot pool's)."""
    ends, k = step.ends, indexer.topk
    if max(ends) <= k:
        return None
    B, T = len(ends), max(ends)
    q = linear(q_resid, indexer.w.wq_b).view(B, indexer.n_heads, indexer.head_dim)
    q = step.rope.rotate(q, indexer.interleaved)  # [B, h_i, D_i]
    weights = linear(x, indexer.w.weights_proj)  # [B, h_i]
    if isinstance(keys, torch.Tensor):
        padded = keys
    elif B * T * (indexer.head_dim + indexer.n_heads) > BATCH_ATTEND_ELEMENTS:
        return _select_each(q, weights, keys, step, k)
    else:
        padded = _pad(keys)  # [B, T, D_i]
    head = torch.matmul(q, padded.transpose(1, 2)).relu_()  # [B, h_i, T]
    scores = torch.matmul(weights.unsqueeze(1), head).squeeze(1)  # [B, T]
    if step.blocked is not None:
        scores.masked_fill_(step.blocked, float("-inf"))
    if T - k < k:  # block the T - k lowest (fewer to find; a sequence's padding is among them)
        low = scores.topk(T - k, dim=-1, largest=False, sorted=False).indices
        top = torch.zeros(B, T, dtype=torch.bool).scatter_(1, low, True)
    else:
        top = torch.ones(B, T, dtype=torch.bool).scatter_(
            1, scores.topk(k, dim=-1, sorted=False).indices, False
        )
    if min(ends) > k:
        return top
    over = torch.tensor([n > k for n in ends])[:, None]  # [B, 1]
    return torch.where(over, top, step.blocked)


def _select_each(
    q: torch.Tensor, weights: torch.Tensor, keys: list[torch.Tensor], step: _Step, k: int
) -> torch.Tensor:
    """`_select` one sequence at a time (long contexts)."""
    B, T = len(keys), max(step.ends)
    blocked = torch.ones(B, T, dtype=torch.bool) if step.blocked is None else step.blocked.clone()
    for b, keys_b in enumerate(keys):
        if step.ends[b] > k:
            head = torch.relu(torch.matmul(q[b], keys_b.T))  # [h_i, T_b]
            blocked[b] = True
            blocked[b, torch.matmul(weights[b], head).topk(k).indices] = False
        else:
            blocked[b, : step.ends[b]] = False
    return blocked


# --- attention ----------------------------------------------------------------------------


def attend(
    query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None, groups: list[list[int]]
) -> torch.Tensor:
    """query [H, B, Lkv+R] (scaled), one reader per sequence, blocked bool [B, T] (True: not
    attended; None: every row of every reader) -> context [H, B, Lkv]. `groups` lists the
    sequences stored alike; each group is read together (padded)."""
    if len(groups) == 1:
        return _attend_group(query, readers, blocked)
    H, B, _ = query.shape
    out = None
    for members in groups:
        index = torch.tensor(members)
        part = _attend_group(
            query[:, index], [readers[b] for b in members], None if blocked is None else blocked[index]
        )
        if out is None:
            out = part.new_empty(H, B, part.shape[-1])
        out[:, index] = part
    return out


def _attend_group(
    query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
) -> torch.Tensor:
    """Context [H, B, Lkv] of readers of one tier; blocked [B, T'] with T' >= every reader's length."""
    B = len(readers)
    T = max(len(r) for r in readers)
    if blocked is not None:
        blocked = blocked[:, :T]
    kind = type(readers[0])
    if B * T * query.shape[-1] > BATCH_ATTEND_ELEMENTS or any(type(r) is not kind for r in readers):
        return _attend_each(query, readers, blocked)
    q = query.transpose(0, 1)  # [B, H, W]
    if kind is F32Rows:
        rows = _pad([r.rows for r in readers])  # [B, T, W]
        return _attend_f32(q, rows, blocked, readers[0].kv_lora_rank).transpose(0, 1)
    if kind is PackedRows:
        return _attend_packed(q, readers, blocked, T).transpose(0, 1)
    return _attend_each(query, readers, blocked)  # any other reader: through its own `attend`


def _attend_f32(
    q: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None, kv_lora_rank: int
) -> torch.Tensor:
    """q [B, H, W] over padded float32 rows [B, T, W] -> [B, H, Lkv]."""
    scores = torch.matmul(q, rows.transpose(1, 2))  # [B, H, T]
    if blocked is not None:
        scores.masked_fill_(blocked[:, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), rows[..., :kv_lora_rank])


def _pad(tensors: list[torch.Tensor]) -> torch.Tensor:
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

    `latentkv.kv.attention.attend`'s one-tile arithmetic over the padded rows: padding is zero
    codes with zero scales, which every consumer reads as finite values with factor 0."""
    codec_c, codec_r = readers[0].codec_c, readers[0].codec_r
    n = codec_c.width
    B, H, _ = q.shape
    s, vc, fc = None, None, None
    for codec, part, qp in ((codec_c, "c", q[..., :n]), (codec_r, "r", q[..., n:])):
        consumer = consumer_for(codec)
        encoded = [getattr(r, part) for r in readers]
        codes = _pad([e.codes for e in encoded]).view(B * T, -1)  # [B T, bytes]
        scales = _pad([e.scales for e in encoded]).view(B * T, -1)
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
    """One sequence at a time through its reader (tiled, any tier), as single-sequence decode does."""
    parts = []
    for b, reader in enumerate(readers):
        position = torch.tensor([len(reader) - 1])  # the new token's (a recent window reads it)
        if blocked is not None and bool(blocked[b, : len(reader)].any()):
            reader = reader.select((~blocked[b, : len(reader)]).nonzero().squeeze(1))
        parts.append(reader.attend(query[:, b : b + 1], None, position))  # [H, 1, Lkv]
    return torch.cat(parts, dim=1)


# --- mixture of experts -------------------------------------------------------------------


def moe_decode(moe: MoE, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`MoE.__call__` for B decode tokens x [B, D] (plus `residual`), in the fewest ops the
    expert sizes allow:

    every expert  when the B tokens' picks reach half the experts and the whole layer is small:
                  one matmul of all tokens through all experts, the unchosen ones weighted 0
                  (with the shared expert folded in as more experts, as a lone token does,
                  when the layer has those fused matrices)
    gathered      when each expert is small: each token's k experts copied out and run as one
                  batched matmul (a fixed shape per (token, expert))
    grouped       otherwise: one matmul per hit expert over its tokens (`MoE._dispatch`)
    """
    idx, weights = moe.router(x)  # [B, k]
    experts = moe.experts
    B, k = idx.shape
    E = len(experts)
    every = B * k >= EVERY_EXPERT_MIN_PICKS * E
    if every and moe._every is not None:
        return moe._every_expert(x, idx, weights, residual)
    expert_bytes = (experts.gate_up[0].numel() + experts.down[0].numel()) * experts.gate_up.element_size()
    if every and E * expert_bytes <= EVERY_EXPERT_MAX_BYTES:
        out = _every_expert(experts, x, torch.zeros(B, E).scatter_(1, idx, weights))
    elif experts.gather and B * k * expert_bytes <= GATHER_BATCH_MAX_BYTES:
        out = _gathered(experts, x, idx, weights)
    else:
        out = torch.zeros_like(x)
        moe._dispatch(x, idx, weights, out)
    if moe.shared is not None:
        out += moe.shared(x)
    return out if residual is None else residual + out


def _every_expert(experts: ExpertStore, x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """x [B, D] through all E experts, mixed by mix [B, E] (zero for the unchosen) -> [B, D]."""
    E, two_i, D = experts.gate_up.shape
    B = x.shape[0]
    h = linear(x, experts.gate_up.view(E * two_i, D)).view(B, E, two_i)
    gate, up = h.chunk(2, dim=-1)  # [B, E, I] each
    act = (F.silu(gate) * up).transpose(0, 1)  # [E, B, I]
    y = torch.matmul(act.to(experts.down.dtype), experts.down.transpose(1, 2))  # [E, B, D]
    return torch.matmul(mix.unsqueeze(1), y.transpose(0, 1).to(x.dtype)).squeeze(1)  # [B, D]


def _gathered(
    experts: ExpertStore, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each token's k experts gathered: x [B, D], idx / weights [B, k] -> [B, D]."""
    B, k = idx.shape
    flat = idx.reshape(-1)
    xw = x.to(experts.gate_up.dtype)[:, None, :, None]  # [B, 1, D, 1]
    gate_up = experts.gate_up.index_select(0, flat).view(B, k, *experts.gate_up.shape[1:])
    gate, up = torch.matmul(gate_up, xw).squeeze(-1).chunk(2, dim=-1)  # [B, k, I] each
    down = experts.down.index_select(0, flat).view(B, k, *experts.down.shape[1:])  # [B, k, D, I]
    y = torch.matmul(down, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [B, k, D]
    return torch.matmul(weights.unsqueeze(1).to(y.dtype), y).squeeze(1).to(x.dtype)  # [B, D]
