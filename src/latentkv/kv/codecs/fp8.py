"""fp8 e4m3 rows with per-row (or per-group) float32 scales.

Format: OCP e4m3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; max +-448, no
infinities, 0x7F / 0xFF are NaN. Normal codes are (1 + m/8) * 2^(e-7), subnormals m * 2^-9.

Encoding a row x [n] (or each group of g values when grouped, n/g scales per row):

    amax  = max_i |x_i|
    scale = amax / 448                      (float32, stored)
    byte  = e4m3(x_i / scale)               round to nearest even

with our rules: |v| > 448 and +-inf saturate to +-448 (0x7E | sign), NaN encodes to 0.
A row (group) with amax <= 1e-35 or a non-finite amax is inert: zero codes, scale 1.
Decoding is a 256-entry table (the NaN codes read as 0) times the scale, so a consumer can
factor the scale out of a dot product: q . x_hat = scale * sum_i q_i lut[byte_i].

The encoder works on the float32 bit pattern with integer ops (vectorised, no Python loop)
and is bit-exact against `ml_dtypes.float8_e4m3fn` under the rules above.
"""

from __future__ import annotations

from typing import Any

import torch

from latentkv.kv.codecs.base import HOST, Codec, EncodedRows, PerDevice

E4M3_MAX = 448.0
INERT_AMAX = 1e-35
_SATURATED = 0x7E  # the code of 448
_MIN_NORMAL_BITS = 121 << 23  # float32 bit pattern of 2^-6, the smallest normal e4m3
_EXP_REBIAS = (127 - 7) << 3  # float32 exponent bias 127 -> e4m3 bias 7, in e4m3 code units


def e4m3_table() -> torch.Tensor:
    """The value of every code, float32 [256]; NaN codes (0x7F, 0xFF) read as 0."""
    code = torch.arange(256, dtype=torch.int64, device=HOST)
    exp, man = (code >> 3) & 0xF, (code & 7).to(torch.float64)
    magnitude = torch.where(exp == 0, man * 2.0**-9, (1 + man / 8) * torch.exp2(exp.to(torch.float64) - 7))
    value = torch.where(code >= 128, -magnitude, magnitude)
    value[(code & 0x7F) == 0x7F] = 0.0
    return value.to(torch.float32)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 values (any shape) -> e4m3 bytes (uint8, same shape), RNE, saturating, NaN -> 0."""
    bits = v.to(torch.float32).contiguous().view(torch.int32)
    sign = (bits >> 24) & 0x80  # arithmetic shift keeps the sign bit in bit 7
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    # Normal range: drop 20 of float32's 23 mantissa bits, rounding to nearest even; a carry out
    # of the mantissa bumps the exponent, which is what rounding up to the next binade means.
    mag = mag.clamp(max=0x7F800000)
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - _EXP_REBIAS
    normal = normal.clamp(max=_SATURATED)
    # Subnormal range (|v| < 2^-6): the code is |v| / 2^-9 rounded half to even (0..8; 8 is 2^-6).
    subnormal = torch.round(v.abs() * 512.0).to(torch.int32)
    code = torch.where(mag < _MIN_NORMAL_BITS, subnormal, normal) | sign
    return torch.where(is_nan, 0, code).to(torch.uint8)


class Fp8Codec(Codec):
    """e4m3 codes, one byte per value, plus one float32 scale per row or per group."""

    name = "fp8"

    def __init__(self, width: int, group_size: int | None = None):
        if width < 1:
            raise ValueError(f"row width must be positive, got {width}")
        group = width if group_size is None else group_size
        if group < 1 or width % group:
            raise ValueError(f"fp8 group size {group_size} must divide the row width {width}")
        self.width = width
        self.bits = 8
        self.group_size = group_size
        self.group = group
        self.code_bytes = width
        self.scale_count = width // group
        self.table = e4m3_table()  # [256], on the host
        self._device_table = PerDevice(self.table)

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "bits": self.bits, "group_size": self.group_size}

    def encode(self, x: torch.Tensor) -> EncodedRows:
        x = self.check_rows(x)
        groups = x.view(x.shape[0], self.scale_count, self.group)  # [N, G, g]
        amax = groups.abs().amax(dim=-1)  # [N, G]; NaN propagates, so a NaN row is inert
        inert = ~torch.isfinite(amax) | (amax <= INERT_AMAX)
        scale = torch.where(inert, 1.0, amax / E4M3_MAX)  # [N, G]
        codes = e4m3_encode(groups / scale[..., None])  # [N, G, g]
        codes = codes.masked_fill(inert[..., None], 0)
        return EncodedRows(codes.view(x.shape[0], self.width), scale.to(torch.float32))

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """Unscaled values table[codes], float32 [N, n]."""
        flat = codes.reshape(-1).to(torch.int32)
        return self._device_table.on(codes.device).index_select(0, flat).view(codes.shape)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        n = len(enc)
        values = self.values(enc.codes).view(n, self.scale_count, self.group)  # [N, G, g]
        return (values * enc.scales[..., None]).view(n, self.width)
