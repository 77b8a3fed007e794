"""The DSA "lightning indexer": picks, per query, the `index_topk` past tokens worth attending to.

    k_t        = RoPE(LayerNorm(W_k x_t))                      cached per full layer   # [T, D_i]
    q_s[h]     = RoPE(W_qb q_resid_s)[h]                                               # [h_i, D_i]
    I[s, t]    = sum_h w_s[h] * relu(q_s[h] . k_t / sqrt(D_i)),  w_s = W_w x_s / sqrt(h_i)
    selected_s = top-k_t I[s, t] over the causal past

It only changes anything once the context exceeds `index_topk`; below that every causal token
is selected and the scores are not computed at all (the keys are still cached). "shared"
layers reuse the selection of the previous "full" layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latentkv.attention import base as attention_base
from latentkv.attention.reference import pad_rows
from latentkv.config import DsaConfig
from latentkv.models.layers import RotaryTables
from latentkv.weights.base import Linear

# Budget for one [S_tile, h_i, T] block of head scores, in float32 elements.
INDEX_BLOCK_ELEMENTS = 8 * 1024 * 1024


@dataclass
class IndexerWeights:
    wq_b: Linear  # [h_i * D_i, q_lora], pre-multiplied by 1/sqrt(D_i)
    k_norm_weight: torch.Tensor  # [D_i]
    k_norm_bias: torch.Tensor  # [D_i]
    weights_proj: Linear  # [h_i, D] float32 (as transformers keeps it), pre-multiplied by 1/sqrt(h_i)


class Indexer:
    """One full layer's indexer; W_k is part of the block's fused input projection."""

    def __init__(self, dsa: DsaConfig, w: IndexerWeights):
        self.w = w
        self.topk = dsa.index_topk
        self.n_heads = dsa.index_n_heads
        self.head_dim = dsa.index_head_dim
        self.interleaved = dsa.rope_interleave

    def keys(self, k_in: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        """Indexer keys for new tokens: W_k x [S, D_i] -> [S, D_i] (float32)."""
        k = F.layer_norm(k_in, (self.head_dim,), self.w.k_norm_weight, self.w.k_norm_bias, 1e-6)
        return rope.rotate(k, self.interleaved)

    def select(
        self, x: torch.Tensor, q_resid: torch.Tensor, rope: RotaryTables, keys: torch.Tensor, start: int
    ) -> torch.Tensor | None:
        """Which tokens each of the S queries (positions start..) may attend to.

        Returns None when every causal token is selected (context <= index_topk); for one query
        the [k] selected indices; for several a boolean [S, T] mask.
        """
        S, T = x.shape[0], keys.shape[0]
        if self.topk >= T:
            return None
        q = self.w.wq_b(q_resid).view(S, self.n_heads, self.head_dim)
        q = rope.rotate(q, self.interleaved)  # [S, h_i, D_i]
        weights = self.w.weights_proj(x)  # [S, h_i]

        if S == 1:  # _scores for one query, in the fewest ops: [1, h_i] @ relu([h_i, D_i] @ [D_i, T])
            head_scores = F.linear(q.view(self.n_heads, self.head_dim), keys).relu_()  # [h_i, T]
            return torch.mm(weights, head_scores).topk(self.topk).indices.view(self.topk)
        mask = torch.zeros(S, T, dtype=torch.bool, device=x.device)
        tile = max(1, INDEX_BLOCK_ELEMENTS // (self.n_heads * T))
        for s0 in range(0, S, tile):
            s1 = min(S, s0 + tile)
            scores = self._scores(q[s0:s1], weights[s0:s1], keys)  # [s, T]
            future = (
                torch.arange(T, device=x.device)[None, :]
                > torch.arange(start + s0, start + s1, device=x.device)[:, None]
            )
            scores.masked_fill_(future, float("-inf"))
            mask[s0:s1].scatter_(1, scores.topk(self.topk, dim=-1).indices, True)
        return mask

    def select_batch(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        rope: RotaryTables,
        keys: list[torch.Tensor] | torch.Tensor,
        ends: list[int],
        blocked: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """`select` for one new token of each of B sequences (batched decode): each sequence's
        choice as a `blocked` mask [B, T] (True: not attended), True except at its top-k (all its
        tokens while it has at most k). None when no sequence has more than k tokens. `keys`:
        each sequence's [T_b, D_i], or already padded [B, T, D_i] (a slot pool's); `ends`: each
        sequence's token count, the new one included; `blocked`: [B, T] True past each end."""
        k = self.topk
        if max(ends) <= k:
            return None
        B, T = len(ends), max(ends)
        q = self.w.wq_b(q_resid).view(B, self.n_heads, self.head_dim)
        q = rope.rotate(q, self.interleaved)  # [B, h_i, D_i]
        weights = self.w.weights_proj(x)  # [B, h_i]
        if isinstance(keys, torch.Tensor):
            padded = keys
        elif B * T * (self.head_dim + self.n_heads) > attention_base.BATCH_ATTEND_ELEMENTS:
            return _select_each(q, weights, keys, ends, blocked, k)
        else:
            padded = pad_rows(keys)  # [B, T, D_i]
        head = torch.matmul(q, padded.transpose(1, 2)).relu_()  # [B, h_i, T]
        scores = torch.matmul(weights.unsqueeze(1), head).squeeze(1)  # [B, T]
        if blocked is not None:
            scores.masked_fill_(blocked, float("-inf"))
        if T - k < k:  # block the T - k lowest (fewer to find; a sequence's padding is among them)
            low = scores.topk(T - k, dim=-1, largest=False, sorted=False).indices
            top = torch.zeros(B, T, dtype=torch.bool, device=x.device).scatter_(1, low, True)
        else:
            top = torch.ones(B, T, dtype=torch.bool, device=x.device).scatter_(
                1, scores.topk(k, dim=-1, sorted=False).indices, False
            )
        if min(ends) > k:
            return top
        over = torch.tensor([n > k for n in ends], device=x.device)[:, None]  # [B, 1]
        return torch.where(over, top, blocked)

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """I[s, t] = sum_h w[s, h] relu(q[s, h] . k_t): [s, h_i, D_i] x [T, D_i] -> [s, T] (scales pre-folded)."""
        head_scores = torch.relu(torch.matmul(q, keys.T))  # [s, h_i, T]
        return torch.matmul(weights.unsqueeze(1), head_scores).squeeze(1)


def _select_each(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: list[torch.Tensor],
    ends: list[int],
    blocked: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """`Indexer.select_batch` one sequence at a time (long contexts)."""
    B, T = len(keys), max(ends)
    out = torch.ones(B, T, dtype=torch.bool, device=q.device) if blocked is None else blocked.clone()
    for b, keys_b in enumerate(keys):
        if ends[b] > k:
            head = torch.relu(torch.matmul(q[b], keys_b.T))  # [h_i, T_b]
            out[b] = True
            out[b, torch.matmul(weights[b], head).topk(k).indices] = False
        else:
            out[b, : ends[b]] = False
    return out
