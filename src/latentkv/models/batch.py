"""One decode step for B independent sequences: the model side of continuous batching.

Each sequence b has its own cache (any tier) holding T_b tokens, and one new token at position
T_b. Everything that does not read a cache runs once for the whole batch on [B, D] rows (norms,
projections, RoPE, router, experts, lm_head); what reads a cache is ragged:

    rows_b      cache_b.append(layer, new row b)         one write per sequence and layer
    padded      [B, T, W] rows (T = max_b T_b + 1), zero past each sequence's end
    DSA         I[b, t] = sum_h w_b[h] relu(q_b[h] . k_{b,t}),  top-k per sequence (T_b + 1 > k only)
    attention   softmax over each sequence's allowed tokens (its own length, its top-k), one bmm

so the per-sequence work per layer is the cache write alone; scores, softmax and context are one
batched pass over the padded rows. Packed tiers are padded still encoded and unpacked once per
layer through the same codec consumers `latentkv.kv.attention` uses. When the padded values would
exceed BATCH_ATTEND_ELEMENTS (long contexts), each sequence is read on its own through its
cache's `RowReader.attend`, tiled as in a single-sequence decode.

What is guaranteed: a sequence's logits are the single-sequence decode's (`Model.forward` on
one token) up to float32 rounding: the same formulas, but dense products over B rows and
attention over padded rows sum in an order that can depend on the batch's shape (tested within
1e-5 relative of `Model.forward`, alone and beside 15 other sequences, on every tier and with
DSA selecting). Not guaranteed: bitwise identity across batch compositions (the CPU GEMM picks
its kernel by the number of rows); DSA picks the same top-k unless two indexer scores tie
within that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from latentkv.kv.attention import consumer_for
from latentkv.kv.cache import F32Rows, LatentCache, PackedLatentCache, PackedRows, RowReader
from latentkv.kv.codecs import EncodedRows
from latentkv.models.layers import RotaryTables, linear
from latentkv.models.moe import MoE

if TYPE_CHECKING:
    from latentkv.models.indexer import Indexer
    from latentkv.models.model import Block, Model

# Padded attention / indexer reads hold at most this many float32 values ([B, T, width]);
# beyond it every sequence is read on its own (tiled), which bounds memory at long contexts.
BATCH_ATTEND_ELEMENTS = 8 * 1024 * 1024

# Decode runs the k chosen experts of all B tokens as one gathered batched matmul while the
# gathered copies stay under this many bytes; otherwise tokens are grouped by expert.
GATHER_BATCH_MAX_BYTES = 64 * 1024 * 1024

Cache = LatentCache | PackedLatentCache


def decode_batch(model: Model, tokens: torch.Tensor, caches: Sequence[Cache]) -> torch.Tensor:
    """tokens [B] (int64), one cache per sequence -> logits [B, vocab]; each cache gains one row."""
    lengths = _check(model, tokens, caches)
    ends = [n + 1 for n in lengths]  # tokens each sequence attends over, the new one included
    table = model.rope.tables(0, max(ends))
    positions = torch.tensor(lengths, dtype=torch.long)
    rope = RotaryTables(table.cos.index_select(0, positions), table.sin.index_select(0, positions))
    valid = torch.arange(max(ends))[None, :] < torch.tensor(ends)[:, None]  # [B, T]
    x = model.embed.index_select(0, tokens).float()  # [B, D]
    selected = None
    for i, block in enumerate(model.blocks):
        x, selected = _block(block, x, caches, i, rope, valid, selected)
    for cache in caches:
        cache.commit(1)
    return linear(model.norm(x), model.lm_head)


def _check(model: Model, tokens: torch.Tensor, caches: Sequence[Cache]) -> list[int]:
    """The caches' lengths, after checking the batch is well formed."""
    if tokens.dim() != 1 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be int64 [B], got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.shape[0] != len(caches) or not caches:
        raise ValueError(f"{tokens.shape[0]} tokens for {len(caches)} caches (need one each, at least one)")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("the same cache appears twice in one batch")
    vocab = model.cfg.vocab_size
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise ValueError(f"token ids out of range for a vocabulary of {vocab}: {tokens.tolist()[:8]}")
    lengths = [c.length for c in caches]
    for c, n in zip(caches, lengths, strict=True):
        if c.layout != model.layout:
            raise ValueError(f"a cache of layout {c.layout} does not belong to this model ({model.layout})")
        if n + 1 > model.cfg.max_position_embeddings:
            raise ValueError(
                f"context of {n + 1} tokens exceeds the model's maximum of {model.cfg.max_position_embeddings}"
            )
    return lengths


