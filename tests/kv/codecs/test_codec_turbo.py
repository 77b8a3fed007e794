"""tq codes: nearest Lloyd-Max level of the rotated, normalised row; the rotated-basis identity."""

from __future__ import annotations

import math

import pytest
import torch

from latentkv.kv.codecs import TurboCodec, get_codec


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_codes_are_the_nearest_levels(bits):
    codec = get_codec(f"tq{bits}", 64)
    x = torch.randn(32, 64)
    enc = codec.encode(x)
    u = codec.rotation.rotate(x / x.norm(dim=1, keepdim=True)) * math.sqrt(64)
    nearest = (u[..., None] - codec.levels).abs().argmin(dim=-1)
    idx = codec.unpack(enc.codes)
    # Ties are measure-zero; compare the distances so float noise at a midpoint cannot flake.
    chosen = (u - codec.levels[idx]).abs()
    best = (u - codec.levels[nearest]).abs()
    assert torch.allclose(chosen, best, atol=1e-6)
    assert torch.allclose(enc.scales[:, 0], x.norm(dim=1), rtol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("width", [64, 512])
def test_dot_in_the_rotated_basis(bits, width):
    """q . decode(x) == rotate(q) . levels[codes] * radius / sqrt(n), within 1e-5 relative."""
    codec: TurboCodec = get_codec(f"tq{bits}", width)
    x, q = torch.randn(40, width), torch.randn(8, width)
    enc = codec.encode(x)
    direct = q.double() @ codec.decode(enc).double().T  # [8, 40]
    levels = codec.levels[codec.unpack(enc.codes)].double()  # [40, n]
    rotated = (codec.rotation.rotate(q.double()) @ levels.T) * (enc.scales[:, 0].double() / math.sqrt(width))
    assert ((direct - rotated).norm() / direct.norm()).item() < 1e-5


def test_four_bit_layout_is_nibbles_low_first():
    codec = get_codec("tq4", 8)
    enc = codec.encode(torch.randn(3, 8))
    idx = codec.unpack(enc.codes)
    assert torch.equal(enc.codes.long(), idx[:, 0::2] | (idx[:, 1::2] << 4))


def test_scale_invariance():
    codec = get_codec("tq3", 64)
    x = torch.randn(5, 64)
    a, b = codec.encode(x), codec.encode(x * 1024.0)
    assert torch.equal(a.codes, b.codes)
    assert torch.allclose(b.scales, a.scales * 1024.0)
