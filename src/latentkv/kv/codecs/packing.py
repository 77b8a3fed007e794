"""Dense LSB-first bit packing of small codes (1..8 bits each) into bytes.

A row is a bit stream: value j occupies `widths[j]` bits starting at bit offset
o_j = sum_{i<j} widths[i], and bit k of the stream is bit (k mod 8) of byte k div 8. Nothing is
padded except the end of the row, up to a whole byte: ceil(sum widths / 8) bytes. For a
uniform width b this is "b bits per value, LSB first" (b = 4: value 2k in the low nibble of
byte k); mixed widths serve PolarQuant's levels.

A value of at most 8 bits spans at most two bytes, so with the per-value byte index
i_j = o_j div 8 and shift s_j = o_j mod 8 precomputed:

    unpack:  v_j = ((byte[i_j] | byte[i_j + 1] << 8) >> s_j) & (2^w_j - 1)     (two gathers)
    pack:    byte[i_j] += (v_j << s_j) & 255;  byte[i_j + 1] += (v_j << s_j) >> 8   (scatter-adds;
             fields never share a bit, so adding is OR-ing)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from latentkv.kv.codecs.base import HOST, PerDevice


def packed_bytes(total_bits: int) -> int:
    return (total_bits + 7) // 8


class BitLayout:
    """Where each of m values sits in a packed row; packs [N, m] codes <-> uint8 [N, nbytes]."""

    def __init__(self, widths: Sequence[int]):
        w = torch.tensor(list(widths), dtype=torch.int64, device=HOST)
        if w.numel() == 0 or int(w.min()) < 1 or int(w.max()) > 8:
            raise ValueError("bit widths must be between 1 and 8")
        offsets = torch.cumsum(w, 0) - w  # [m]
        self.count = w.numel()
        self.total_bits = int(w.sum())
        self.nbytes = packed_bytes(self.total_bits)
        byte = offsets // 8
        self._byte = PerDevice(byte)  # [m]
        self._next = PerDevice(byte + 1)  # [m]; may point one past the row, into the scratch byte
        self._shift = PerDevice((offsets % 8).to(torch.int32))  # [m]
        self._mask = PerDevice(((1 << w) - 1).to(torch.int32))  # [m]

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """Codes [N, m] (any integer dtype, each below 2^width) -> uint8 [N, nbytes]."""
        if values.dim() != 2 or values.shape[1] != self.count:
            raise ValueError(f"expected codes [N, {self.count}], got {tuple(values.shape)}")
        device = values.device
        shifted = (values.to(torch.int32) & self._mask.on(device)) << self._shift.on(device)  # [N, m], < 2^16
        # one scratch byte past the row, for the high part of a field that ends in the last byte
        out = torch.zeros(values.shape[0], self.nbytes + 1, dtype=torch.int32, device=device)
        out.index_add_(1, self._byte.on(device), shifted & 0xFF)
        out.index_add_(1, self._next.on(device), shifted >> 8)
        return out[:, : self.nbytes].to(torch.uint8)

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 [N, nbytes] -> codes int32 [N, m]."""
        if codes.dim() != 2 or codes.shape[1] != self.nbytes:
            raise ValueError(f"expected packed rows [N, {self.nbytes}], got {tuple(codes.shape)}")
        device = codes.device
        padded = torch.nn.functional.pad(codes, (0, 1)).to(torch.int32)  # [N, nbytes + 1]
        word = padded[:, self._byte.on(device)] | (padded[:, self._next.on(device)] << 8)  # [N, m]
        return (word >> self._shift.on(device)) & self._mask.on(device)


def uniform_layout(count: int, bits: int) -> BitLayout:
    """`count` values of `bits` bits each."""
    return BitLayout([bits] * count)


def _group(bits: int) -> tuple[int, int]:
    """The fewest values that fill whole bytes, and those bytes: 8 in 3 bytes at 3 bits, 4 in 3 at 6."""
    values = 8 // math.gcd(8, bits)
    return values, values * bits // 8


def pack_uniform(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, m] of `bits` bits each -> uint8 [N, ceil(m * bits / 8)], LSB first."""
    n, m = values.shape
    per, nbytes = _group(bits)
    if m % per:
        return uniform_layout(m, bits).pack(values)
    # `per` values fill exactly `nbytes` bytes: build that word, then cut it into bytes.
    v = values.to(torch.int64).view(n, m // per, per) & ((1 << bits) - 1)
    word = (v << (torch.arange(per, device=v.device) * bits)).sum(
        dim=-1
    )  # [N, m/per]; disjoint bits: sum == OR
    out = (word[..., None] >> (torch.arange(nbytes, device=v.device) * 8)) & 0xFF  # [N, m/per, nbytes]
    return out.to(torch.uint8).view(n, m * bits // 8)


def unpack_uniform(codes: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """uint8 [N, ceil(count * bits / 8)] -> codes int32 [N, count] (inverse of `pack_uniform`)."""
    n = codes.shape[0]
    if codes.shape[1] != packed_bytes(count * bits):
        raise ValueError(f"{count} values of {bits} bits need {packed_bytes(count * bits)} bytes per row")
    per, nbytes = _group(bits)
    if count % per:
        return uniform_layout(count, bits).unpack(codes)
    mask = (1 << bits) - 1
    if nbytes == 1:  # whole values per byte (1, 2, 4, 8 bits): shift the bytes themselves
        parts = [(codes >> (k * bits)) & mask for k in range(per)]
        return torch.stack(parts, dim=-1).view(n, count).to(torch.int32)
    dtype = torch.int32 if nbytes <= 3 else torch.int64  # 3 and 6 bits fit 24-bit words; 5 and 7 need 40/56
    c = codes.reshape(n, count // per, nbytes).to(dtype)
    word = c[..., 0]
    for k in range(1, nbytes):
        word = word | (c[..., k] << (8 * k))  # [N, count/per]
    shifts = torch.arange(per, dtype=dtype, device=codes.device) * bits
    return ((word[..., None] >> shifts) & mask).view(n, count).to(torch.int32)
