"""A SwiGLU MLP, down(silu(gate(x)) * up(x)), in one kernel call where its matrices allow.

    fused = fused_swiglu(gate_up, down, rows)   # None: run the three steps through the Linears
    y = fused(x, residual)                      # x [rows, D] float32 -> [rows, D] (+ residual)

Where gate_up [2I, D] (gate rows first) and down [D, I] are both int8, both int4 of one group
size, or both bf16 small enough for latentkv's one-row kernel, without a bias, and latentkv's
kernels run them (`latentkv/native`), the expert is one call of `latentkv::expert_int8` /
`expert_int4` / `expert_bf16`: the two products with the activation between them in a scratch
buffer, instead of five tensor ops per expert per token. Up to the formats' decode row limits
(prefill keeps the tiles).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from latentkv.weights import bf16, int4, int8
from latentkv.weights.base import Linear
from latentkv.weights.int8 import _rows

Fused = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def fused_swiglu(gate_up: Linear, down: Linear, rows: int) -> Fused | None:
    """The one-call form of this SwiGLU for `rows` rows of x, or None (see the module)."""
    kind = type(gate_up)
    if kind is not type(down) or gate_up.bias is not None or down.bias is not None:
        return None
    if gate_up.out_features != 2 * down.in_features:
        return None
    kernel = getattr(gate_up, "_kernel", None)
    if kernel is None or down._kernel is None:
        return None
    if kind is int8.Int8Linear and rows <= int8.KERNEL_MAX_ROWS:
        return lambda x, residual: kernel.expert_int8(_rows(x), gate_up, down, residual)
    if kind is int4.Int4Linear and rows <= int4.KERNEL_MAX_ROWS and gate_up.group_size == down.group_size:
        return lambda x, residual: kernel.expert_int4(_rows(x), gate_up, down, residual)
    if kind is bf16.Bf16Linear and rows <= bf16.KERNEL_MAX_ROWS:
        return lambda x, residual: kernel.expert_bf16(_rows(x), gate_up, down, residual)
    return None


# The tensors of each kind's stacked experts: the attributes of its Linears that are stacked
_STACKED = {int8.Int8Linear: ("q", "scale"), int4.Int4Linear: ("packed", "scale_zeros")}
_MAX_ROWS = {
    int8.Int8Linear: int8.KERNEL_MAX_ROWS,
    int4.Int4Linear: int4.KERNEL_MAX_ROWS,
    bf16.Bf16Linear: bf16.KERNEL_MAX_ROWS,
}


class PackedExperts:
    """A layer's routed experts, all int8 (or all int4 of one group size, or all bf16 taking the
    one-row kernel) of one shape, as stacked tensors that each expert's Linears are views of: the
    whole layer's routed part in one call of `latentkv::moe_int8` / `moe_int4` / `moe_bf16` (the
    router's picks in, the weighted sum out), with no Python per expert, so a decode step can be
    traced as one graph. The sum is the MoE layer's own: each expert's output (as
    `Expert.__call__` computes it) times its router weight, added in the layer's fixed order: by
    expert id (`by_id`, a batch) or in the router's order (a lone token).
    """

    def __init__(self, kind: type[Linear], tensors: tuple[torch.Tensor, ...], meta: tuple[int, ...], kernel):
        # private: the same storage the experts' Linears are views of (counted through them)
        self._kind, self._tensors, self._meta, self._kernel = kind, tensors, meta, kernel
        self.max_rows = _MAX_ROWS[kind]

    @classmethod
    def of(
        cls,
        gate_ups: list[Linear],
        downs: list[Linear],
        stacked: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PackedExperts | None:
        """Stack the experts' matrices (rebinding each Linear to its slice: no second copy), or
        None where the experts do not all take the one-call path alike. bf16 experts are stacked
        already (`stacked`: gate_up [E, 2I, D] and down [E, D, I], which their Linears view)."""
        if not gate_ups or len(gate_ups) != len(downs):
            return None
        first = fused_swiglu(gate_ups[0], downs[0], 1)
        kind = type(gate_ups[0])
        if first is None or any(type(w) is not kind for w in (*gate_ups, *downs)):
            return None
        pairs = list(zip(gate_ups, downs, strict=True))
        shapes = {(g.out_features, g.in_features, d.out_features, d.in_features) for g, d in pairs}
        if len(shapes) != 1 or any(fused_swiglu(g, d, 1) is None for g, d in pairs):
            return None
        kernel = gate_ups[0]._kernel
        meta: tuple[int, ...] = ()
        if kind is bf16.Bf16Linear:
            if stacked is None or not _views(stacked[0], gate_ups) or not _views(stacked[1], downs):
                return None
            return cls(kind, stacked, meta, kernel)
        if kind is int4.Int4Linear:
            if len({w.group_size for w in (*gate_ups, *downs)}) != 1:
                return None
            meta = (gate_ups[0].out_features, downs[0].out_features, gate_ups[0].group_size)
        names = _STACKED[kind]
        tensors = (*_stack(gate_ups, names), *_stack(downs, names))
        return cls(kind, tensors, meta, kernel)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's matrices (gate_up and down with their scales)."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors)

    def __call__(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, by_id: bool
    ) -> torch.Tensor:
        """x [N, D] (N <= max_rows), idx / weights [N, k] -> sum_j weights[:, j] * expert_idx[:, j](x)."""
        x = _rows(x)
        w = weights if weights.dtype == torch.float32 else weights.float()
        if self._kind is int8.Int8Linear:
            return torch.ops.latentkv.moe_int8(x, idx, w, *self._tensors, by_id, self._kernel.isa)
        if self._kind is bf16.Bf16Linear:
            return torch.ops.latentkv.moe_bf16(x, idx, w, *self._tensors, by_id, self._kernel.isa)
        gu, gu_sz, dn, dn_sz = self._tensors
        gu_rows, dn_rows, group = self._meta
        return torch.ops.latentkv.moe_int4(
            x, idx, w, gu, gu_sz, gu_rows, dn, dn_sz, dn_rows, group, by_id, self._kernel.isa4
        )


def _views(stack: torch.Tensor, linears: list[Linear]) -> bool:
    """Whether each Linear's weight is its slice of `stack` [E, ...] (the same storage, in order)."""
    if stack.shape[0] != len(linears) or not stack.is_contiguous():
        return False
    step = stack[0].numel() * stack.element_size()
    base = stack.data_ptr()
    return all(
        lin.weight.data_ptr() == base + e * step and lin.weight.shape == stack.shape[1:]
        for e, lin in enumerate(linears)
    )


def _stack(linears: list[Linear], names: tuple[str, ...]) -> list[torch.Tensor]:
    """One [E, ...] tensor per attribute in `names`, each Linear's attribute rebound to its slice
    as it is copied in (its own tensor is then dropped: the peak is one expert above the layer)."""
    out = []
    for name in names:
        first = getattr(linears[0], name)
        stacked = torch.empty((len(linears), *first.shape), dtype=first.dtype, device=first.device)
        for e, lin in enumerate(linears):
            stacked[e].copy_(getattr(lin, name))
            setattr(lin, name, stacked[e])
        out.append(stacked)
    return out
