"""Dense LSB-first packing: round trips for every bit width, and the exact bit order."""

from __future__ import annotations

import pytest
import torch

from latentkv.kv.codecs.packing import BitLayout, pack_uniform, packed_bytes, unpack_uniform


def reference_pack(values: list[int], widths: list[int]) -> list[int]:
    """The bit stream built one bit at a time: bit k of the row is bit k % 8 of byte k // 8."""
    stream = 0
    offset = 0
    for v, w in zip(values, widths, strict=True):
        stream |= v << offset
        offset += w
    return list(stream.to_bytes(packed_bytes(offset), "little"))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("width", [8, 64, 512])
def test_uniform_round_trip(bits, width):
    codes = torch.randint(0, 2**bits, (33, width))
    packed = pack_uniform(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (33, width * bits // 8)
    assert torch.equal(unpack_uniform(packed, bits, width), codes)
    layout = BitLayout([bits] * width)  # the general path agrees with the fast one
    assert torch.equal(layout.pack(codes), packed)
    assert torch.equal(layout.unpack(packed), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("width", [1, 3, 12, 20])
def test_uniform_odd_counts(bits, width):
    codes = torch.randint(0, 2**bits, (5, width))
    packed = pack_uniform(codes, bits)
    assert packed.shape[1] == packed_bytes(width * bits)
    assert torch.equal(unpack_uniform(packed, bits, width), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_bit_order_is_lsb_first(bits):
    codes = torch.randint(0, 2**bits, (4, 64))
    packed = pack_uniform(codes, bits)
    for row in range(4):
        assert packed[row].tolist() == reference_pack(codes[row].tolist(), [bits] * 64)


def test_four_bits_put_even_values_in_the_low_nibble():
    assert pack_uniform(torch.tensor([[0x1, 0x2, 0xA, 0xF]]), 4).tolist() == [[0x21, 0xFA]]


def test_mixed_widths_round_trip_and_order():
    widths = [4] * 32 + [3] * 31  # PolarQuant's layout at n = 64, b = 4
    layout = BitLayout(widths)
    assert layout.nbytes == packed_bytes(32 * 4 + 31 * 3) == 28
    codes = torch.cat([torch.randint(0, 16, (6, 32)), torch.randint(0, 8, (6, 31))], dim=1)
    packed = layout.pack(codes)
    assert torch.equal(layout.unpack(packed), codes)
    assert packed[0].tolist() == reference_pack(codes[0].tolist(), widths)


def test_wrong_shapes_are_refused():
    with pytest.raises(ValueError):
        unpack_uniform(torch.zeros(2, 7, dtype=torch.uint8), 4, 16)
    with pytest.raises(ValueError):
        BitLayout([4, 9])
