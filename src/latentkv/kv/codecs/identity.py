"""Identity codecs: rows stored as float32 (`f32`, the reference) or bfloat16 (`bf16`).

The payload is the values' little-endian bytes, so every codec hands the cache the same
uint8 [N, code_bytes] shape: f32 is 4n bytes per row, bf16 2n (round to nearest even), with
no scales. f32 round-trips bit for bit, NaN and inf included.
"""

from __future__ import annotations

from typing import Any

import torch

from latentkv.kv.codecs.base import Codec, EncodedRows


class _IdentityCodec(Codec):
    dtype: torch.dtype

    def __init__(self, width: int):
        if width < 1:
            raise ValueError(f"row width must be positive, got {width}")
        self.width = width
        self.bits = None
        self.code_bytes = width * self.dtype.itemsize
        self.scale_count = 0

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width}

    def encode(self, x: torch.Tensor) -> EncodedRows:
        x = self.check_rows(x)  # [N, n]
        codes = x.to(self.dtype, copy=True).view(torch.uint8)  # [N, n * itemsize]
        return EncodedRows(codes, torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device))

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """Stored values [N, n] in the codec's dtype: a view of the bytes, no copy."""
        return codes.view(self.dtype)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        return self.values(enc.codes).to(torch.float32, copy=True)  # [N, n]


class F32Codec(_IdentityCodec):
    name = "f32"
    dtype = torch.float32


class Bf16Codec(_IdentityCodec):
    name = "bf16"
    dtype = torch.bfloat16
