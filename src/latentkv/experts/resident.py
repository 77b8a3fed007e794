"""Every expert of a layer resident in memory: today's stacked tensors behind the store contract."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from latentkv.experts.base import Expert, LocalStore, StackedExperts
from latentkv.weights.base import format_class
from latentkv.weights.swiglu import PackedExperts


class ResidentExperts(LocalStore):
    """All E experts held in memory. In a plain dtype (f32, bf16) they are views of two stacked
    tensors, which the MoE fast paths read directly; int8/int4 experts that latentkv's kernels
    run are views of stacked packed tensors too; where the kernels run them (int8, int4, small
    bf16) the layer's routed part is one call (`packed`); otherwise one Linear pair per expert."""

    def __init__(self, experts: list[Expert], stacked: StackedExperts | None = None):
        self.experts = experts
        self.stacked = stacked
        self.num_experts = len(experts)
        stacks = None if stacked is None else (stacked.gate_up, stacked.down)
        self.packed = PackedExperts.of([e.gate_up for e in experts], [e.down for e in experts], stacks)

    @classmethod
    def from_float(cls, gate_up: torch.Tensor, down: torch.Tensor, fmt: str, **params) -> ResidentExperts:
        """gate_up [E, 2I, D] and down [E, D, I] (float) -> every expert in format `fmt`."""
        fmt_cls = format_class(fmt)
        dtype = getattr(fmt_cls, "dtype", None)
        if dtype is not None and not params:
            stacked = StackedExperts(gate_up.to(dtype).contiguous(), down.to(dtype).contiguous())
            experts = [
                Expert(fmt_cls(stacked.gate_up[e]), fmt_cls(stacked.down[e])) for e in range(gate_up.shape[0])
            ]
            return cls(experts, stacked)
        experts = [
            Expert(fmt_cls.from_float(gate_up[e], **params), fmt_cls.from_float(down[e], **params))
            for e in range(gate_up.shape[0])
        ]
        return cls(experts)

    def __len__(self) -> int:
        return self.num_experts

    def get(self, ids: Sequence[int], first: bool = True) -> Mapping[int, Expert]:
        return {e: self.experts[e] for e in ids}

    @property
    def nbytes(self) -> int:
        if self.stacked is not None:
            s = self.stacked
            return s.gate_up.numel() * s.gate_up.element_size() + s.down.numel() * s.down.element_size()
        return sum(e.nbytes for e in self.experts)
