"""Matrices fused by rows whose parts are stored in different formats.

The loader fuses the projections that read the same input into one matrix (q_a | kv_a |
indexer.wk, gate | up). When the parts come pre-quantized in different formats or group sizes
(a GGUF mixes Q4_K and Q6_K matrices), their states cannot be concatenated: `RowStack` keeps
each part in its own format and concatenates the outputs instead. Not a `--weight-dtype`: it
is never registered.
"""

from __future__ import annotations

import torch

from latentkv.weights.base import Linear


class RowStack(Linear):
    format = "rows"

    def __init__(self, parts: list[Linear]):
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("RowStack needs parts that read the same input width")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        if any(p.bias is not None for p in parts):
            self.bias = torch.cat(
                [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
            )

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **params) -> RowStack:
        raise ValueError("RowStack is built from Linears in their own formats, not from a float matrix")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)
