"""Lloyd-Max scalar codebooks for the standard normal N(0, 1), 2 to 6 bits.

A rotated row, normalised to unit length and scaled by sqrt(n), has coordinates that are
close to N(0, 1); the MSE-optimal scalar quantizer for that density is Lloyd-Max: 2^b levels
l_k, decision thresholds t_k = (l_k + l_{k+1}) / 2 halfway between them, and each level the
centroid of its cell:

    l_k = E[Z | t_{k-1} < Z <= t_k] = (phi(t_{k-1}) - phi(t_k)) / (Phi(t_k) - Phi(t_{k-1}))

The levels are format constants (they define what a code means), so they are checked in
below; `lloyd_max` recomputes them by iterating the two conditions on the exact Gaussian
density, and a test checks that the constants are its fixed point.
"""

from __future__ import annotations

import math

import torch

from latentkv.kv.codecs.base import HOST

# Positive halves (the codebooks are symmetric), ascending.
_POSITIVE_LEVELS: dict[int, tuple[float, ...]] = {
    2: (0.452780035, 1.510417608),
    3: (0.245094179, 0.756005281, 1.343909279, 2.151945705),
    4: (0.128395030, 0.388048299, 0.656759119, 0.942340456, 1.256231197, 1.618046386, 2.069017227, 2.732589571),
    5: (
        0.065889660, 0.198051830, 0.331378306, 0.466699523, 0.604933624, 0.747135704, 0.894565117, 1.048783320,
        1.211804381, 1.386340340, 1.576228079, 1.787233218, 2.028728399, 2.317739404, 2.691119577, 3.260732493,
    ),
    6: (
        0.033409506, 0.100278289, 0.167296903, 0.234566985, 0.302192846, 0.370282645, 0.438949672, 0.508313781,
        0.578503031, 0.649655581, 0.721921941, 0.795467656, 0.870476587, 0.947154945, 1.025736349, 1.106488240,
        1.189720142, 1.275794486, 1.365141020, 1.458276375, 1.555831225, 1.658588900, 1.767541883, 1.883977241,
        2.009611043, 2.146810217, 2.298981210, 2.471304798, 2.672273835, 2.917406791, 3.240437055, 3.744101271,
    ),
}  # fmt: skip

BITS = tuple(sorted(_POSITIVE_LEVELS))


def levels(bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2^bits levels, ascending, on the host: code k decodes to levels(bits)[k]."""
    if bits not in _POSITIVE_LEVELS:
        raise ValueError(f"Lloyd-Max codebooks exist for {list(BITS)} bits, not {bits}")
    pos = torch.tensor(_POSITIVE_LEVELS[bits], dtype=torch.float64, device=HOST)
    return torch.cat([-pos.flip(0), pos]).to(dtype)


def thresholds(bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2^bits - 1 decision thresholds (midpoints between neighbouring levels), ascending."""
    lev = levels(bits, torch.float64)
    return ((lev[1:] + lev[:-1]) / 2).to(dtype)


def nearest_level(u: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level for every value: the count of thresholds below it, int32.

    The same answer as `torch.bucketize(u, thresholds)` (a value on a threshold goes to the lower
    level), found by a binary search vectorised over the values: log2(K) gather-and-compare
    passes for K levels, about twice as fast as bucketize on CPU.
    """
    step = (thresholds.numel() + 1) // 2  # K / 2, K a power of two
    idx = (u > thresholds[step - 1]).to(torch.int32) * step
    step //= 2
    while step:
        probe = thresholds.index_select(0, (idx + (step - 1)).view(-1)).view(u.shape)
        idx += (u > probe).to(torch.int32) * step
        step //= 2
    return idx


def _normal_pdf(t: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _lloyd_step(lev: torch.Tensor) -> torch.Tensor:
    """Levels -> centroids of the cells their midpoints define, on the exact N(0, 1) density."""
    inf = torch.tensor([math.inf], dtype=torch.float64, device=lev.device)
    edges = torch.cat([-inf, (lev[1:] + lev[:-1]) / 2, inf])  # [K + 1]
    lo, hi = edges[:-1], edges[1:]
    mass = torch.special.ndtr(hi) - torch.special.ndtr(lo)
    return (_normal_pdf(lo) - _normal_pdf(hi)) / mass


def lloyd_max(bits: int, tol: float = 1e-12, max_iter: int = 100_000) -> torch.Tensor:
    """Recompute the 2^bits-level Lloyd-Max codebook for N(0, 1), float64 ascending.

    Starts from the quantiles at the cell midpoints of probability and iterates until no level
    moves by more than `tol`. Convergence is linear and slow at many levels (6 bits: ~9000
    iterations, 1-2 s), and lands within ~1e-9 of the fixed point.
    """
    k = 2**bits
    p = (torch.arange(k, dtype=torch.float64, device=HOST) + 0.5) / k
    lev = math.sqrt(2.0) * torch.special.erfinv(2 * p - 1)
    for _ in range(max_iter):
        new = _lloyd_step(lev)
        moved = (new - lev).abs().max().item()
        lev = new
        if moved <= tol:
            return lev
    raise RuntimeError(f"Lloyd-Max at {bits} bits did not converge in {max_iter} iterations")


def gaussian_mse(lev: torch.Tensor) -> float:
    """E[(Z - Q(Z))^2] for Z ~ N(0, 1) and nearest-level quantization with levels `lev`."""
    lev = lev.to(torch.float64)
    inf = torch.tensor([math.inf], dtype=torch.float64, device=lev.device)
    edges = torch.cat([-inf, (lev[1:] + lev[:-1]) / 2, inf])
    lo, hi = edges[:-1], edges[1:]
    mass = torch.special.ndtr(hi) - torch.special.ndtr(lo)
    # Per cell: E[Z^2] - 2 l E[Z] + l^2 P, with E[Z^2 1_cell] = P + lo phi(lo) - hi phi(hi).
    lo_phi = torch.where(torch.isinf(lo), 0.0, lo * _normal_pdf(lo))
    hi_phi = torch.where(torch.isinf(hi), 0.0, hi * _normal_pdf(hi))
    second = mass + lo_phi - hi_phi
    first = _normal_pdf(lo) - _normal_pdf(hi)
    return float((second - 2 * lev * first + lev * lev * mass).sum())
