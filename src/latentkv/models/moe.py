"""Mixture of experts: the DeepSeek-V3 sigmoid router, and the experts it picks run in the
fewest ops their sizes allow.

Router (per token):
    s        = sigmoid(W_r x)                               affinity per expert, float32
    choice   = s + e_score_correction_bias                  used for selection only
    groups   = top-`topk_group` groups by the sum of each group's two best `choice`
    experts  = top-k `choice` within the chosen groups
    weights  = s[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor
    y        = sum_e weights_e * Expert_e(x) + SharedExpert(x)

The experts come from the layer's `ExpertStore` (`latentkv.experts`). How they run is chosen
from the store's form and the batch's shape (each path is tested against `grouped`); the
first three serve stacked experts the kernels do not run (float32, bigger bf16):

    fused every   one decode token, or decode tokens picking at least half the experts, on a
                  small layer: every expert at once, the unchosen ones weighted 0, the shared
                  expert folded in as more experts weighted 1 (two matmuls in all)
    every         decode tokens picking at least half the experts, layer under
                  EVERY_EXPERT_MAX_BYTES: all tokens through all stacked experts
    gathered      small experts: each token's k experts copied out of the stacked tensors and
                  run as one batched matmul (`gather_one` for a lone token)
    packed        resident experts latentkv's kernels run (int8, int4, small bf16; a lone token,
                  a batch, a short prompt): the routed part in one kernel call
                  (`weights.swiglu.PackedExperts`), the same sum as one by one / grouped
                  give, bit for bit; tried first
    one by one    a lone token through its k experts in turn (big experts)
    grouped       otherwise (prefill, streamed experts): one matmul per hit expert
                  over the tokens routed to it
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from latentkv.config import ModelConfig
from latentkv.experts import Expert, ExpertStore, Job, StackedExperts
from latentkv.weights.base import Linear, dense_format


@dataclass
class RouterWeights:
    weight: Linear  # [E, D] float32
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
        scores = self.w.weight(x).sigmoid()  # [N, E]; activations are float32
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


# A lone decode token gathers its k experts into one batched matmul when each expert is this
# small (the copy is cheaper than k rounds of per-op overhead); bigger experts run one at a time.
GATHER_MAX_BYTES = 4 * 1024 * 1024
# Decode runs every expert of a layer whose experts (with the shared one) hold at most this many
# bytes, in two fused matrices: on a small model the extra arithmetic costs less than the ops it saves.
EVERY_EXPERT_DECODE_MAX_BYTES = 4 * 1024 * 1024
# Batched decode (B tokens, one per sequence): all stacked experts at once while the layer's
# experts are this small and the B * k picks are at least EVERY_EXPERT_MIN_PICKS per expert
# (all experts read once cost less than copying out B * k of them once the picks reach about
# half the experts; measured on tiny); gathered while the copies stay under GATHER_BATCH_MAX_BYTES.
EVERY_EXPERT_MAX_BYTES = 16 * 1024 * 1024
EVERY_EXPERT_MIN_PICKS = 0.5
GATHER_BATCH_MAX_BYTES = 64 * 1024 * 1024


class Lookahead:
    """Predicts the experts the next MoE layer will ask for from a hidden state (its router run
    early, through its MLP norm) and tells that layer's store to read them ahead. Advice only:
    what is computed never depends on it."""

    def __init__(self, norm: Callable[[torch.Tensor], torch.Tensor], router: Router, store: ExpertStore):
        self.norm, self.router, self.store = norm, router, store

    def __call__(self, hidden: torch.Tensor) -> None:
        idx, _ = self.router(self.norm(hidden))
        self.store.prefetch(idx.reshape(-1).unique().tolist())


class MoE:
    """The routed experts (from `experts`, the layer's store), the shared expert, and, for a
    store that reads ahead, the `lookahead` that predicts the next MoE layer's experts: before
    this layer's experts (from the hidden state after its attention, so the reads overlap this
    layer's compute) and again from its output (the next block's input, closer to what the
    next router will see)."""

    def __init__(
        self, router: Router, experts: ExpertStore, shared: Expert | None, lookahead: Lookahead | None = None
    ):
        self.router = router
        self.experts = experts
        self.shared = shared
        self.lookahead = lookahead
        stacked = experts.stacked
        # packed experts read only the picked ones in one call: the every-expert and gathered
        # paths are for the plain-dtype layers the kernels do not run (float32)
        plain = stacked is not None and experts.packed is None
        self._every = _every_expert_weights(stacked, shared) if plain else None
        self._gather = plain and stacked.expert_bytes <= GATHER_MAX_BYTES

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        """x [N, D] (the MLP-normed hidden state) -> [N, D] (plus `residual` [N, D] if given: the
        hidden state after this layer's attention). `decode`: the N rows are one new token of each
        of N sequences (batched decode), which picks among the decode paths."""
        if self.lookahead is None:
            return self._experts(x, residual, decode)
        self.lookahead(residual if residual is not None else x)
        out = self._experts(x, residual, decode)
        if residual is not None:
            self.lookahead(out)  # again from this block's output: the next block's input
        return out

    def _experts(self, x: torch.Tensor, residual: torch.Tensor | None, decode: bool) -> torch.Tensor:
        idx, weights = self.router(x)
        N = x.shape[0]
        packed = self.experts.packed
        if packed is not None and packed.max_rows >= N:  # resident, the kernels' format: one call
            return self._finish(x, packed(x, idx, weights, by_id=decode or N > 1), None, residual)
        if decode:
            return self._decode_batch(x, idx, weights, residual)
        if N == 1 and self._every is not None:
            return self._fused_every(x, idx, weights, residual)
        if N == 1 and self._gather:
            out = _gather_one(self.experts.stacked, x, idx[0], weights[0])
            return self._finish(x, out, None, residual)
        if N == 1:
            return self._finish(x, *self._one_by_one(x, idx[0], weights[0]), residual)
        return self._finish(x, *self._grouped(x, idx, weights), residual)

    def _finish(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        shared: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """Routed out + the shared expert's output (`shared`, when computed already) + residual."""
        if self.shared is not None:
            out += self.shared(x) if shared is None else shared
        return out if residual is None else residual + out

    def _decode_batch(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """B decode tokens x [B, D]: fused every / every / gathered / grouped (module docstring)."""
        B, k = idx.shape
        stacked = self.experts.stacked
        every = B * k >= EVERY_EXPERT_MIN_PICKS * self.experts.num_experts
        if every and self._every is not None:
            return self._fused_every(x, idx, weights, residual)
        if stacked is None:
            return self._finish(x, *self._grouped(x, idx, weights), residual)
        if every and self.experts.num_experts * stacked.expert_bytes <= EVERY_EXPERT_MAX_BYTES:
            mix = torch.zeros(B, self.experts.num_experts, device=x.device).scatter_(1, idx, weights)
            out = _every_stacked(stacked, x, mix)
        elif self._gather and B * k * stacked.expert_bytes <= GATHER_BATCH_MAX_BYTES:
            out = _gathered(stacked, x, idx, weights)
        else:
            return self._finish(x, *self._grouped(x, idx, weights), residual)
        return self._finish(x, out, None, residual)

    def _fused_every(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """B decode tokens x [B, D] (one per sequence) through all U = E + shared units: mix
        [B, U] is the router's weight for the chosen experts, 0 for the others, 1 for the shared
        units. idx / weights [B, k]."""
        gate_up, down, mix_base = self._every
        B = x.shape[0]
        if weights.dtype != mix_base.dtype:
            weights = weights.to(mix_base.dtype)
        mix = (mix_base if B == 1 else mix_base.expand(B, -1)).scatter(1, idx, weights)  # [B, U]
        gate, up = gate_up(x).view(B, mix.shape[1], -1).chunk(2, dim=-1)  # [B, U, I] each
        act = F.silu(gate) * up * mix.unsqueeze(-1)  # [B, U, I]
        return down.add_to(residual, act.view(B, -1))  # [B, D]

    def _one_by_one(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token x [1, D] through its k experts idx [k], mixed by weights [k]: (out, the
        shared expert's output, computed while the store works)."""
        out = torch.zeros_like(x)
        ids = idx.tolist()
        w = dict(zip(ids, weights.tolist(), strict=True))
        results = self.experts.run(x, [Job(e, None) for e in ids])
        shared = self._meanwhile(x)
        _in_order(ids, results, lambda e, y: out.add_(y * w[e]))
        return out, shared

    def _grouped(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Group the N*k (token, expert) pairs by expert; one job (one matmul) per hit expert.
        Returns (out, shared) as `_one_by_one` does."""
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        tokens = order // idx.shape[1]
        pair_weights = weights.reshape(-1)[order].to(x.dtype)
        hit = [e for e, n in enumerate(counts) if n]
        starts = dict(zip(hit, itertools.accumulate((counts[e] for e in hit), initial=0), strict=False))
        rows = {e: tokens[starts[e] : starts[e] + counts[e]] for e in hit}

        def add(e: int, y: torch.Tensor) -> None:
            start, n = starts[e], counts[e]
            out.index_add_(0, rows[e], y * pair_weights[start : start + n, None])

        results = self.experts.run(x, [Job(e, rows[e]) for e in hit])
        shared = self._meanwhile(x)
        _in_order(hit, results, add)
        return out, shared

    def _meanwhile(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output, computed while the store reads or computes the routed
        experts (the sum is the same whenever it runs: `_finish` adds it last)."""
        return None if self.shared is None else self.shared(x)


def _in_order(
    ids: list[int],
    results: Iterator[tuple[int, torch.Tensor]],
    add: Callable[[int, torch.Tensor], object],
) -> None:
    """`add` the experts' outputs in `ids` order, each as soon as every earlier one has been
    added, whatever order the store delivers them in: the sum is the same, bit for bit (and
    in-order arrivals wait for nothing). The store's iterator is closed at the end, on an error
    too (a store from disk then releases the pass's experts)."""
    waiting: dict[int, torch.Tensor] = {}
    nxt = 0
    try:
        for e, y in results:
            waiting[e] = y
            while nxt < len(ids) and ids[nxt] in waiting:
                add(ids[nxt], waiting.pop(ids[nxt]))
                nxt += 1
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    if nxt != len(ids):
        raise RuntimeError(f"the expert store did not deliver experts {ids[nxt:]}")


def _gather_one(
    stacked: StackedExperts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """One token x [1, D] through its k experts idx [k] gathered, mixed by weights [k]: -> [1, D]."""
    xw = x[0].to(stacked.gate_up.dtype)
    gate, up = torch.matmul(stacked.gate_up.index_select(0, idx), xw).chunk(2, dim=-1)  # [k, I] each
    act = (F.silu(gate) * up).unsqueeze(-1)  # [k, I, 1]
    y = torch.matmul(stacked.down.index_select(0, idx), act).squeeze(-1)  # [k, D]
    return torch.matmul(weights.unsqueeze(0).to(y.dtype), y).to(x.dtype)  # [1, D]


def _every_stacked(stacked: StackedExperts, x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """x [B, D] through all E experts, mixed by mix [B, E] (zero for the unchosen) -> [B, D]."""
    E, two_i, D = stacked.gate_up.shape
    B = x.shape[0]
    w = stacked.gate_up.view(E * two_i, D)
    xw = x.to(w.dtype) if x.dtype != w.dtype else x
    h = F.linear(xw, w).to(x.dtype).view(B, E, two_i)
    gate, up = h.chunk(2, dim=-1)  # [B, E, I] each
    act = (F.silu(gate) * up).transpose(0, 1)  # [E, B, I]
    y = torch.matmul(act.to(stacked.down.dtype), stacked.down.transpose(1, 2))  # [E, B, D]
    return torch.matmul(mix.unsqueeze(1), y.transpose(0, 1).to(x.dtype)).squeeze(1)  # [B, D]


def _gathered(
    stacked: StackedExperts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each token's k experts gathered: x [B, D], idx / weights [B, k] -> [B, D]."""
    B, k = idx.shape
    flat = idx.reshape(-1)
    xw = x.to(stacked.gate_up.dtype)[:, None, :, None]  # [B, 1, D, 1]
    gate_up = stacked.gate_up.index_select(0, flat).view(B, k, *stacked.gate_up.shape[1:])
    gate, up = torch.matmul(gate_up, xw).squeeze(-1).chunk(2, dim=-1)  # [B, k, I] each
    down = stacked.down.index_select(0, flat).view(B, k, *stacked.down.shape[1:])  # [B, k, D, I]
    y = torch.matmul(down, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [B, k, D]
    return torch.matmul(weights.unsqueeze(1).to(y.dtype), y).squeeze(1).to(x.dtype)  # [B, D]


def _every_expert_weights(
    stacked: StackedExperts, shared: Expert | None
) -> tuple[Linear, Linear, torch.Tensor] | None:
    """(gate_up [U*2I, D], down [D, U*I], mix base [1, U]) for `MoE._fused_every`: the routed
    experts, then the shared expert cut into units of I (a SwiGLU is a sum over its units).
    None when the layer is too large, the shared width is not a multiple of I, or the shared
    expert is not in the experts' plain dtype."""
    E, two_i, D = stacked.gate_up.shape
    I = two_i // 2
    shared_width = 0 if shared is None else shared.width
    if shared_width % I or (E * two_i + 3 * shared_width) * D * stacked.gate_up.element_size() > (
        EVERY_EXPERT_DECODE_MAX_BYTES
    ):
        return None
    units = [stacked.gate_up.reshape(E * two_i, D)]
    downs = [stacked.down.transpose(0, 1).reshape(D, E * I)]  # [D, E, I] -> unit-major columns
    if shared is not None:
        if shared.gate_up.dense is None or shared.down.dense is None:
            return None
        n = shared_width // I
        gate, up = shared.gate_up.dense.view(2, n, I, D).unbind(0)
        units.append(torch.stack([gate, up], dim=1).reshape(n * two_i, D))
        downs.append(shared.down.dense)
    device = stacked.gate_up.device
    mix = torch.cat(
        [torch.zeros(1, E, device=device), torch.ones(1, shared_width // I, device=device)], dim=1
    )
    fmt = dense_format(stacked.gate_up.dtype)
    down_t = torch.cat(downs, dim=1).T.contiguous()  # [U*I, D]: add_to multiplies by this
    return fmt(torch.cat(units).contiguous()), fmt(down_t.T), mix


class PrefetchingMLP:
    """A dense MLP (the block before the first MoE layer) that, once done, starts the reads of
    the experts the next layer's router predicts from its output (the next block's input): they
    overlap that block's attention. (Predicted before this MLP instead, the first MoE layer of
    the experts benchmark was recalled at chance, 10%: a dense MLP moves the residual stream too
    far.)"""

    def __init__(self, mlp: Expert, lookahead: Lookahead):
        self.mlp = mlp
        self.lookahead: Lookahead | None = lookahead

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        out = self.mlp(x, residual, decode)
        if self.lookahead is not None and residual is not None:
            self.lookahead(out)  # from this block's output, the next block's input
        return out
