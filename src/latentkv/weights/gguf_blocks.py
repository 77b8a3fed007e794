"""GGUF's quantized blocks as our weight formats' states: kept exactly where a format holds them.

A GGUF matrix [out, in] is `out` rows of blocks along `in`. Five block types map onto our
formats with every code kept and every scale held (`EXACT`); the state is what
`Int8Linear.from_state` / `Int4Linear.from_state` take:

| GGUF | block | ours | mapping |
|---|---|---|---|
| Q8_0 | 32 x int8, f16 d | int8, group 32 | q, scale = d |
| Q6_K | 256: 16 groups of 16 x 6-bit, int8 sub-scale, f16 d | int8, group 16 | q - 32, scale = d * sub |
| Q4_0 | 32 x 4-bit, f16 d: (q - 8) d | int4, group 32 | q, scale = d, zero = 0 |
| Q4_1 | 32 x 4-bit, f16 d, m: q d + m | int4, group 32 | q, scale = d, zero = 8 d + m |
| Q4_K | 256: 8 groups of 32 x 4-bit, 6-bit sc, m; f16 d, dmin: q d sc - dmin m | int4, group 32 | q, scale = d sc, zero = 8 d sc - dmin m |
| Q5_0 | 32 x 5-bit, f16 d: (q - 16) d | int8, group 32 | q - 16, scale = d |
| IQ4_NL | 32 x 4-bit index into a table of 16 int8 values, f16 d | int8, group 32 | table[q], scale = d |
| IQ4_XS | 256: 8 groups of 32 as IQ4_NL, 6-bit sub-scale, f16 d | int8, group 32 | table[q], scale = d (ls - 32) |

Scales are float32 (int8 grouped and int4 keep float32 scales as given: see their modules).
Every other quantized type (Q5_1, Q5_K, Q2_K, Q3_K, the other IQ*, ...) has codes no format of
ours holds (an offset per group int8 lacks, or 5-bit asymmetric codes): models/gguf.py
dequantizes it with the `gguf` package and quantizes the floats again into int8 (5 bits and
more, `requantize_target`) or int4 (fewer), groups of 32, and reports the error it made.

The block layouts are llama.cpp's (ggml-common.h); the decoding below follows its reference
dequantization, and tests/weights/test_gguf_blocks.py checks it against the `gguf` package's and
a float64 decoder of their own.
"""

from __future__ import annotations

import torch

from latentkv.weights.int4 import pack_nibbles

# GGUF type name -> (our format, group size), for the types held exactly
EXACT: dict[str, tuple[str, int]] = {
    "Q8_0": ("int8", 32),
    "Q6_K": ("int8", 16),
    "Q4_0": ("int4", 32),
    "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32),
    "Q5_0": ("int8", 32),
    "IQ4_NL": ("int8", 32),
    "IQ4_XS": ("int8", 32),
}
# GGUF type name -> (elements per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q6_K": (256, 210),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q5_0": (32, 22),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}
# IQ4_NL / IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# Re-quantized types with at least this many bits per code go to int8; the others to int4.
INT8_MIN_BITS = 5
CODE_BITS = {"Q5_1": 5, "Q5_K": 5, "Q8_1": 8, "Q8_K": 8}
REQUANT_GROUP = 32

State = dict[str, torch.Tensor]


