"""Prefill several sequences in one pass: the prompts of requests a server admits together.

Each sequence b continues its own cache (any tier) with S_b new tokens. The N = sum S_b tokens
run as one [N, D] batch through everything that does not read a cache (norms, projections,
RoPE at each token's own position, router, experts, lm_head); each sequence's rows are appended
to its cache and attended over it on their own, as `Model.forward` does for one sequence (the
same causal and DSA rules, tiled the same way). On a small model a short prefill is bound by
per-op overhead, so B prompts in one pass cost much less than B passes (builtin:tiny, 8 prompts
of 32 tokens: 2.3x faster; `benchmarks/prefill_batch.py`, docs/performance.md).

What is guaranteed: a batch of one is `Model.forward` itself, bit for bit. Otherwise each
sequence's logits are `Model.forward`'s up to float32 rounding (dense products over N rows sum
in an order that can depend on N; tested within 1e-5 relative), so greedy tokens agree unless
two candidates tie within that rounding, as with batched decode (`latentkv.models.batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from latentkv.kv.cache import LatentCache, PackedLatentCache
from latentkv.models.batch import check_batch
from latentkv.models.layers import RotaryTables, linear

if TYPE_CHECKING:
    from latentkv.models.model import Model

Cache = LatentCache | PackedLatentCache


def prefill_batch(model: Model, prompts: Sequence[torch.Tensor], caches: Sequence[Cache]) -> torch.Tensor:
    """prompts: one int64 tensor [S_b] per cache, continuing it -> logits [B, vocab] of each
    prompt's last token; cache b gains S_b rows. Nothing is committed if a pass fails."""
    tokens = _check(model, prompts, caches)
    if len(caches) == 1:
        return model.forward(prompts[0], caches[0])
    sizes = [p.shape[0] for p in prompts]
    starts = [c.length for c in caches]
    offsets = [sum(sizes[:b]) for b in range(len(sizes))]
    rope = model.rope.at(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, sizes, strict=True)]))
    parts = [slice(o, o + n) for o, n in zip(offsets, sizes, strict=True)]
    ropes = [RotaryTables(rope.cos[p], rope.sin[p]) for p in parts]  # each sequence's own positions
    x = model.embed.index_select(0, tokens).float()  # [N, D]
    selected: list[torch.Tensor | None] = [None] * len(caches)
    for layer, block in enumerate(model.blocks):
        h = block.attn_norm(x)
        inputs = linear(h, block.w_in, block.b_in).split(block.split, dim=-1)
        query, rows, q_resid = block.attn.project(inputs[0], inputs[1], rope)
        keys = block.indexer.keys(inputs[2], rope) if block.indexer is not None else None
        context = []
        for b, (cache, p) in enumerate(zip(caches, parts, strict=True)):
            all_rows = cache.append(layer, rows[p])
            if block.indexer is not None:
                cached_keys = cache.append_index_keys(layer, keys[p])
                q_b = None if q_resid is None else q_resid[p]
                selected[b] = block.indexer.select(h[p], q_b, ropes[b], cached_keys, cache.length)
            context.append(block.attn.context(query[:, p], all_rows, cache.length, selected[b]))
        x = block.attn.output(torch.cat(context, dim=1), residual=x)
        x = block.mlp(block.mlp_norm(x), residual=x)
    for cache, n in zip(caches, sizes, strict=True):
        cache.commit(n)
    last = torch.tensor([o + n - 1 for o, n in zip(offsets, sizes, strict=True)])
    return linear(model.norm(x.index_select(0, last)), model.lm_head)


def _check(model: Model, prompts: Sequence[torch.Tensor], caches: Sequence[Cache]) -> torch.Tensor:
    """All the prompts' tokens, concatenated, after checking the batch is well formed."""
    if len(prompts) != len(caches):
        raise ValueError(f"{len(prompts)} prompts for {len(caches)} caches (need one each, at least one)")
    for prompt in prompts:
        if prompt.dim() != 1 or prompt.dtype != torch.long or prompt.shape[0] == 0:
            raise ValueError(
                f"each prompt must be a non-empty int64 [S], got {prompt.dtype} {tuple(prompt.shape)}"
            )
    tokens = torch.cat(list(prompts)) if prompts else torch.zeros(0, dtype=torch.long)
    check_batch(model, tokens, caches, [p.shape[0] for p in prompts])
    return tokens
