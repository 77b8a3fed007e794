"""What the Triton decode kernel needs to know of one codec's stored row: a `PartFormat`.

The kernel reads the bytes a codec stored, in place, so each codec it serves is described by
the few integers that say where each value's bits sit and how they become a float (the codec
modules, `latentkv.kv.codecs`, define the bytes; this file only restates their layout):

    kind   codecs                       one value j of a row                      per-row factor
    F32    f32                          float32 j                                 1
    BF16   bf16                         bfloat16 j (bits << 16)                   1
    FP8    fp8                          e4m3(byte j) (0x7F, 0xFF read as 0)       scale (1 scale)
                                        x scale[j // group] (grouped)             1
    BLOCK  q8_0 q5_0 q4_0 q4_1,         blocks of `block` values, fp16 d first:   1
           hq*, q8s q5s q4s wq4         (level - offset) d  [+ m: q4_1]
                                        wq4: table[code] d
    TQ     tq2 .. tq6                   table[b-bit code j] (LSB-first stream)    radius / sqrt(n)
                                        x radius[j // g] / sqrt(g) (grouped)      1

A codec with a rotation (tq*, hq*) is read in the rotated basis: the caller rotates the query
part once and unrotates the context once (`rotation` below). PolarQuant's angle tree is not
served (`refusal` says so and the torch consumers read it).

Nothing here imports triton: the backend can state what it serves on a machine without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latentkv.kv.codecs import (
    Bf16Codec,
    BlockCodec,
    Codec,
    F32Codec,
    Fp8Codec,
    RotatedBlockCodec,
    SearchedBlockCodec,
    TurboCodec,
)
from latentkv.kv.codecs.rotation import Rotation

F32, BF16, FP8, BLOCK, TQ = range(5)
KIND_NAMES = ("f32", "bf16", "fp8", "block", "tq")
# bytes of the unit the kernel addresses a row in (f32: floats, bf16: 16-bit words, else bytes)
UNIT_BYTES = {F32: 4, BF16: 2, FP8: 1, BLOCK: 1, TQ: 1}


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class PartFormat:
    """One part (c or r) of a row as the kernel reads it. `constants()` is the kernel's constexpr
    tuple; `table` (levels of TQ and wq4) and `gain` (TQ's 1/sqrt(group)) travel as arguments."""

    kind: int
    width: int  # values per row
    bits: int = 0  # BLOCK, TQ: bits per stored code
    block: int = 0  # BLOCK: values per block
    block_bytes: int = 0  # BLOCK: bytes per block
    header: int = 0  # BLOCK: fp16 d (2) or d and m (4)
    high: int = 0  # BLOCK: bytes of q5's fifth-bit field
    offset: int = 0  # BLOCK: the zero level of the symmetric formats
    affine: bool = False  # BLOCK: q4_1's minimum m
    scales: int = 0  # float32 scales per row
    group: int = 0  # values per scale (the row when one scale)
    code_bytes: int = 0  # stored code bytes per row
    table: tuple[float, ...] | None = None  # level of each code (TQ, wq4)
    gain: float = 1.0  # factor on every scale (TQ: 1 / sqrt(group))
    rotation: Rotation | None = None  # rows stored rotated: rotate the query, unrotate the context

    @property
    def padded(self) -> int:
        """The row width rounded up to a power of two (at least 16: a tensor-core tile's K)."""
        return max(16, next_power_of_two(self.width))

    @property
    def unit_bytes(self) -> int:
        return UNIT_BYTES[self.kind]

    def constants(self) -> tuple:
        """The kernel's compile-time description of this part (a constexpr tuple, see kernels.py)."""
        return (
            self.kind,
            self.width,
            self.padded,
            self.bits,
            self.block,
            self.padded // self.block if self.block else 0,  # blocks in a padded row
            self.block_bytes,
            self.header,
            self.high,
            self.offset,
            int(self.affine),
            int(self.table is not None),
            self.scales,
            self.group,
            self.code_bytes,
        )

    def table_tensor(self, device: torch.device) -> torch.Tensor:
        """The level table as float32 on `device` (one zero when the format has none)."""
        values = self.table if self.table is not None else (0.0,)
        return torch.tensor(values, dtype=torch.float32, device=device)


def _f32(codec: F32Codec) -> PartFormat:
    return PartFormat(F32, codec.width, code_bytes=codec.code_bytes)


def _bf16(codec: Bf16Codec) -> PartFormat:
    return PartFormat(BF16, codec.width, code_bytes=codec.code_bytes)


def _fp8(codec: Fp8Codec) -> PartFormat:
    return PartFormat(
        FP8, codec.width, bits=8, scales=codec.scale_count, group=codec.group, code_bytes=codec.code_bytes
    )


def _block(codec: BlockCodec) -> PartFormat:
    return PartFormat(
        BLOCK,
        codec.width,
        bits=codec.bits,
        block=codec.block,
        block_bytes=codec.block_bytes,
        header=codec.header,
        high=codec.high,
        offset=codec.format.offset,
        affine=codec.format.affine,
        code_bytes=codec.code_bytes,
        rotation=codec.rotation,
    )


def _searched(codec: SearchedBlockCodec) -> PartFormat:
    # q8s / q5s / q4s: q8_0's / q5_0's / q4_0's bytes (levels code - 0 / 16 / 8); wq4: a table
    table = tuple(codec.table.tolist()) if codec.name == "wq4" else None
    offset = 0 if table is not None or codec.bits == 8 else len(codec.table) // 2
    return PartFormat(
        BLOCK,
        codec.width,
        bits=codec.bits,
        block=codec.block,
        block_bytes=codec.block_bytes,
        header=2,
        high=codec.high,
        offset=offset,
        code_bytes=codec.code_bytes,
        table=table,
    )


def _turbo(codec: TurboCodec) -> PartFormat:
    return PartFormat(
        TQ,
        codec.width,
        bits=codec.bits,
        scales=codec.scale_count,
        group=codec.group,
        code_bytes=codec.code_bytes,
        table=tuple(codec.levels.tolist()),
        gain=codec.group**-0.5,
        rotation=codec.rotation,
    )


_FORMATS = {
    F32Codec: _f32,
    Bf16Codec: _bf16,
    Fp8Codec: _fp8,
    BlockCodec: _block,
    RotatedBlockCodec: _block,
    SearchedBlockCodec: _searched,
    TurboCodec: _turbo,
}


def refusal(codec: Codec) -> str | None:
    """None when the kernel reads this codec's rows; otherwise why not."""
    if type(codec) not in _FORMATS:
        return f"{codec.name} rows have no Triton decode kernel (served: f32, bf16, fp8, block tiers, tq*)"
    return None


def part_format(codec: Codec) -> PartFormat:
    """The kernel's description of `codec`'s rows; ValueError (the refusal) when it has none."""
    reason = refusal(codec)
    if reason is not None:
        raise ValueError(reason)
    return _FORMATS[type(codec)](codec)
