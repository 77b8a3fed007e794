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
"""

from __future__ import annotations

import math
from typing import Any

import torch

from latentkv.kv.codecs.base import Codec, EncodedRows
from latentkv.kv.codecs.packing import BitLayout, unpack_uniform
from latentkv.kv.codecs.rotation import DEFAULT_SEED, Rotation
from latentkv.kv.codecs.turbo import require_power_of_two, unit_rows


class AngleGrid:
    """`2^bits` uniform bins over [lo, hi]; an angle maps to its bin, a bin decodes at its centre."""

    def __init__(self, lo: float, hi: float, bits: int):
        self.lo, self.bins = lo, 2**bits
        self.step = (hi - lo) / self.bins
        centres = lo + (torch.arange(self.bins, dtype=torch.float64) + 0.5) * self.step
        self.cos_sin = torch.stack((centres.cos(), centres.sin()), dim=-1).to(torch.float32)  # [bins, 2]

    def quantize(self, theta: torch.Tensor) -> torch.Tensor:
        idx = torch.floor((theta.to(torch.float64) - self.lo) / self.step)
        return idx.clamp(0, self.bins - 1).to(torch.int64)


def angle_grids(width: int, bits: int) -> list[AngleGrid]:
    """The grid of each level, level 1 first."""
    grids = [AngleGrid(-math.pi, math.pi, bits)]
    deep_bits = max(bits - 1, 1)
    for level in range(2, int(math.log2(width)) + 1):
        half = min(1.5 / math.sqrt(2 ** (level - 1)), math.pi / 4)
        grids.append(AngleGrid(math.pi / 4 - half, math.pi / 4 + half, deep_bits))
    return grids


class PolarCodec(Codec):
    """polar{bits}: rotated rows as quantized recursive polar angles plus one radius per row."""

    def __init__(self, width: int, bits: int, seed: int = DEFAULT_SEED):
        self.name = f"polar{bits}"
        require_power_of_two(self.name, width)
        if width < 2:
            raise ValueError(f"{self.name} needs rows of at least 2 values, got {width}")
        if not 2 <= bits <= 8:
            raise ValueError(f"{self.name}: PolarQuant angles take 2 to 8 bits")
        self.width = width
        self.bits = bits
        self.seed = seed
        self.rotation = Rotation(width, seed)
        self.grids = angle_grids(width, bits)
        self.counts = [width >> level for level in range(1, len(self.grids) + 1)]  # angles per level
        self.deep_bits = max(bits - 1, 1)
        self.layout = BitLayout([bits] * self.counts[0] + [self.deep_bits] * (width // 2 - 1))
        self.code_bytes = self.layout.nbytes
        self.scale_count = 1

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "bits": self.bits, "rotation_seed": self.seed}

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [N, n] -> (angle bin indices int64 [N, n - 1], level 1 first; radius float32 [N])."""
        unit, radius = unit_rows(x)
        cur = self.rotation.rotate(unit)  # [N, n]
        parts = []
        for grid in self.grids:
            even, odd = cur[:, 0::2], cur[:, 1::2]  # [N, m] each
            parts.append(grid.quantize(torch.atan2(odd, even)))
            cur = torch.hypot(even, odd)
        return torch.cat(parts, dim=1), radius

    def encode(self, x: torch.Tensor) -> EncodedRows:
        idx, radius = self.quantize(self.check_rows(x))
        return EncodedRows(self.layout.pack(idx), radius[:, None])

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed rows uint8 [N, code_bytes] -> angle bin indices int32 [N, n - 1], level 1 first."""
        half = self.width // 2
        if half % 8:
            return self.layout.unpack(codes)
        # Level 1 ends on a byte boundary, and the deeper levels fill all but < 8 bits of the rest:
        # both sections unpack as uniform codes (the last, phantom, deep value is padding).
        split = half * self.bits // 8
        first = unpack_uniform(codes[:, :split], self.bits, half)  # [N, n/2]
        deep = unpack_uniform(codes[:, split:], self.deep_bits, half)[:, :-1]  # [N, n/2 - 1]
        return torch.cat((first, deep), dim=1)

    def unit_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed rows uint8 [N, code_bytes] -> the decoded unit rows in the rotated basis [N, n]."""
        idx = self.unpack(codes)  # [N, n - 1]
        n_rows = codes.shape[0]
        cur = torch.ones(n_rows, 1, 1, dtype=torch.float32)
        stop = idx.shape[1]
        for grid, count in zip(reversed(self.grids), reversed(self.counts), strict=True):
            level = idx[:, stop - count : stop].reshape(-1)  # [N * m]
            stop -= count
            cos_sin = grid.cos_sin.index_select(0, level).view(n_rows, count, 2)
            cur = (cos_sin * cur).view(n_rows, 2 * count, 1)  # child 2j = cur_j cos, 2j+1 = cur_j sin
        return cur.view(n_rows, self.width)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        return self.rotation.unrotate(self.unit_vectors(enc.codes) * enc.scales)
