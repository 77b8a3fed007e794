"""float32 weights: the reference format (`--weight-dtype f32`, the default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latentkv.weights.base import DenseLinear, register


@register
class F32Linear(DenseLinear):
    format = "f32"
    dtype = torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        # one op (addmm on the stored transpose): a decode step is bound by per-op overhead
        if self.bias is not None:
            return super().add_to(residual, x)
        return torch.mm(x, self._weight_t) if residual is None else torch.addmm(residual, x, self._weight_t)
