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
A small layer decodes a token through every expert at once (the unchosen ones weighted 0, the
shared expert folded in as more experts weighted 1): two matmuls instead of a gather per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latentkv.config import ModelConfig
from latentkv.models.layers import SwiGLU, linear, linear_add


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


# Decode gathers the k chosen experts' matrices into one batched matmul when they are this small
# (the copy is cheaper than k rounds of per-op overhead); bigger experts run one at a time.
GATHER_MAX_BYTES = 4 * 1024 * 1024


class ExpertStore:
    """All routed experts of one layer, resident in memory: stacked [E, 2I, D] and [E, D, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up = gate_up  # [E, 2I, D]  gate rows first, then up
        self.down = down  # [E, D, I]
        expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
        self.gather = expert_bytes <= GATHER_MAX_BYTES

    def __len__(self) -> int:
        return self.gate_up.shape[0]

    def __getitem__(self, e: int) -> SwiGLU:
        return SwiGLU(self.gate_up[e], self.down[e])

    def decode(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One token x [1, D] through its k experts idx [k], mixed by weights [k]: -> [1, D]."""
        if not self.gather:
            out = torch.zeros_like(x)
            for e, w in zip(idx.tolist(), weights.tolist(), strict=True):
                out += self[e](x) * w
            return out
        xw = x[0].to(self.gate_up.dtype)
        gate, up = torch.matmul(self.gate_up.index_select(0, idx), xw).chunk(2, dim=-1)  # [k, I] each
        act = (F.silu(gate) * up).unsqueeze(-1)  # [k, I, 1]
        y = torch.matmul(self.down.index_select(0, idx), act).squeeze(-1)  # [k, D]
        return torch.matmul(weights.unsqueeze(0).to(y.dtype), y).to(x.dtype)  # [1, D]


# Decode runs every expert of a layer whose experts (with the shared one) hold at most this many
# bytes: on a small model the extra arithmetic costs less than the ops it saves.
EVERY_EXPERT_DECODE_MAX_BYTES = 4 * 1024 * 1024


class MoE:
    def __init__(self, router: Router, experts: ExpertStore, shared: SwiGLU | None):
        self.router = router
        self.experts = experts
        self.shared = shared
        self._every = _every_expert_weights(experts, shared)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, D] -> [N, D] (plus `residual` [N, D] if given)."""
        idx, weights = self.router(x)
        if x.shape[0] == 1 and self._every is not None:
            return self._every_expert(x, idx, weights, residual)
        if x.shape[0] == 1:
            out = self.experts.decode(x, idx[0], weights[0])
        else:
            out = torch.zeros_like(x)
            self._dispatch(x, idx, weights, out)
        if self.shared is not None:
            out += self.shared(x)
        return out if residual is None else residual + out

    def _every_expert(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """B decode tokens x [B, D] (one per sequence) through all U = E + shared units: mix
        [B, U] is the router's weight for the chosen experts, 0 for the others, 1 for the shared
        units. idx / weights [B, k]."""
        gate_up, down_t, mix_base = self._every
        B = x.shape[0]
        mix = mix_base.expand(B, -1).scatter(1, idx, weights.to(mix_base.dtype))  # [B, U]
        gate, up = linear(x, gate_up).view(B, mix.shape[1], -1).chunk(2, dim=-1)  # [B, U, I] each
        act = F.silu(gate) * up * mix.unsqueeze(-1)  # [B, U, I]
        return linear_add(residual, act.view(B, -1), down_t)  # [B, D]

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


def _every_expert_weights(
    experts: ExpertStore, shared: SwiGLU | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(gate_up [U*2I, D], down^T [U*I, D], mix base [1, U]) for `MoE._every_expert`: the routed
    experts, then the shared expert cut into units of I (a SwiGLU is a sum over its units).
    None when the layer is too large, or the shared width is not a multiple of I."""
    E, two_i, D = experts.gate_up.shape
    I = two_i // 2
    shared_width = 0 if shared is None else shared.down.shape[1]
    if shared_width % I or (E * two_i + 3 * shared_width) * D * experts.gate_up.element_size() > (
        EVERY_EXPERT_DECODE_MAX_BYTES
    ):
        return None
    units = [experts.gate_up.reshape(E * two_i, D)]
    downs = [experts.down.transpose(0, 1).reshape(D, E * I)]  # [D, E, I] -> unit-major columns
    if shared is not None:
        n = shared_width // I
        gate, up = shared.gate_up.view(2, n, I, D).unbind(0)
        units.append(torch.stack([gate, up], dim=1).reshape(n * two_i, D))
        downs.append(shared.down)
    mix = torch.cat([torch.zeros(1, E), torch.ones(1, shared_width // I)], dim=1)
    return torch.cat(units).contiguous(), torch.cat(downs, dim=1).T.contiguous(), mix
