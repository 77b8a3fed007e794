"""The Linear seam: one weight matrix and the matmul that reads it, in some storage format.

The model never multiplies by a raw tensor; it calls a `Linear`. A format decides how the
matrix is stored (float32, bfloat16, int8 or int4 with group scales, ...) and how `x @ W^T` is
computed from that storage. Activations are float32 in and out whatever the format.

Contract of a format (a subclass registered with `@register`):
  format        its name (`--weight-dtype`), the registry key
  from_float    build from a float matrix [out, in] (and an optional bias [out]) plus the
                format's own parameters (e.g. a group size)
  __call__      x [..., in] float32 -> [..., out] float32
  add_to        residual + x @ W^T (a format may fuse the add; the default adds)
  dequantize    float32 [out, in]: the matrix as the format reads it, the reference its
                matmul is tested against
  nbytes        bytes the format keeps resident (weight and bias)
  dense         the stored matrix when it is a plain torch tensor that torch ops can read
                directly (f32, bf16): fast paths (fused decode matrices, every-expert MoE,
                gathered experts) stack such matrices; None for packed formats, which then
                take the general path through `__call__`.
  table_dtype   the dtype of the embedding table when the model's matrices are in this format
  compile_needs_native  --compile traces the format only through latentkv's own kernels

The registry is the one list of format names: the CLI's choices, the loader's checks and the
planner all ask it (`format_names`, `format_class`), never a list of their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, TypeVar

import torch

FORMATS: dict[str, type[Linear]] = {}

L = TypeVar("L", bound="type[Linear]")


def register(cls: L) -> L:
    """Class decorator: make a format available by its `format` name."""
    name = cls.format
    if name in FORMATS and FORMATS[name] is not cls:
        raise ValueError(f"weight format {name!r} is registered twice")
    FORMATS[name] = cls
    return cls


def format_class(fmt: str) -> type[Linear]:
    """The format named `fmt`; a miss lists the valid names."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown weight format {fmt!r}; valid formats: {', '.join(format_names())}"
        ) from None


def format_names() -> tuple[str, ...]:
    """Every registered format's name (`--weight-dtype`, `--expert-dtype`), sorted."""
    return tuple(sorted(FORMATS))


def dense_dtype(fmt: str) -> torch.dtype | None:
    """The dtype a format keeps its matrices in when they are plain tensors (f32, bf16); None
    for packed formats."""
    cls = format_class(fmt)
    return cls.dtype if issubclass(cls, DenseLinear) else None


def make_linear(w: torch.Tensor, fmt: str, bias: torch.Tensor | None = None, **params) -> Linear:
    """w: float [out, in] (bias: [out]) -> a Linear in format `fmt` (params: the format's own)."""
    return format_class(fmt).from_float(w, bias=bias, **params)


def dense_format(dtype: torch.dtype) -> type[DenseLinear]:
    """The format that keeps a matrix as a plain tensor of `dtype` (f32, bf16)."""
    for cls in FORMATS.values():
        if issubclass(cls, DenseLinear) and cls.dtype == dtype:
            return cls
    raise ValueError(f"no weight format keeps {dtype} matrices")


class Linear(ABC):
    """One weight matrix W [out, in] (and an optional bias [out]) in some storage format."""

    format: ClassVar[str]
    table_dtype: ClassVar[torch.dtype] = torch.float32  # the embedding table's, beside these matrices
    compile_needs_native: ClassVar[bool] = False  # --compile traces it through latentkv's kernels only
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None  # [out], added by __call__

    @classmethod
    @abstractmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **params) -> Linear:
        """Build from a float matrix w [out, in] (any float dtype) and an optional bias [out]."""

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> x @ W^T (+ bias) [..., out] float32."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The matrix as this format computes with it: float32 [out, in] (the reference)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held resident by this weight (matrix, scales and bias)."""

    @property
    def dense(self) -> torch.Tensor | None:
        """The stored [out, in] matrix when torch ops can read it directly; None otherwise."""
        return None

    def add_to(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T for x [N, in] (just the product when residual is None)."""
        out = self(x)
        return out if residual is None else residual + out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.out_features}x{self.in_features}, {self.format})"


class DenseLinear(Linear):
    """A matrix kept as one torch tensor of some float dtype: x is cast to it for the product
    and the result cast back to float32 (no casts when the dtype is float32)."""

    dtype: ClassVar[torch.dtype]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if weight.dim() != 2 or weight.dtype != self.dtype:
            raise ValueError(
                f"{self.format} weight must be {self.dtype} [out, in], got {weight.dtype} {tuple(weight.shape)}"
            )
        self.weight = weight  # [out, in]
        self.bias = bias
        self._weight_t = weight.T  # [in, out] view, for add_to's addmm
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **params) -> DenseLinear:
        if params:
            raise ValueError(f"weight format {cls.format} takes no parameters, got {sorted(params)}")
        return cls(w.to(cls.dtype), None if bias is None else bias.to(cls.dtype))

    @property
    def dense(self) -> torch.Tensor:
        return self.weight

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n if self.bias is None else n + self.bias.numel() * self.bias.element_size()
