"""The codec contract: float rows in, packed bytes plus float32 scales out, and back.

A codec is bound to one row width n. The latent cache keeps two per layer (the latent `c`,
n = kv_lora_rank, and the rope key `r`, n = qk_rope_head_dim), each with its own scales, so
a row of one codec is exactly

    bytes_per_row = code_bytes + 4 * scale_count

and nothing else (no padding, no headers). `params()` names everything that changes those
bytes; the cache records it so a file written under one codec is never read under another.

`decode` exists for tests, fallbacks and re-encoding; attention reads the packed rows through
the consumers in `latentkv.attention.consumers` without rebuilding them.

Devices: a codec works on the device of the rows it is given (encode) or the codes (decode) and
makes every intermediate there. Its constant tables (level tables, rotation signs, bit positions)
are made once on the host (`HOST`, explicitly: never torch's default device) and copied once to
each device they are used on (`PerDevice`), so a codec is shared by caches on any device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

# Where a codec's constant tables are made, once, before `PerDevice` copies them to the rows' device.
HOST = torch.device("cpu")


class PerDevice:
    """A codec's constant tensor (a level table, rotation signs, bit offsets): made once on the
    host, copied once to each device it is asked for, never rebuilt per call."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self._copies = {host.device: host}

    def on(self, device: torch.device) -> torch.Tensor:
        copy = self._copies.get(device)
        if copy is None:
            copy = self._copies[device] = self.host.to(device)
        return copy


@dataclass(frozen=True)
class EncodedRows:
    """N encoded rows: `codes` uint8 [N, code_bytes] and `scales` float32 [N, scale_count]."""

    codes: torch.Tensor  # [N, code_bytes] uint8
    scales: torch.Tensor  # [N, scale_count] float32

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 2:
            raise ValueError(
                f"codes must be uint8 [N, bytes], got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        if self.scales.dtype != torch.float32 or self.scales.dim() != 2:
            raise ValueError(
                f"scales must be float32 [N, count], got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.codes.shape[0] != self.scales.shape[0]:
            raise ValueError(f"{self.codes.shape[0]} code rows but {self.scales.shape[0]} scale rows")

    def __len__(self) -> int:
        return self.codes.shape[0]

    def rows(self, start: int, stop: int) -> EncodedRows:
        """Rows [start, stop) as views (no copy)."""
        return EncodedRows(self.codes[start:stop], self.scales[start:stop])

    def select(self, index: torch.Tensor) -> EncodedRows:
        """The rows at `index` [K] (a copy): how DSA gathers its top-k tokens from a packed cache."""
        return EncodedRows(self.codes.index_select(0, index), self.scales.index_select(0, index))

    @staticmethod
    def cat(parts: list[EncodedRows]) -> EncodedRows:
        return EncodedRows(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


class Codec(ABC):
    """One row format at one width. Subclasses set the attributes in `__init__`."""

    name: str
    width: int
    bits: int | None  # bits per stored value of a quantized code; None for the identity codecs
    code_bytes: int  # packed bytes per row
    scale_count: int  # float32 scales per row

    @property
    def bytes_per_row(self) -> int:
        return self.code_bytes + 4 * self.scale_count

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """Everything that changes the bytes: name, width, bits, rotation seed, group size."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> EncodedRows:
        """float32 rows [N, width] -> EncodedRows."""

    @abstractmethod
    def decode(self, enc: EncodedRows) -> torch.Tensor:
        """EncodedRows -> float32 rows [N, width]."""

    def empty(self, rows: int, *, device: torch.device) -> EncodedRows:
        """Zero-filled storage for `rows` rows on `device`."""
        return EncodedRows(
            torch.zeros(rows, self.code_bytes, dtype=torch.uint8, device=device),
            torch.zeros(rows, self.scale_count, dtype=torch.float32, device=device),
        )

    def check_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Validate encode's input: float32 [N, width] (returned contiguous)."""
        if x.dim() != 2 or x.shape[1] != self.width:
            raise ValueError(f"{self.name} codec of width {self.width} got rows of shape {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise ValueError(f"{self.name} codec encodes float32 rows, got {x.dtype}")
        return x.contiguous()

    def check_encoded(self, enc: EncodedRows) -> None:
        """Validate decode's input: rows of exactly this codec's byte and scale counts."""
        if enc.codes.shape[1] != self.code_bytes or enc.scales.shape[1] != self.scale_count:
            raise ValueError(
                f"{self.name} rows of width {self.width} have {self.code_bytes} code bytes and "
                f"{self.scale_count} scales; got {enc.codes.shape[1]} and {enc.scales.shape[1]}"
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items() if k != "name")
        return f"{type(self).__name__}({self.name}, {args})"
