"""A SwiGLU MLP, down(silu(gate(x)) * up(x)), in one kernel call where its matrices allow.

    fused = fused_swiglu(gate_up, down, rows)   # None: run the three steps through the Linears
    y = fused(x, residual)                      # x [rows, D] float32 -> [rows, D] (+ residual)

Where gate_up [2I, D] (gate rows first) and down [D, I] are both int8, or both int4 of one group
size, without a bias, and latentkv's kernels run them (`weights/native`), the expert is one call
of `latentkv::expert_int8` / `expert_int4`: the two products with the activation between them in
a scratch buffer, instead of five tensor ops per expert per token. Up to the formats' decode row
limits (prefill keeps the tiles).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from latentkv.weights import int4, int8
from latentkv.weights.base import Linear

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
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()