def exact_state(type_name: str, raw: torch.Tensor, cols: int) -> tuple[str, State]:
    """raw uint8 [rows, bytes per row] of a matrix [rows, cols] in `type_name` (a key of EXACT)
    -> (our format, its state), every value kept."""
    n, size = BLOCKS[type_name]
    rows = raw.shape[0]
    if cols % n or raw.shape[1] != cols // n * size:
        raise ValueError(
            f"{type_name} rows of {cols} values need {cols // n * size} bytes, got {raw.shape[1]}"
        )
    blocks = raw.reshape(rows * (cols // n), size)
    return EXACT[type_name][0], _DECODERS[type_name](blocks, rows, cols)


def requantize_target(type_name: str) -> str:
    """The format a type without an exact mapping is re-quantized into."""
    return "int8" if CODE_BITS.get(type_name, 0) >= INT8_MIN_BITS else "int4"


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian f16 at byte `at` of each block, as float32 [blocks]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float().reshape(-1)


def _q8_0(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8)  # [blocks, 32]
    return {"q": q.reshape(rows, cols), "scale": d.reshape(rows, cols // 32)}


def _q6_k(blocks: torch.Tensor, rows: int, cols: int) -> State:
    ql, qh = blocks[:, :128].view(-1, 2, 64), blocks[:, 128:192].view(-1, 2, 32)  # per half of 128
    sub = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [blocks, 16]
    d = _f16(blocks, 208)
    lo, hi = ql[..., :32], ql[..., 32:]
    parts = [  # the four runs of 32 values in each half, in order
        (lo & 0xF) | ((qh & 3) << 4),
        (hi & 0xF) | (((qh >> 2) & 3) << 4),
        (lo >> 4) | (((qh >> 4) & 3) << 4),
        (hi >> 4) | (((qh >> 6) & 3) << 4),
    ]
    q = torch.stack(parts, dim=2).to(torch.int16) - 32  # [blocks, 2 halves, 4 runs, 32]
    return {
        "q": q.to(torch.int8).reshape(rows, cols),
        "scale": (d[:, None] * sub).reshape(rows, cols // 16),  # d * sub: exact in float32
    }


def _q4_0(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d = _f16(blocks, 0)
    codes = _split_halves(blocks[:, 2:])  # [blocks, 32]
    return _int4(codes, d, torch.zeros_like(d), rows, cols)


def _q4_1(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    codes = _split_halves(blocks[:, 4:])
    return _int4(codes, d, 8 * d + m, rows, cols)


def _q4_k(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _scales_k4(blocks[:, 4:16])  # [blocks, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # four runs of 32 bytes: low nibbles then high ones
    codes = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)  # [blocks, 8 groups, 32]
    scale = d[:, None] * sc  # [blocks, 8]: an f16 times a 6-bit integer, exact in float32
    zero = 8 * scale - dmin[:, None] * m
    return _int4(codes.reshape(-1, 32), scale.reshape(-1), zero.reshape(-1), rows, cols)


def _q5_0(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d = _f16(blocks, 0)
    high = blocks[:, 2:6].contiguous().view(torch.int32)  # [blocks, 1]: bit j is value j's fifth bit
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1  # [blocks, 32]
    q = _split_halves(blocks[:, 6:]).to(torch.int16) | (bits.to(torch.int16) << 4)
    return {"q": (q - 16).to(torch.int8).reshape(rows, cols), "scale": d.reshape(rows, cols // 32)}


def _iq4_nl(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d = _f16(blocks, 0)
    q = torch.tensor(IQ4_VALUES, dtype=torch.int8)[_split_halves(blocks[:, 2:]).long()]
    return {"q": q.reshape(rows, cols), "scale": d.reshape(rows, cols // 32)}


def _iq4_xs(blocks: torch.Tensor, rows: int, cols: int) -> State:
    d = _f16(blocks, 0)
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # [blocks, 1]
    low = blocks[:, 4:8].to(torch.int32)  # [blocks, 4]: two groups' low 4 bits each
    ib = torch.arange(8)
    ls = ((low[:, ib // 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4)  # [blocks, 8]
    codes = _split_halves(blocks[:, 8:].reshape(-1, 16))  # [blocks * 8, 32]
    q = torch.tensor(IQ4_VALUES, dtype=torch.int8)[codes.long()]
    scale = d[:, None] * (ls - 32).float()  # an f16 times a 6-bit integer: exact in float32
    return {"q": q.reshape(rows, cols), "scale": scale.reshape(rows, cols // 32)}


def _scales_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs of a K-quant super-block from its 12 bytes (llama.cpp's
    get_scale_min_k4), as float32 [blocks, 8] each."""
    q = packed.to(torch.int32)
    sc_lo, m_lo = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc_hi = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    m_hi = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1).float(), torch.cat([m_lo, m_hi], 1).float()


def _split_halves(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0 / Q4_1's 16 bytes: values 0..15 in the low nibbles, 16..31 in the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)  # [blocks, 32]


def _int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, rows: int, cols: int) -> State:
    """codes uint8 [groups, 32] in 0..15 and one scale and zero per group -> an int4 state."""
    return {
        "nibbles": pack_nibbles(codes.reshape(rows, cols)),
        "scale": scale.reshape(rows, cols // 32),
        "zero": zero.reshape(rows, cols // 32),
    }


_DECODERS = {
    "Q8_0": _q8_0,
    "Q6_K": _q6_k,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_0": _q5_0,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