def _block(
    block: Block,
    x: torch.Tensor,
    caches: Sequence[Cache],
    layer: int,
    rope: RotaryTables,
    valid: torch.Tensor,
    selected: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Block.__call__` for one new token in each of B sequences: x [B, D] -> [B, D]."""
    h = block.attn_norm(x)
    parts = linear(h, block.w_in, block.b_in).split(block.split, dim=-1)
    query, rows, q_resid = block.attn.project(parts[0], parts[1], rope)  # [H, B, W], [B, W]
    readers = [cache.append(layer, rows[b : b + 1]) for b, cache in enumerate(caches)]
    if block.indexer is not None:
        new_keys = block.indexer.keys(parts[2], rope)  # [B, D_i]
        keys = [cache.append_index_keys(layer, new_keys[b : b + 1]) for b, cache in enumerate(caches)]
        selected = _select(block.indexer, h, q_resid, rope, keys, valid)
    allowed = valid if selected is None else selected
    x = x + block.attn.output(attend(query, readers, allowed))
    h = block.mlp_norm(x)
    x = x + (moe_decode(block.mlp, h) if isinstance(block.mlp, MoE) else block.mlp(h))
    return x, selected


# --- DSA ----------------------------------------------------------------------------------


def _select(
    indexer: Indexer,
    x: torch.Tensor,
    q_resid: torch.Tensor,
    rope: RotaryTables,
    keys: list[torch.Tensor],
    valid: torch.Tensor,
) -> torch.Tensor | None:
    """Each sequence's DSA choice as a bool mask [B, T] (its top-k, or all its tokens while it has
    at most k); None when no sequence has more than k tokens."""
    lengths = [k.shape[0] for k in keys]
    if max(lengths) <= indexer.topk:
        return None
    B, T = valid.shape
    q = linear(q_resid, indexer.w.wq_b).view(B, indexer.n_heads, indexer.head_dim)
    q = rope.rotate(q, indexer.interleaved)  # [B, h_i, D_i]
    weights = linear(x, indexer.w.weights_proj)  # [B, h_i]
    mask = valid.clone()
    if B * T * (indexer.head_dim + indexer.n_heads) <= BATCH_ATTEND_ELEMENTS:
        head = torch.relu(
            torch.matmul(q, pad_sequence(keys, batch_first=True).transpose(1, 2))
        )  # [B, h_i, T]
        scores = torch.matmul(weights.unsqueeze(1), head).squeeze(1).masked_fill_(~valid, float("-inf"))
        top = torch.zeros_like(mask).scatter_(1, scores.topk(indexer.topk, dim=-1).indices, True)
        over = torch.tensor(lengths)[:, None] > indexer.topk  # [B, 1]
        return torch.where(over, top, mask)
    for b, k in enumerate(keys):
        if lengths[b] > indexer.topk:
            head = torch.relu(torch.matmul(q[b], k.T))  # [h_i, T_b]
            chosen = torch.matmul(weights[b], head).topk(indexer.topk).indices
            mask[b].zero_()
            mask[b, chosen] = True
    return mask


# --- attention ----------------------------------------------------------------------------


def attend(query: torch.Tensor, readers: list[RowReader], allowed: torch.Tensor) -> torch.Tensor:
    """query [H, B, Lkv+R] (scaled), one reader per sequence, allowed bool [B, T] -> context
    [H, B, Lkv]. Readers of one tier are read together (padded); mixed tiers go tier by tier."""
    groups: dict[tuple, list[int]] = {}
    for b, reader in enumerate(readers):
        groups.setdefault(_tier_key(reader), []).append(b)
    if len(groups) == 1:
        return _attend_group(query, readers, allowed)
    H, B, _ = query.shape
    out = None
    for members in groups.values():
        index = torch.tensor(members)
        part = _attend_group(query[:, index], [readers[b] for b in members], allowed[index])
        if out is None:
            out = part.new_empty(H, B, part.shape[-1])
        out[:, index] = part
    return out


def _tier_key(reader: RowReader) -> tuple:
    if isinstance(reader, PackedRows):
        return ("packed", repr(reader.codec_c.params()), repr(reader.codec_r.params()))
    return (type(reader).__name__,)


def _attend_group(query: torch.Tensor, readers: list[RowReader], allowed: torch.Tensor) -> torch.Tensor:
    """Context [H, B, Lkv] of readers of one tier; allowed [B, T] (T >= every reader's length)."""
    B = len(readers)
    T = max(len(r) for r in readers)
    allowed = allowed[:, :T]
    if B * T * query.shape[-1] > BATCH_ATTEND_ELEMENTS:
        return _attend_each(query, readers, allowed)
    q = query.transpose(0, 1)  # [B, H, W]
    if isinstance(readers[0], F32Rows):
        rows = pad_sequence([r.rows for r in readers], batch_first=True)  # [B, T, W]
        scores = torch.matmul(q, rows.transpose(1, 2)).masked_fill_(~allowed[:, None, :], float("-inf"))
        ctx = torch.matmul(torch.softmax(scores, dim=-1), rows[..., : readers[0].kv_lora_rank])
        return ctx.transpose(0, 1)
    if isinstance(readers[0], PackedRows):
        return _attend_packed(q, readers, allowed, T).transpose(0, 1)
    return _attend_each(query, readers, allowed)


def _attend_packed(q: torch.Tensor, readers: list[PackedRows], allowed: torch.Tensor, T: int) -> torch.Tensor:
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
        codes = pad_sequence([e.codes for e in encoded], batch_first=True)  # [B, T, bytes]
        scales = pad_sequence([e.scales for e in encoded], batch_first=True)
        values, factor = consumer.read(codec, EncodedRows(codes.view(B * T, -1), scales.view(B * T, -1)))
        values = values.view(B, T, codec.width)
        if consumer.rotated:
            qp = codec.rotation.rotate(qp.reshape(B * H, -1)).view(B, H, -1)
        block = torch.matmul(qp.to(torch.float32), values.transpose(1, 2))  # [B, H, T]
        if factor is not None:
            factor = factor.view(B, 1, T)
            block.mul_(factor)
        s = block if s is None else s.add_(block)
        if part == "c":
            vc, fc = values, factor
    p = torch.softmax(s.masked_fill_(~allowed[:, None, :], float("-inf")), dim=-1)
    if fc is not None:
        p = p * fc
    out = torch.matmul(p, vc)  # [B, H, n_c] in the working basis
    if consumer_for(codec_c).rotated:
        out = codec_c.rotation.unrotate(out.reshape(B * H, n)).view(B, H, n)
    return out


def _attend_each(query: torch.Tensor, readers: list[RowReader], allowed: torch.Tensor) -> torch.Tensor:
    """One sequence at a time through its reader (tiled, any tier), as single-sequence decode does."""
    parts = []
    for b, reader in enumerate(readers):
        mask = allowed[b, : len(reader)]
        if not bool(mask.all()):
            reader = reader.select(mask.nonzero().squeeze(1))
        parts.append(reader.attend(query[:, b : b + 1], None))  # [H, 1, Lkv]
    return torch.cat(parts, dim=1)


# --- mixture of experts -------------------------------------------------------------------


def moe_decode(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """`MoE.__call__` for B decode tokens x [B, D]: when the experts are small, each token's k
    experts are gathered and run as one batched matmul over all B tokens (a fixed shape per
    (token, expert), so each token's result does not depend on the others); else grouped by expert."""
    idx, weights = moe.router(x)  # [B, k]
    experts = moe.experts
    B, k = idx.shape
    gathered = B * k * (experts.gate_up[0].numel() + experts.down[0].numel()) * experts.gate_up.element_size()
    if experts.gather and gathered <= GATHER_BATCH_MAX_BYTES:
        flat = idx.reshape(-1)
        xw = x.to(experts.gate_up.dtype)[:, None, :, None]  # [B, 1, D, 1]
        gate_up = experts.gate_up.index_select(0, flat).view(B, k, *experts.gate_up.shape[1:])
        gate, up = torch.matmul(gate_up, xw).squeeze(-1).chunk(2, dim=-1)  # [B, k, I] each
        down = experts.down.index_select(0, flat).view(B, k, *experts.down.shape[1:])  # [B, k, D, I]
        y = torch.matmul(down, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [B, k, D]
        out = torch.matmul(weights.unsqueeze(1).to(y.dtype), y).squeeze(1).to(x.dtype)  # [B, D]
    else:
        out = torch.zeros_like(x)
        moe._dispatch(x, idx, weights, out)
    if moe.shared is not None:
        out += moe.shared(x)
    return out
