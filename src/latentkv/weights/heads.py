"""One linear layer per attention head (MLA's W_UK and W_UV), over any weight format.

`HeadLinears` holds H `Linear`s of one format. When the format is a plain tensor (f32, bf16)
the H matrices are views of one stacked [H, N, K] tensor and the product is one batched
matmul, or (float32) one matrix-vector product per head for a few rows of big heads (see
PER_HEAD_MAX_ROWS). int8 and int4 heads that latentkv's kernels run are views of stacked packed
tensors too, and a decode product is one call over every head (`latentkv::heads_int8` /
`heads_int4`: 64 heads of GLM-5 were 64 calls and a stack); otherwise each head's own `Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latentkv.weights.base import Linear, format_class

# float32 per-head products with at most this many rows and at least this many weight bytes
# run as one matrix-vector product per head: batched matmul with a single row per batch was
# several times slower than the memory bandwidth allows on the CPU (64 heads of GLM-5: ~8 ms
# vs ~2). bfloat16 heads always take the batched matmul: with the [H, N, K] layout it ran
# 2.5-3x faster than 64 bf16 F.linear calls at one row (docs/weights.md).
PER_HEAD_MAX_ROWS = 4
PER_HEAD_MIN_BYTES = 256 * 1024


class HeadLinears:
    """H linear layers K -> N: x [H, S, K] -> [H, S, N] (float32 in and out)."""

    def __init__(self, heads: list[Linear], stacked: torch.Tensor | None = None):
        self.heads = heads
        self.stacked = stacked  # [H, N, K] in the format's dtype when the format is dense
        self.format = heads[0].format
        self._packed = None if stacked is not None else _PackedHeads.of(heads)

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str, **params) -> HeadLinears:
        """w: float [H, N, K] -> one Linear per head in format `fmt`."""
        fmt_cls = format_class(fmt)
        dtype = getattr(fmt_cls, "dtype", None)
        if dtype is not None and not params:  # dense: the heads are views of one stacked tensor
            stacked = w.to(dtype).contiguous()
            return cls([fmt_cls(stacked[h]) for h in range(stacked.shape[0])], stacked)
        return cls([fmt_cls.from_float(w[h], **params) for h in range(w.shape[0])])

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.heads)

    def dequantize(self) -> torch.Tensor:
        """float32 [H, N, K]."""
        return torch.stack([h.dequantize() for h in self.heads])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.stacked
        if w is None and self._packed is not None and x.shape[1] <= self._packed.max_rows:
            return self._packed(x)
        if w is None:
            return torch.stack([head(x[h]) for h, head in enumerate(self.heads)])
        xw = x.to(w.dtype) if x.dtype != w.dtype else x
        per_head = w.dtype == torch.float32 and x.shape[1] <= PER_HEAD_MAX_ROWS
        if per_head and w.numel() * w.element_size() >= PER_HEAD_MIN_BYTES:
            out = torch.stack([F.linear(xw[h], w[h]) for h in range(w.shape[0])])
        else:
            out = torch.matmul(xw, w.transpose(1, 2))
        return out.to(x.dtype) if out.dtype != x.dtype else out


class _PackedHeads:
    """int8 / int4 heads stacked (each head's Linear rebound to its slice) for one kernel call."""

    def __init__(self, kind, tensors: list[torch.Tensor], meta: tuple[int, ...], kernel, max_rows: int):
        self._kind, self._tensors, self._meta, self._kernel, self.max_rows = (
            kind,
            tensors,
            meta,
            kernel,
            max_rows,
        )

    @classmethod
    def of(cls, heads: list[Linear]) -> _PackedHeads | None:
        from latentkv.weights import int4, int8
        from latentkv.weights.swiglu import _stack

        kind = type(heads[0])
        kernel = getattr(heads[0], "_kernel", None)
        if kind not in (int8.Int8Linear, int4.Int4Linear) or kernel is None:
            return None
        if any(type(h) is not kind or h.bias is not None or h._kernel is None for h in heads):
            return None
        if len({(h.out_features, h.in_features, getattr(h, "group_size", 0)) for h in heads}) != 1:
            return None
        if kind is int8.Int8Linear:
            return cls(kind, _stack(heads, ("q", "scale")), (), kernel, int8.KERNEL_MAX_ROWS)
        meta = (heads[0].group_size, heads[0].out_features)
        return cls(kind, _stack(heads, ("packed", "scale_zeros")), meta, kernel, int4.KERNEL_MAX_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [H, S, K] (any float) -> [H, S, N] float32."""
        x = x.float()
        if self._meta == ():
            return torch.ops.latentkv.heads_int8(x, *self._tensors, self._kernel.isa)
        return torch.ops.latentkv.heads_int4(x, *self._tensors, *self._meta, self._kernel.isa4)
