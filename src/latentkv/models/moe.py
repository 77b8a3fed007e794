"""Mixture of experts: the DeepSeek-V3 sigmoid router and an expert store.

Router (per token):
    s        = sigmoid(W_r x)                               affinity per expert, float32
    choice   = s + e_score_correction_bias                  used for selection only
    groups   = top-`topk_group` groups by the sum of each group's two best `choice`
    experts  = top-k `choice` within the chosen groups
    weights  = s[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor
    y        = sum_e weights_e * Expert_e(x) + SharedExpert(x)

The expert store holds each expert's fused [gate | up] and down matrices. Tokens are grouped
by expert so each hit expert runs one matmul over all its tokens (one per token in decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latentkv.config import ModelConfig
from latentkv.models.layers import SwiGLU


@dataclass
class RouterWeights:
    weight: torch.Tensor  # [E, D] float32
    bias: torch.Tensor  # [E] float32 (e_score_correction_bias)


class Router:
    def __init__(self, cfg: ModelConfig, w: RouterWeights):
        self.w = w
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.n_experts = cfg.n_routed_experts

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert indices [N, k], weights [N, k] float32)."""
        scores = F.linear(x, self.w.weight).sigmoid()  # [N, E]; activations are float32
        choice = scores + self.w.bias
        if self.topk_group < self.n_group:
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)
            choice = choice.masked_fill(
                ~keep.repeat_interleave(self.n_experts // self.n_group, dim=1), float("-inf")
            )
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling


class ExpertStore:
    """All routed experts of one layer, resident in memory (the reference store)."""

    def __init__(self, experts: list[SwiGLU]):
        self.experts = experts

    def __len__(self) -> int:
        return len(self.experts)

    def __getitem__(self, e: int) -> SwiGLU:
        return self.experts[e]


class MoE:
    def __init__(self, router: Router, experts: ExpertStore, shared: SwiGLU | None):
        self.router = router
        self.experts = experts
        self.shared = shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]."""
        idx, weights = self.router(x)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:
            for e, w in zip(idx[0].tolist(), weights[0].tolist(), strict=True):
                out += self.experts[e](x) * w
        else:
            self._dispatch(x, idx, weights, out)
        if self.shared is not None:
            out += self.shared(x)
        return out

    def _dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
        """Group the N*k (token, expert) pairs by expert; one matmul per hit expert."""
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // idx.shape[1]
        pair_weights = weights.reshape(-1)[order].to(x.dtype)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = tokens[start : start + n]
            y = self.experts[e](x.index_select(0, tok)) * pair_weights[start : start + n, None]
            out.index_add_(0, tok, y)
            start += n
