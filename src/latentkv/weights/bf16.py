"""bfloat16 weights (`--weight-dtype bf16`): half the bytes; the product runs in bfloat16 and
comes back as float32.

One row of a matrix of at most NATIVE_MAX_BYTES (a small model's decode) runs latentkv's own
kernel (`latentkv/native/bf16.cpp`: the weights widened to float32 in registers, x as it is,
float32 sums, a residual added in the same call): on builtin:fixture's matrices, read from the
cache as a decode step reads them, it took 1/1.4 to 1/3.1 of torch.mv's time
(`benchmarks/results/bf16-one-row-fixture.json`; a compiled step would otherwise run inductor's
loops for `torch.mv`). Streaming the GLM-5 slice's matrices from memory the two are within
0.90-1.14x of each other (`benchmarks/results/bf16-one-row.json`), so bigger matrices keep
torch's kernel. Otherwise one row runs `torch.mv`: torch's bfloat16 matrix-vector kernel
(float32 accumulation, vectorized for the CPU's width) streams the matrix once. Where oneDNN
has native bfloat16 (AVX512-BF16 or AMX), `F.linear` with one row goes through its bfloat16
GEMM, which on the development machine ran 1.1-2x slower on GLM-5's decode shapes, bound by
compute rather than memory (docs/weights.md, "Kernels, and why"; `benchmarks/bf16_gemv.py`
measures both); elsewhere the two ran alike and `F.linear` stays (`gemv_one_row`). More rows keep `F.linear`: one read of the matrix serves every row
(`torch.mv` per row would read it once per row: slower from two rows on, measured), and a
prefill's rows take AMX tiles. A bias, or a matrix stored transposed, keeps `F.linear`
whatever the rows.

A SwiGLU expert whose two matrices both take the kernel (a small model's MLPs and experts) runs
as one call of `latentkv::expert_bf16` for up to KERNEL_MAX_ROWS rows, and a layer of such
experts resident as one call of `latentkv::moe_bf16` (`weights.swiglu`): only the router's
picks are read, where a small layer otherwise ran every expert at once (`models.moe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latentkv import native
from latentkv.weights.base import DenseLinear, register
from latentkv.weights.kernels import matmul_dtype

# Matrices up to this size run one row through latentkv's kernel (see the module docstring).
NATIVE_MAX_BYTES = 4 << 20
# Rows of x the kernels take (bf16.cpp): a SwiGLU of two such matrices runs up to this many rows
# in one call (`weights.swiglu`), as do a layer's resident experts (`PackedExperts`).
KERNEL_MAX_ROWS = 4


@register
class Bf16Linear(DenseLinear):
    format = "bf16"
    dtype = torch.bfloat16
    table_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        # torch.mv's fast kernel reads rows of W: a transposed view (the fused every-expert
        # down matrix) keeps F.linear, which reads that one's rows through `_weight_t`.
        self._gemv = bias is None and weight.is_contiguous() and gemv_one_row()
        small = weight.numel() * 2 <= NATIVE_MAX_BYTES and weight.device.type == "cpu"
        self._kernel = native.kernels() if bias is None and weight.is_contiguous() and small else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:
            if self._kernel is not None and x.dtype == torch.float32:
                return self._one_row(x, None)
            if self._gemv:
                return self._mv(x).view(*x.shape[:-1], self.out_features)
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)

    def add_to(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return super().add_to(residual, x)
        one_row = x.numel() == self.in_features
        if one_row and self._kernel is not None and x.dtype == torch.float32:
            fits = residual is not None and residual.dtype == torch.float32 and residual.is_contiguous()
            if residual is None or (fits and residual.numel() == self.out_features):
                return self._one_row(x, residual)
        if one_row and self._gemv:
            out = self._mv(x).view(*x.shape[:-1], self.out_features)
        else:
            out = (x.to(torch.bfloat16) @ self._weight_t).to(x.dtype)
        return out if residual is None else residual + out

    def _one_row(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """One float32 row x (any shape of in_features elements) through latentkv's kernel ->
        W x (+ residual, of out_features elements) in x's shape with out_features last."""
        res = None if residual is None else residual.view(1, self.out_features)
        y = self._kernel.bf16_mm(x.reshape(1, self.in_features).contiguous(), self.weight, res)
        return y.view(*x.shape[:-1], self.out_features)

    def _mv(self, x: torch.Tensor) -> torch.Tensor:
        """One row x (any shape of in_features elements) -> W x [out] in x's dtype."""
        return torch.mv(self.weight, x.reshape(-1).to(torch.bfloat16)).to(x.dtype)


def gemv_one_row() -> bool:
    """Whether one row runs `torch.mv`: where `F.linear` takes oneDNN's native bfloat16 GEMM
    (AVX512-BF16 or AMX), the kernel it beats. Elsewhere (AVX2, plain C++) torch's `F.linear`
    of one bfloat16 row ran as fast as `torch.mv` (measured under ATEN_CPU_CAPABILITY=avx2 /
    default with ONEDNN_MAX_CPU_ISA capped), so it stays."""
    return matmul_dtype() == torch.bfloat16
