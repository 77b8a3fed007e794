"""The checked-in Lloyd-Max codebooks are the fixed point of Lloyd's iteration on N(0, 1)."""

from __future__ import annotations

import pytest
import torch

from latentkv.kv.codecs import lloyd


@pytest.mark.parametrize("bits", lloyd.BITS)
def test_constants_are_the_recomputed_codebook(bits):
    recomputed = lloyd.lloyd_max(bits)
    assert torch.allclose(lloyd.levels(bits, torch.float64), recomputed, atol=2e-9, rtol=0)


def test_four_bit_codebook_as_published():
    published = [0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733]
    assert [round(v, 3) for v in lloyd.levels(4)[8:].tolist()] == published


@pytest.mark.parametrize("bits", lloyd.BITS)
def test_shape_symmetry_and_thresholds(bits):
    lev = lloyd.levels(bits, torch.float64)
    assert lev.numel() == 2**bits and torch.all(lev[1:] > lev[:-1])
    assert torch.equal(lev, -lev.flip(0))
    t = lloyd.thresholds(bits, torch.float64)
    assert torch.allclose(t, (lev[1:] + lev[:-1]) / 2)


def test_distortion_matches_theory():
    # Known Lloyd-Max MSEs for a unit Gaussian (Max 1960): 0.1175, 0.03455, 0.009501.
    assert lloyd.gaussian_mse(lloyd.levels(2)) == pytest.approx(0.1175, abs=1e-4)
    assert lloyd.gaussian_mse(lloyd.levels(3)) == pytest.approx(0.03455, abs=1e-5)
    assert lloyd.gaussian_mse(lloyd.levels(4)) == pytest.approx(0.009501, abs=1e-6)
    mse = [lloyd.gaussian_mse(lloyd.levels(b)) for b in lloyd.BITS]
    assert all(a > 3 * b for a, b in zip(mse, mse[1:], strict=False))  # ~4x per extra bit


def test_unknown_bit_width():
    with pytest.raises(ValueError, match="2, 3, 4, 5, 6"):
        lloyd.levels(7)


@pytest.mark.parametrize("bits", lloyd.BITS)
def test_nearest_level_is_bucketize(bits):
    t = lloyd.thresholds(bits)
    u = torch.cat([torch.randn(5000) * 2, t, torch.nextafter(t, t + 1), torch.nextafter(t, t - 1)])
    u = torch.cat([u, torch.tensor([-1e30, 1e30, 0.0, -0.0])])
    assert torch.equal(lloyd.nearest_level(u, t).long(), torch.bucketize(u, t))
    grid = torch.randn(30, 7)
    assert torch.equal(lloyd.nearest_level(grid, t).long(), torch.bucketize(grid, t))
