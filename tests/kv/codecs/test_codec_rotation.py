"""The seeded Hadamard rotation: orthonormal, self-inverse, deterministic, power-of-two only."""

from __future__ import annotations

import pytest
import torch

from latentkv.kv.codecs.rotation import DEFAULT_SEED, Rotation, fwht, random_signs, splitmix64

WIDTHS = [1, 2, 8, 64, 512]


def matrix(rot: Rotation) -> torch.Tensor:
    """R as a dense float64 matrix: column j is R e_j."""
    return rot.rotate(torch.eye(rot.width, dtype=torch.float64)).T


@pytest.mark.parametrize("n", WIDTHS)
def test_orthonormal(n):
    r = matrix(Rotation(n))
    assert torch.allclose(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.allclose(r.T @ r, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", WIDTHS)
def test_self_inverse(n):
    x = torch.randn(16, n, dtype=torch.float64)
    rot = Rotation(n)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-12, rtol=0)  # H H = I
    assert torch.allclose(rot.unrotate(rot.rotate(x)), x, atol=1e-12, rtol=0)
    assert torch.allclose(rot.rotate(rot.unrotate(x)), x, atol=1e-12, rtol=0)
    assert torch.allclose(matrix(rot).T @ x.T, rot.unrotate(x).T, atol=1e-12, rtol=0)  # unrotate = R^T


def test_float32_rotation_preserves_norms_and_dots():
    rot = Rotation(512)
    x, q = torch.randn(8, 512), torch.randn(8, 512)
    assert torch.allclose(rot.rotate(x).norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose((rot.rotate(x) * rot.rotate(q)).sum(1), (x * q).sum(1), rtol=1e-4, atol=1e-4)


def test_leading_dims_are_kept():
    x = torch.randn(3, 5, 64)
    rot = Rotation(64)
    assert torch.allclose(rot.rotate(x)[1, 2], rot.rotate(x[1, 2]), atol=1e-6)


def test_signs_are_deterministic_and_seeded():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the reference implementation's first output
    s = random_signs(512)
    assert torch.equal(s, random_signs(512, DEFAULT_SEED))
    assert set(s.tolist()) == {-1.0, 1.0} and abs(s.sum().item()) < 80
    assert not torch.equal(s, random_signs(512, seed=1))
    assert torch.equal(random_signs(64), s[:64])  # sign i depends on i only


@pytest.mark.parametrize("n", [0, 3, 576, 1000])
def test_non_power_of_two_refused(n):
    with pytest.raises(ValueError, match=f"{n}.*fp8"):
        Rotation(n)
