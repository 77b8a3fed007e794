"""bfloat16 weights (`--weight-dtype bf16`): half the bytes; the product runs in bfloat16 and
comes back as float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latentkv.weights.base import DenseLinear, register


@register
class Bf16Linear(DenseLinear):
    format = "bf16"
    dtype = torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)

    def add_to(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return super().add_to(residual, x)
        out = (x.to(torch.bfloat16) @ self._weight_t).to(x.dtype)
        return out if residual is None else residual + out
