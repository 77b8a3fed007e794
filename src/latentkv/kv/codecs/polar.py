"""PolarQuant (arXiv 2502.02617 as the seed system implements it): polar2 .. polar6.

A row x [n] (n a power of two, at least 2) is rotated, y = R x, then turned into angles by a
recursive polar transform over L = log2(n) levels. With r^(0) = y:

    level l = 1 .. L:   theta^(l)_j = atan2(r^(l-1)_{2j+1}, r^(l-1)_{2j})      j < n / 2^l
                        r^(l)_j     = hypot(r^(l-1)_{2j}, r^(l-1)_{2j+1})
    r^(L)_0 = ||x||     the one radius per row (float32 scale)

Level 1 angles lie in (-pi, pi]: b bits, 2^b uniform bins over the circle. Deeper levels pair
non-negative radii, so their angles lie in [0, pi/2] and concentrate around pi/4 as the
subvectors grow: b - 1 bits (at least 1), 2^(b-1) uniform bins over
[pi/4 - w, pi/4 + w] with w = min(1.5 / sqrt(s), pi/4), s = 2^(l-1); angles outside the grid
fall into its end bins. Every angle decodes at its bin centre.

Bits are packed LSB first, level 1 first, index j ascending within a level:
n/2 * b + (n/2 - 1) * (b - 1) bits, rounded up to a byte (n = 512, b = 4: 224 bytes).

Decoding runs top-down: each angle splits its radius into (cur cos theta, cur sin theta), which
preserves the norm, down to y_hat; then x_hat = R^T y_hat. A consumer stops before R^T: the unit
vectors y_hat / radius are the rows in the rotated basis. Zero, NaN and inf rows get radius 0.

Grouped radii (`group_size` g, a power of two from 2 to n): the recursion stops at level
log2(g), so each group of g rotated coordinates keeps its own radius r^(log2 g)_j (times ||x||,
one float32 scale per group) instead of being folded into deeper angles. That is PolarQuant's
own block structure (the paper stops after 4 levels, g = 16): levels 1 .. log2(g) are coded as
above, n/2 * b + (n/2 - n/g) * (b - 1) bits, plus 4 n/g scale bytes. `group_size=None` is the
per-row format above, byte for byte (and its params() carry no group_size).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from latentkv.kv.codecs.base import HOST, Codec, EncodedRows, PerDevice
from latentkv.kv.codecs.packing import BitLayout, unpack_uniform
from latentkv.kv.codecs.rotation import DEFAULT_SEED, Rotation
from latentkv.kv.codecs.turbo import check_group_size, require_power_of_two, unit_rows


class AngleGrid:
    """`2^bits` uniform bins over [lo, hi]; an angle maps to its bin, a bin decodes at its centre."""

    def __init__(self, lo: float, hi: float, bits: int):
        self.lo, self.bins = lo, 2**bits
        self.step = (hi - lo) / self.bins
        centres = lo + (torch.arange(self.bins, dtype=torch.float64, device=HOST) + 0.5) * self.step
        self.cos_sin = PerDevice(
            torch.stack((centres.cos(), centres.sin()), dim=-1).to(torch.float32)
        )  # [bins, 2]

    def quantize(self, theta: torch.Tensor) -> torch.Tensor:
        idx = torch.floor((theta.to(torch.float64) - self.lo) / self.step)
        return idx.clamp(0, self.bins - 1).to(torch.int64)


def angle_grids(width: int, bits: int) -> list[AngleGrid]:
    """The grid of each level, level 1 first, for a recursion over `width` values (the row, or a group)."""
    grids = [AngleGrid(-math.pi, math.pi, bits)]
    deep_bits = max(bits - 1, 1)
    for level in range(2, int(math.log2(width)) + 1):
        half = min(1.5 / math.sqrt(2 ** (level - 1)), math.pi / 4)
        grids.append(AngleGrid(math.pi / 4 - half, math.pi / 4 + half, deep_bits))
    return grids


class PolarCodec(Codec):
    """polar{bits}: rotated rows as quantized recursive polar angles plus one radius per row (or
    per `group_size` rotated coordinates)."""

    def __init__(self, width: int, bits: int, seed: int = DEFAULT_SEED, group_size: int | None = None):
        self.name = f"polar{bits}"
        require_power_of_two(self.name, width)
        if width < 2:
            raise ValueError(f"{self.name} needs rows of at least 2 values, got {width}")
        if not 2 <= bits <= 8:
            raise ValueError(f"{self.name}: PolarQuant angles take 2 to 8 bits")
        self.width = width
        self.bits = bits
        self.seed = seed
        self.group_size = group_size
        self.group = check_group_size(self.name, width, group_size, smallest=2)
        self.rotation = Rotation(width, seed)
        self.grids = angle_grids(self.group, bits)
        self.counts = [width >> level for level in range(1, len(self.grids) + 1)]  # angles per level
        self.deep_bits = max(bits - 1, 1)
        self.deep_count = sum(self.counts[1:])  # n/2 - n/g
        self.layout = BitLayout([bits] * self.counts[0] + [self.deep_bits] * self.deep_count)
        self.code_bytes = self.layout.nbytes
        self.scale_count = width // self.group

    def params(self) -> dict[str, Any]:
        params = {"name": self.name, "width": self.width, "bits": self.bits, "rotation_seed": self.seed}
        if self.group_size is not None:
            params["group_size"] = self.group_size
        return params

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [N, n] -> (angle bin indices int64 [N, n - n/g], level 1 first; radii float32 [N, n/g])."""
        unit, radius = unit_rows(x)
        cur = self.rotation.rotate(unit)  # [N, n]
        parts = []
        for grid in self.grids:
            even, odd = cur[:, 0::2], cur[:, 1::2]  # [N, m] each
            parts.append(grid.quantize(torch.atan2(odd, even)))
            cur = torch.hypot(even, odd)
        if self.group_size is None:
            return torch.cat(parts, dim=1), radius[:, None]
        # cur [N, n/g]: each group's norm within the unit row; times ||x|| it is the group's radius
        radii = (cur.to(torch.float64) * radius.to(torch.float64)[:, None]).to(torch.float32)
        return torch.cat(parts, dim=1), radii

    def encode(self, x: torch.Tensor) -> EncodedRows:
        idx, radii = self.quantize(self.check_rows(x))
        return EncodedRows(self.layout.pack(idx), radii)

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed rows uint8 [N, code_bytes] -> angle bin indices int32 [N, n - n/g], level 1 first."""
        half = self.width // 2
        if half % 8 or not self.deep_count:
            return self.layout.unpack(codes)
        # Level 1 ends on a byte boundary, and the deeper levels fill the rest: both sections
        # unpack as uniform codes, the deep one with phantom values read from the padding bits.
        split = half * self.bits // 8
        first = unpack_uniform(codes[:, :split], self.bits, half)  # [N, n/2]
        per = 8 // math.gcd(8, self.deep_bits)
        padded = self.deep_count + (-self.deep_count) % per
        if (padded * self.deep_bits + 7) // 8 != codes.shape[1] - split:
            return self.layout.unpack(codes)
        deep = unpack_uniform(codes[:, split:], self.deep_bits, padded)[:, : self.deep_count]
        return torch.cat((first, deep), dim=1)

    def unit_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed rows uint8 [N, code_bytes] -> the decoded rows in the rotated basis [N, n], each
        group (the whole row without groups) a unit vector."""
        idx = self.unpack(codes)  # [N, n - n/g]
        n_rows = codes.shape[0]
        cur = torch.ones(n_rows, self.scale_count, 1, dtype=torch.float32, device=codes.device)
        stop = idx.shape[1]
        for grid, count in zip(reversed(self.grids), reversed(self.counts), strict=True):
            level = idx[:, stop - count : stop].reshape(-1)  # [N * m]
            stop -= count
            cos_sin = grid.cos_sin.on(codes.device).index_select(0, level).view(n_rows, count, 2)
            cur = (cos_sin * cur).view(n_rows, 2 * count, 1)  # child 2j = cur_j cos, 2j+1 = cur_j sin
        return cur.view(n_rows, self.width)

    def rotated_rows(self, enc: EncodedRows) -> torch.Tensor:
        """The decoded rows in the rotated basis, float32 [N, n] (each group times its radius)."""
        units = self.unit_vectors(enc.codes)  # [N, n]
        if self.group_size is None:
            return units * enc.scales
        grouped = units.view(len(enc), self.scale_count, self.group) * enc.scales[..., None]
        return grouped.view(len(enc), self.width)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        return self.rotation.unrotate(self.rotated_rows(enc))
