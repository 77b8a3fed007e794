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

Grouped radii (`group_size` g, a divisor of n): the row is rotated as a whole, then cut into
n/g groups of g coordinates *in the rotated basis*, each with its own radius:

    y      = R (x / ||x||)                             the unit row, rotated (outliers spread out)
    radius_j = ||x|| * ||y_j||                         one float32 scale per group j
    u_j    = y_j / ||y_j|| * sqrt(g)                   coordinates ~ N(0, 1) again
    x_hat  = R^T concat_j (level[code_j] * radius_j / sqrt(g))

so code_bytes is unchanged and the row costs 4 n/g scale bytes instead of 4. Grouping in the
rotated basis keeps the consumer's shape: the query is still rotated once, and each group's
factor radius_j / sqrt(g) folds into its values. `group_size=None` is the per-row format above,
byte for byte (its params() carry no group_size, so files written before groups existed match).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from latentkv.kv.codecs import lloyd
from latentkv.kv.codecs.base import Codec, EncodedRows, PerDevice
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


def check_group_size(name: str, width: int, group_size: int | None, smallest: int = 1) -> int:
    """The group of a rotated codec (the whole row when `group_size` is None); ValueError if it
    does not divide the row width or is below `smallest`."""
    if group_size is None:
        return width
    if group_size < smallest or width % group_size:
        raise ValueError(
            f"{name} group size {group_size} must divide the row width {width}"
            + (f" and be at least {smallest}" if smallest > 1 else "")
        )
    return group_size


def group_radii(
    unit_rotated: torch.Tensor, radius: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated unit rows [N, n] and row radii [N] -> (unit groups [N, n/g, g], radii f32 [N, n/g]).

    Norms in float64; a group whose norm is 0 (or a row whose radius is 0) gets radius 0 and a
    zero unit vector, so it decodes to zeros.
    """
    n_rows, width = unit_rotated.shape
    groups = unit_rotated.to(torch.float64).view(n_rows, width // group, group)  # [N, G, g]
    norm = torch.linalg.vector_norm(groups, dim=-1)  # [N, G]
    inert = (norm == 0) | (radius[:, None] == 0)
    unit = torch.where(inert[..., None], 0.0, groups / torch.where(inert, 1.0, norm)[..., None])
    radii = torch.where(inert, 0.0, norm * radius.to(torch.float64)[:, None])
    return unit.to(torch.float32), radii.to(torch.float32)


class TurboCodec(Codec):
    """tq{bits}: rotated rows, one Lloyd-Max code of `bits` bits per value, one radius per row
    (or per `group_size` rotated coordinates)."""

    def __init__(self, width: int, bits: int, seed: int = DEFAULT_SEED, group_size: int | None = None):
        self.name = f"tq{bits}"
        require_power_of_two(self.name, width)
        self.width = width
        self.bits = bits
        self.seed = seed
        self.group_size = group_size
        self.group = check_group_size(self.name, width, group_size)
        self.rotation = Rotation(width, seed)
        self.levels = lloyd.levels(bits)  # [2^b] float32, ascending, on the host
        self._device_levels = PerDevice(self.levels)
        self._thresholds = PerDevice(lloyd.thresholds(bits))  # [2^b - 1]
        self.code_bytes = packed_bytes(width * bits)
        self.scale_count = width // self.group

    def params(self) -> dict[str, Any]:
        params = {"name": self.name, "width": self.width, "bits": self.bits, "rotation_seed": self.seed}
        if self.group_size is not None:
            params["group_size"] = self.group_size
        return params

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [N, n] -> (level indices int32 [N, n], radii float32 [N, n/g]; g = n without groups)."""
        unit, radius = unit_rows(x)
        y = self.rotation.rotate(unit)  # [N, n]
        if self.group_size is None:
            u = y * math.sqrt(self.width)  # [N, n], ~ N(0, 1)
            return lloyd.nearest_level(u, self._thresholds.on(u.device)), radius[:, None]
        groups, radii = group_radii(y, radius, self.group)  # [N, G, g], [N, G]
        u = (groups * math.sqrt(self.group)).view(x.shape[0], self.width)
        return lloyd.nearest_level(u, self._thresholds.on(u.device)), radii

    def encode(self, x: torch.Tensor) -> EncodedRows:
        idx, radii = self.quantize(self.check_rows(x))
        return EncodedRows(pack_uniform(idx, self.bits), radii)

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed rows uint8 [N, code_bytes] -> level indices int32 [N, n]."""
        return unpack_uniform(codes, self.bits, self.width)

    def rotated_values(self, codes: torch.Tensor) -> torch.Tensor:
        """level[code] float32 [N, n]: the rows in the rotated basis, before radius / sqrt(n)."""
        idx = self.unpack(codes)
        return self._device_levels.on(codes.device).index_select(0, idx.flatten()).view(idx.shape)

    def rotated_rows(self, enc: EncodedRows) -> torch.Tensor:
        """The decoded rows in the rotated basis, float32 [N, n] (grouped: each group's radius applied)."""
        values = self.rotated_values(enc.codes)  # [N, n]
        if self.group_size is None:
            return values * (enc.scales / math.sqrt(self.width))
        grouped = (
            values.view(len(enc), self.scale_count, self.group)
            * (enc.scales / math.sqrt(self.group))[..., None]
        )
        return grouped.view(len(enc), self.width)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        return self.rotation.unrotate(self.rotated_rows(enc))
