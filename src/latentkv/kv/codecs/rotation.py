"""Seeded randomized Hadamard rotation, the front end of the rotated codecs (tq*, polar*).

    R = H D          D = diag(s_0 .. s_{n-1}), s_i = +-1
                     H = the Walsh-Hadamard matrix scaled by 1/sqrt(n): orthonormal, symmetric,
                         its own inverse (H H = I)
    rotate(x)   = H (D x)          unrotate(y) = D (H y) = R^T y

R is orthogonal, so dot products survive it: q . x = rotate(q) . rotate(x). A consumer can
therefore rotate the query once and work on rotated codes without ever unrotating a row.

The signs come from splitmix64 of (seed ^ i): s_i = -1 when bit 63 of the hash is set. The
seed (default 0x9E3779B9) is a codec parameter: it changes the bytes, so caches record it.
H is applied as the fast Walsh-Hadamard transform, log2(n) butterfly passes, which needs n to
be a power of two.
"""

from __future__ import annotations

import math

import torch

from latentkv.kv.codecs.base import HOST

DEFAULT_SEED = 0x9E3779B9
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One splitmix64 step (Steele, Lea, Flood 2014) on a 64-bit unsigned integer."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def random_signs(n: int, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """The diagonal of D: float64 [n] of +-1, from splitmix64(seed ^ i)."""
    signs = [-1.0 if splitmix64((seed ^ i) & _MASK64) >> 63 else 1.0 for i in range(n)]
    return torch.tensor(signs, dtype=torch.float64, device=HOST)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform along the last axis: H x, x [..., n]."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)  # [M, blocks, 2, h]
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).view(*lead, n)


class Rotation:
    """R = H D at one power-of-two width n, for float32 or float64 tensors [..., n]."""

    def __init__(self, width: int, seed: int = DEFAULT_SEED):
        if not is_power_of_two(width):
            raise ValueError(
                f"the Hadamard rotation needs a power-of-two row width, got {width}; "
                "use fp8 (any width) for this row"
            )
        self.width = width
        self.seed = seed
        host = random_signs(width, seed)
        self._signs = {(host.dtype, host.device): host}  # [n] per (dtype, device), each made once

    def signs(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The diagonal of D [n] in `dtype` on `device` (made on the first call, then reused)."""
        signs = self._signs.get((dtype, device))
        if signs is None:
            host = self._signs[torch.float64, HOST]
            signs = self._signs[dtype, device] = host.to(device=device, dtype=dtype)
        return signs

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """R x = H (D x), x [..., n]."""
        return fwht(x * self.signs(x.dtype, x.device))

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """R^T y = D (H y), y [..., n]."""
        return fwht(y) * self.signs(y.dtype, y.device)
