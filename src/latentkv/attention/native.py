"""The CPU attention backend: decode steps through latentkv's own kernel (native/attention.cpp).

One new token's query, all heads, against its cache's rows read in place: scores, softmax and
context in one call, each stored value widened to float32 once per use and multiplied in float32
registers (the reference widens each tile to a float32 copy first, then runs two matmuls). It
serves CPU caches whose two row parts are stored as

    bf16              the rows' bfloat16 bytes
    q8_0, q8s         llama.cpp's q8_0 blocks (int8 and an fp16 scale per 32 values)
    q4_0, q4s         q4_0's blocks (4-bit levels and an fp16 scale per 32 values)

with no float32 recent window, on CPUs whose torch capability is AVX-512 or AVX2 (the kernel's
two vector paths), unless LATENTKV_CPU_ATTENTION=0 is set (read when a tier is first used). `f32`
stays with the reference (its rows are read in place already, and its arithmetic is the one
every tier is measured against); every other tier, device or CPU goes to the reference through
`refuse`. Inside a served cache, anything but one decode token (a prefill's queries, a masked
read) also goes to the reference, and so does a call over more rows than keep its scores within
MAX_SCORES values (the kernel holds them all; the reference tiles).

DSA's top-k rows (`attend_selected`) are read where they are stored, through their indices: no
gathered copy of them is made.
"""

from __future__ import annotations

import os

import torch

from latentkv import native
from latentkv.attention.base import register_backend
from latentkv.attention.reference import REFERENCE
from latentkv.kv.cache import KVTier, PackedRows, RowReader
from latentkv.kv.codecs import Bf16Codec, BlockCodec, Codec, SearchedBlockCodec

# codec name -> the kernel's row format (attention.cpp)
FORMATS = {"bf16": "bf16", "q8_0": "q8_0", "q8s": "q8_0", "q4_0": "q4_0", "q4s": "q4_0"}
KERNEL_ISA = 1  # the kernel's paths: AVX2 (1) and AVX-512 (2 and up)
# The kernel holds every score of a call ([rows, heads] float32); past this many values (64 heads
# over 65,536 rows) a call goes to the reference, whose tiles bound memory at any length.
MAX_SCORES = 4 * 1024 * 1024
SWITCH = "LATENTKV_CPU_ATTENTION"  # "0": leave every CPU cache to the torch reference


def row_format(codec: Codec) -> tuple[int, int] | None:
    """(format code, block) of the kernel that reads `codec`'s rows as stored; None if none does."""
    if type(codec) not in (Bf16Codec, BlockCodec, SearchedBlockCodec) or codec.name not in FORMATS:
        return None
    block = 0 if isinstance(codec, Bf16Codec) else codec.block
    return native.ROW_FORMATS[FORMATS[codec.name]], block


class CpuDecode:
    """Decode attention by latentkv's CPU kernel; the rest through the torch reference."""

    name = "cpu"

    def refuse(self, tier: KVTier, device: torch.device) -> str | None:
        """None when the kernel reads caches of `tier` on `device`; otherwise why not."""
        if device.type != "cpu":
            return f"runs on the CPU (not {device.type})"
        if os.environ.get(SWITCH) == "0":
            return f"turned off ({SWITCH}=0)"
        if tier.recent_window:
            return "a cache with a float32 recent window is read by the torch reference"
        for part, codec in (("c", tier.codec_c), ("r", tier.codec_r)):
            if row_format(codec) is None:
                known = ", ".join(sorted(FORMATS))
                return f"tier {tier.name}: no kernel reads {codec.name} rows ({part}); it reads {known}"
        if tier.codec_c.width % 16:
            return f"the latent width {tier.codec_c.width} is not a multiple of 16"
        kernels = native.kernels()
        if kernels is None:
            return f"latentkv's CPU kernels are not built here ({native.unavailable()})"
        if kernels.isa < KERNEL_ISA:
            return f"needs AVX2 or AVX-512 (this process runs the {kernels.name} path)"
        return None

    def attend(
        self,
        query: torch.Tensor,
        reader: RowReader,
        allowed: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [H, S, Lkv+R]: one decode token over packed rows runs the kernel."""
        if query.shape[1] != 1 or allowed is not None or not _fits(query, reader):
            return REFERENCE.attend(query, reader, allowed, positions)
        return self._decode(query[:, 0], reader, None)[:, None]

    def attend_selected(
        self, query: torch.Tensor, reader: RowReader, index: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, 1, Lkv+R] over the rows at `index` (DSA's top-k): the kernel reads them where
        they are stored (no gathered copy)."""
        if query.shape[1] != 1 or not _fits(query, reader, len(index)):
            return REFERENCE.attend_selected(query, reader, index, positions)
        return self._decode(query[:, 0], reader, index.to(torch.int64).contiguous())[:, None]

    def attend_batch(
        self, query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
    ) -> torch.Tensor:
        """query [H, B, Lkv+R], one reader per sequence, blocked [B, T'] (True: not attended):
        each sequence through the kernel, over the rows its mask leaves."""
        if not all(_fits(query, r, len(r)) for r in readers):
            return REFERENCE.attend_batch(query, readers, blocked)
        out = []
        for b, reader in enumerate(readers):
            index = None
            if blocked is not None and bool(blocked[b, : len(reader)].any()):
                index = (~blocked[b, : len(reader)]).nonzero().squeeze(1)
            out.append(self._decode(query[:, b], reader, index))
        return torch.stack(out, dim=1)

    def attend_padded(
        self, query: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None, kv_lora_rank: int
    ) -> torch.Tensor:
        """Float32 rows (a slot pool's): the reference's."""
        return REFERENCE.attend_padded(query, rows, blocked, kv_lora_rank)

    def _decode(self, query: torch.Tensor, reader: PackedRows, index: torch.Tensor | None) -> torch.Tensor:
        """query [H, Lkv+R] over the reader's rows (those at `index` if given) -> [H, Lkv]."""
        kernels = native.kernels()
        assert kernels is not None  # refuse() served this tier
        c_format, r_format = row_format(reader.codec_c), row_format(reader.codec_r)
        assert c_format is not None and r_format is not None
        return kernels.mla_decode(
            query.contiguous(),
            reader.c.codes,
            reader.r.codes,
            index,
            c_format,
            r_format,
            reader.codec_r.width,
        )


def _fits(query: torch.Tensor, reader: RowReader, rows: int | None = None) -> bool:
    """Packed rows (not a windowed reader's), few enough for one call's scores: `rows` of them
    read, or all the reader's (their tensors' size, not `len()`, which would make a traced
    step's symbolic context a constant: `models.compiled.ExportedDecode`)."""
    if not isinstance(reader, PackedRows):
        return False
    return (reader.c.codes.shape[0] if rows is None else rows) * query.shape[0] <= MAX_SCORES


CPU = register_backend(CpuDecode())  # tried before the reference, which serves the rest
