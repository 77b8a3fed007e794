"""PolarQuant: row sizes, angle grids, norm preservation, and the unit vectors consumers read."""

from __future__ import annotations

import math

import pytest
import torch

from latentkv.kv.codecs import PolarCodec, get_codec
from latentkv.kv.codecs.polar import angle_grids


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("width", [2, 8, 64, 512])
def test_row_bytes(bits, width):
    deep = max(bits - 1, 1)
    assert (
        get_codec(f"polar{bits}", width).code_bytes == (width // 2 * bits + (width // 2 - 1) * deep + 7) // 8
    )


def test_published_sizes():
    assert get_codec("polar4", 512).code_bytes == 224 and get_codec("polar4", 64).code_bytes == 28
    sizes = {
        b: get_codec(f"polar{b}", 512).bytes_per_row + get_codec(f"polar{b}", 64).bytes_per_row
        for b in (3, 4, 6)
    }
    assert sizes == {3: 188, 4: 260, 6: 404}


def test_grids():
    grids = angle_grids(512, 4)
    assert len(grids) == 9
    assert (
        grids[0].bins == 16 and grids[0].lo == -math.pi and grids[0].step == pytest.approx(2 * math.pi / 16)
    )
    assert grids[1].bins == 8 and grids[1].lo == pytest.approx(0.0)  # s = 2: half-width capped at pi/4
    assert grids[2].lo == pytest.approx(math.pi / 4 - 1.5 / 2)  # s = 4
    assert grids[8].lo == pytest.approx(math.pi / 4 - 1.5 / 16)  # s = 256
    assert angle_grids(8, 2)[1].bins == 2  # deeper levels keep at least one bit


def test_level_one_bins_cover_the_circle():
    grid = angle_grids(2, 3)[0]
    theta = torch.tensor([-math.pi, -math.pi + 1e-6, 0.0, math.pi - 1e-6, math.pi])
    assert grid.quantize(theta).tolist() == [0, 0, 4, 7, 7]


@pytest.mark.parametrize("bits", [2, 4, 6])
def test_decode_keeps_the_norm_and_unit_vectors_are_unit(bits):
    codec: PolarCodec = get_codec(f"polar{bits}", 64)
    x = torch.randn(20, 64) * 3
    enc = codec.encode(x)
    assert torch.allclose(codec.decode(enc).norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert torch.allclose(codec.unit_vectors(enc.codes).norm(dim=1), torch.ones(20), rtol=1e-5)


def test_unit_vectors_are_the_rotated_rows():
    codec: PolarCodec = get_codec("polar5", 512)
    x = torch.randn(16, 512)
    enc = codec.encode(x)
    rotated = codec.rotation.rotate(codec.decode(enc).double())
    unit = codec.unit_vectors(enc.codes).double() * enc.scales.double()
    assert ((rotated - unit).norm() / rotated.norm()).item() < 1e-5


def test_exact_angles_decode_exactly():
    # A 2-wide row at a bin centre of level 1 comes back unchanged (up to rounding).
    codec: PolarCodec = get_codec("polar3", 2)
    centre = -math.pi + 2.5 * (2 * math.pi / 8)
    y = torch.tensor([[math.cos(centre), math.sin(centre)]]) * 2.0
    x = codec.rotation.unrotate(y)
    assert torch.allclose(codec.decode(codec.encode(x)), x, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("width", [4, 16, 64, 512])
def test_fast_unpack_agrees_with_the_bit_layout(bits, width):
    codec: PolarCodec = get_codec(f"polar{bits}", width)
    enc = codec.encode(torch.randn(9, width))
    idx = codec.unpack(enc.codes)
    assert idx.shape == (9, width - 1)
    assert torch.equal(idx, codec.layout.unpack(enc.codes))
    assert torch.equal(codec.layout.pack(idx), enc.codes)
