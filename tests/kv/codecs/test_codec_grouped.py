"""Grouped radii for the rotated codecs (tq*, polar*): one radius per group of g rotated coordinates.

Each codec is checked against a float64 reference written from the format's definition (an
explicit Hadamard matrix, argmin over the Lloyd-Max levels, atan2 / hypot recursion), on fresh
random rows: the codes agree except at float32-vs-float64 ties on a decision boundary, the
radii agree, and decoding the codec's own codes equals the reference reconstruction.
"""

from __future__ import annotations

import math

import pytest
import torch

from latentkv.kv.codecs import get_codec, lloyd
from latentkv.kv.codecs.rotation import DEFAULT_SEED, random_signs


def rotation_matrix(n: int) -> torch.Tensor:
    """R = H D in float64, H the Sylvester Hadamard matrix / sqrt(n)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)) * random_signs(n, DEFAULT_SEED)[None, :]


def rows(n_rows: int, width: int) -> torch.Tensor:
    x = torch.randn(n_rows, width) * torch.exp(torch.randn(n_rows, 1))  # varied scales
    x[:, :3] *= 20  # a few outlier channels, as trained latents have
    return x


def reference_tq(x: torch.Tensor, bits: int, group: int):
    """(level indices [N, n], group radii [N, n/g], reconstruction [N, n]) in float64."""
    n = x.shape[1]
    rot = rotation_matrix(n)
    y = (x.double() @ rot.T).view(x.shape[0], n // group, group)  # rotated, grouped
    radii = y.norm(dim=-1)  # [N, G]
    u = y / radii[..., None] * math.sqrt(group)
    lev = lloyd.levels(bits, torch.float64)
    idx = (u[..., None] - lev).abs().argmin(dim=-1)  # [N, G, g]
    return idx.view(x.shape[0], n), radii, u


def tq_reconstruct(idx: torch.Tensor, radii: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    n = idx.shape[1]
    lev = lloyd.levels(bits, torch.float64)[idx.long()].view(idx.shape[0], n // group, group)
    y = (lev * radii.double()[..., None] / math.sqrt(group)).view(idx.shape[0], n)
    return y @ rotation_matrix(n)  # R^T y, row-wise


@pytest.mark.parametrize(
    ("bits", "group", "width"), [(4, 16, 64), (4, 64, 512), (3, 32, 512), (2, 8, 64), (5, 4, 64)]
)
def test_tq_grouped_matches_the_float64_reference(bits, group, width):
    codec = get_codec(f"tq{bits}", width, group_size=group)
    x = rows(200, width)
    enc = codec.encode(x)
    ref_idx, ref_radii, u = reference_tq(x, bits, group)
    idx = codec.unpack(enc.codes)
    differ = idx.long() != ref_idx
    thresholds = lloyd.thresholds(bits, torch.float64)
    near_tie = (u.reshape(x.shape[0], width)[..., None] - thresholds).abs().min(dim=-1).values < 1e-4
    assert not (differ & ~near_tie).any()
    assert differ.float().mean() < 1e-3
    torch.testing.assert_close(enc.scales.double(), ref_radii, rtol=1e-6, atol=0)
    expected = tq_reconstruct(idx, enc.scales, bits, group)
    assert ((codec.decode(enc).double() - expected).norm() / expected.norm()).item() < 1e-6


def reference_polar(x: torch.Tensor, bits: int, group: int):
    """(angle bins [N, n - n/g] level 1 first, group radii [N, n/g]) in float64, per the docstring."""
    n = x.shape[1]
    cur = x.double() @ rotation_matrix(n).T
    parts = []
    for level in range(1, int(math.log2(group)) + 1):
        theta = torch.atan2(cur[:, 1::2], cur[:, 0::2])
        if level == 1:
            lo, hi, b = -math.pi, math.pi, bits
        else:
            half = min(1.5 / math.sqrt(2 ** (level - 1)), math.pi / 4)
            lo, hi, b = math.pi / 4 - half, math.pi / 4 + half, max(bits - 1, 1)
        step = (hi - lo) / 2**b
        parts.append(torch.floor((theta - lo) / step).clamp(0, 2**b - 1).long())
        cur = torch.hypot(cur[:, 0::2], cur[:, 1::2])
    return torch.cat(parts, dim=1), cur


def polar_reconstruct(idx: torch.Tensor, radii: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    n_rows, n = idx.shape[0], idx.shape[1] + radii.shape[1]
    counts = [n >> level for level in range(1, int(math.log2(group)) + 1)]
    cur = radii.double()  # [N, n/g]
    stop = idx.shape[1]
    for level in range(len(counts), 0, -1):
        count = counts[level - 1]
        k = idx[:, stop - count : stop].double()
        stop -= count
        if level == 1:
            lo, hi, b = -math.pi, math.pi, bits
        else:
            half = min(1.5 / math.sqrt(2 ** (level - 1)), math.pi / 4)
            lo, hi, b = math.pi / 4 - half, math.pi / 4 + half, max(bits - 1, 1)
        theta = lo + (k + 0.5) * (hi - lo) / 2**b
        cur = torch.stack((cur * theta.cos(), cur * theta.sin()), dim=-1).view(n_rows, 2 * count)
    return cur @ rotation_matrix(n)


@pytest.mark.parametrize(
    ("bits", "group", "width"), [(4, 16, 64), (4, 16, 512), (3, 8, 512), (2, 2, 64), (6, 64, 64)]
)
def test_polar_grouped_matches_the_float64_reference(bits, group, width):
    codec = get_codec(f"polar{bits}", width, group_size=group)
    x = rows(200, width)
    enc = codec.encode(x)
    ref_idx, ref_radii = reference_polar(x, bits, group)
    idx = codec.unpack(enc.codes)
    assert idx.shape == ref_idx.shape == (200, width - width // group)
    assert (idx.long() != ref_idx).float().mean() < 2e-3  # only float32 angles right on a bin edge
    # The rotation runs in float32: each rotated coordinate is off by ~1e-7 of the row's norm,
    # so a small group radius (groups of 2: one pair of coordinates) is only that close in
    # absolute terms; relative 1e-5 alone failed ~1 draw in 10 at group 2.
    norms = x.double().norm(dim=1, keepdim=True)  # [N, 1]
    assert ((enc.scales.double() - ref_radii).abs() <= 1e-5 * ref_radii + 1e-6 * norms).all()
    expected = polar_reconstruct(idx, enc.scales, bits, group)
    assert ((codec.decode(enc).double() - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("group", [None, 2, 4, 16, 64])
@pytest.mark.parametrize("width", [64, 512])
def test_polar_fast_unpack_equals_the_generic_layout(bits, group, width):
    codec = get_codec(f"polar{bits}", width, group_size=group)
    codes = torch.randint(0, 256, (5, codec.code_bytes), dtype=torch.uint8)
    assert torch.equal(codec.unpack(codes), codec.layout.unpack(codes))


@pytest.mark.parametrize(
    ("name", "group", "code_bytes", "scales"),
    [
        ("tq4", 64, 256, 8),  # 512 values: 4 bits each, 8 radii
        ("tq3", 32, 192, 16),
        ("polar4", 16, 212, 32),  # 256 * 4 + (128 + 64 + 32) * 3 bits
        ("polar4", 512, 224, 1),  # the whole row as one group: 256 * 4 + 255 * 3 bits, as per row
        ("polar3", 2, 96, 256),  # level 1 only: 256 * 3 bits
    ],
)
def test_grouped_sizes(name, group, code_bytes, scales):
    codec = get_codec(name, 512, group_size=group)
    assert (codec.code_bytes, codec.scale_count) == (code_bytes, scales)
    assert codec.bytes_per_row == code_bytes + 4 * scales


def test_polar_needs_groups_of_two():
    with pytest.raises(
        ValueError, match="polar4 group size 1 must divide the row width 64 and be at least 2"
    ):
        get_codec("polar4", 64, group_size=1)


@pytest.mark.parametrize("name", ["tq4", "polar4"])
def test_grouped_inert_rows_and_groups(name):
    codec = get_codec(name, 64, group_size=16)
    x = torch.randn(4, 64)
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    out = codec.decode(codec.encode(x))
    assert torch.isfinite(out).all() and not out[:3].any() and out[3].abs().sum() > 0
    enc = codec.encode(x)
    assert not enc.scales[:3].any() and (enc.scales[3] > 0).all()


@pytest.mark.parametrize("name", ["tq4", "tq3", "polar4"])
def test_groups_cut_the_error_of_rows_whose_rotated_energy_is_uneven(name):
    """Rows with energy concentrated in a few rotated coordinates (what a per-row radius fits worst)."""
    width = 256
    y = torch.randn(512, width) * torch.where(torch.arange(width) < 32, 8.0, 0.5)  # rotated basis
    x = (y.double() @ rotation_matrix(width)).float()  # R^T y: the rows whose rotation is y
    per_row, grouped = get_codec(name, width), get_codec(name, width, group_size=32)

    def err(codec) -> float:
        out = codec.decode(codec.encode(x))
        return float(((out - x).norm(dim=1) / x.norm(dim=1)).mean())

    assert err(grouped) < 0.8 * err(per_row)
