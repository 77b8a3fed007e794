"""Rotated Lloyd-Max codes ("TurboQuant" style): tq2 .. tq6; tq4 is the recommended 4-bit tier.

Encoding a row x [n] (n a power of two), with R the seeded Hadamard rotation:

    radius = ||x||_2                                   stored as the row's float32 scale
    u      = R (x / radius) * sqrt(n)                  coordinates ~ N(0, 1)
    code_i = argmin_k |u_i - level_k|                  Lloyd-Max levels for N(0, 1), b bits

    x_hat  = R^T (level[code] * radius / sqrt(n))

Codes are packed densely, b bits per value LSB first (value 2k in the low nibble at 4 bits;
3, 5 and 6 bits are not padded to a byte): code_bytes = n * b / 8. Zero, NaN and inf rows
(any row whose norm is 0 or not finite) get radius 0 and zero codes, so they decode to zeros.

Because R is orthogonal, q . x_hat = R q . (level[code] * radius / sqrt(n)): a consumer rotates
the query once and never unrotates a cached row.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from latentkv.kv.codecs import lloyd
from latentkv.kv.codecs.base import Codec, EncodedRows
from latentkv.kv.codecs.packing import pack_uniform, packed_bytes, unpack_uniform
from latentkv.kv.codecs.rotation import DEFAULT_SEED, Rotation, is_power_of_two


def require_power_of_two(name: str, width: int) -> None:
    """Refuse a rotated codec at a width the Hadamard rotation cannot handle."""
    if not is_power_of_two(width):
        raise ValueError(
            f"{name} needs power-of-two row widths (it rotates rows with a Hadamard transform), "
            f"but this row is {width} wide; use fp8, which works at any width"
        )


def unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, n] -> (x / ||x||, ||x||) as float32; rows whose norm is 0 or not finite -> (0, 0).

    The norm is taken in float64 so that neither tiny nor huge rows under- or overflow.
    """
    x64 = x.to(torch.float64)
    norm = torch.linalg.vector_norm(x64, dim=-1)  # [N]
    radius = norm.to(torch.float32)
    inert = ~torch.isfinite(radius) | (radius == 0)
    unit = torch.where(inert[:, None], 0.0, x64 / norm[:, None]).to(torch.float32)  # [N, n]
    return unit, torch.where(inert, 0.0, radius)


class TurboCodec(Codec):
    """tq{bits}: rotated rows, one Lloyd-Max code of `bits` bits per value, one radius per row."""

    def __init__(self, width: int, bits: int, seed: int = DEFAULT_SEED):
        self.name = f"tq{bits}"
        require_power_of_two(self.name, width)
        self.width = width
        self.bits = bits
        self.seed = seed
        self.rotation = Rotation(width, seed)
        self.levels = lloyd.levels(bits)  # [2^b] float32, ascending
        self._thresholds = lloyd.thresholds(bits)  # [2^b - 1]
        self.code_bytes = packed_bytes(width * bits)
        self.scale_count = 1

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "bits": self.bits, "rotation_seed": self.seed}

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [N, n] -> (level indices int32 [N, n], radius float32 [N])."""
        unit, radius = unit_rows(x)
        u = self.rotation.rotate(unit) * math.sqrt(self.width)  # [N, n], ~ N(0, 1)
        return lloyd.nearest_level(u, self._thresholds), radius

    def encode(self, x: torch.Tensor) -> EncodedRows:
        idx, radius = self.quantize(self.check_rows(x))
        return EncodedRows(pack_uniform(idx, self.bits), radius[:, None])

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed rows uint8 [N, code_bytes] -> level indices int32 [N, n]."""
        return unpack_uniform(codes, self.bits, self.width)

    def rotated_values(self, codes: torch.Tensor) -> torch.Tensor:
        """level[code] float32 [N, n]: the rows in the rotated basis, before radius / sqrt(n)."""
        idx = self.unpack(codes)
        return self.levels.index_select(0, idx.flatten()).view(idx.shape)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        y = self.rotated_values(enc.codes) * (enc.scales / math.sqrt(self.width))  # [N, n]
        return self.rotation.unrotate(y)
