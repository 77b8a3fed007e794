"""Launch the Triton MLA decode kernels (`kernels.py`) over B sequences' stored rows.

    context, lse = mla_decode(query, codec_c, codec_r, rows, lengths, index=None)

query [B, H, Lkv + R] float32 (q_abs | q_rope, softmax scale folded in), one new token per
sequence; rows[b] the stored rows of sequence b in one layer (`SequenceRows`: each part's codes
and scales exactly as the cache holds them, read in place); lengths [B] how many rows each
attends to (ragged); index [B, K] (DSA): sequence b attends to rows index[b, :lengths[b]] only.
Returns the latent context [B, H, Lkv] and each head's log-sum-exp [B, H] (so a caller can
merge it with attention over other rows, `latentkv.attention.consumers.merge`).

Rotated codecs (tq*, hq*): the query part is rotated once here and the context unrotated once;
the kernel works in the rotated basis. The context is split over `splits` programs per
(sequence, head block) and merged by log-sum-exp (`pick_splits`: enough programs to fill the
device). On CPU tensors the kernels run only under triton's interpreter (TRITON_INTERPRET=1 set
before triton is imported), which is how the tests run them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from latentkv.attention.triton import kernels
from latentkv.attention.triton.formats import PartFormat, part_format
from latentkv.kv.codecs import Codec

PRECISIONS = {"ieee": 0, "bf16": 1}  # float32 products, or bfloat16 operands on the tensor cores
BLOCK_H = 16  # heads per program: tl.dot needs at least 16 rows
BLOCK_T = 16  # rows per tile (16 and 8 warps: no register spills at GLM-5 widths on sm_90, `ahead.py`)
NUM_WARPS = 8
MIN_SPLIT_TILES = 4  # a split walks at least this many tiles
MAX_SPLITS = 64


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows of one layer as stored: codes [T, units] per part (each row contiguous;
    uint8 bytes, or for f32 rows a float32 view such as rows[:, :Lkv]) and float32 scales [T, S]
    (None when the codec keeps none)."""

    c_codes: torch.Tensor
    c_scales: torch.Tensor | None
    r_codes: torch.Tensor
    r_scales: torch.Tensor | None


def pick_splits(programs: int, rows: int, sms: int, block_t: int = BLOCK_T) -> int:
    """How many splits each of `programs` (sequence, head block) pairs gets: enough that every one
    of `sms` multiprocessors has a program, but no split shorter than MIN_SPLIT_TILES tiles of
    the longest sequence's `rows` (a split's fixed cost is one partial context to write and merge)."""
    if programs >= sms or rows <= 0:
        return 1
    want = -(-sms // programs)
    most = max(1, rows // (MIN_SPLIT_TILES * block_t))
    return max(1, min(want, most, MAX_SPLITS))


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the interpreter on CPU: 4, a small GPU's worth)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=128)
def _format(codec: Codec) -> PartFormat:
    return part_format(codec)


@functools.lru_cache(maxsize=128)
def _table(fmt: PartFormat, device: str) -> torch.Tensor:
    return fmt.table_tensor(torch.device(device))


def _address(t: torch.Tensor | None, fmt: PartFormat, what: str) -> tuple[int, int]:
    """(address of row 0, row stride in the part's unit) of codes, checked against the format."""
    if t is None:
        raise ValueError(f"{what}: no tensor")
    unit = fmt.unit_bytes
    if (
        t.dim() != 2
        or (t.shape[0] > 1 and t.stride(1) != 1)
        or t.shape[1] * t.element_size() != fmt.code_bytes
    ):
        raise ValueError(
            f"{what}: expected rows of {fmt.code_bytes} bytes each contiguous, got "
            f"{t.dtype} {tuple(t.shape)} strides {t.stride()}"
        )
    stride_bytes = t.stride(0) * t.element_size()
    if stride_bytes % unit or t.data_ptr() % unit:
        raise ValueError(f"{what}: rows must be aligned to {unit} bytes")
    return t.data_ptr(), stride_bytes // unit


def _scale_address(t: torch.Tensor | None, fmt: PartFormat, what: str) -> tuple[int, int]:
    if not fmt.scales:
        return 0, 0
    if t is None or t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != fmt.scales:
        raise ValueError(f"{what}: expected float32 scales [T, {fmt.scales}]")
    if t.shape[0] > 1 and t.stride(1) != 1:
        raise ValueError(f"{what}: each row's scales must be contiguous")
    return t.data_ptr(), t.stride(0)


def _tables(rows: Sequence[SequenceRows], fc: PartFormat, fr: PartFormat, device: torch.device):
    """The pointer table int64 [4, B] (c codes, c scales, r codes, r scales), the row strides
    (which must agree across the batch) and the alignment of every row of c and of r, in bytes
    (at most 16: a row then loads as 16-byte vectors)."""
    addresses, strides = [], set()
    for b, seq in enumerate(rows):
        c, c_stride = _address(seq.c_codes, fc, f"sequence {b} c codes")
        cs, cs_stride = _scale_address(seq.c_scales, fc, f"sequence {b} c scales")
        r, r_stride = _address(seq.r_codes, fr, f"sequence {b} r codes")
        rs, rs_stride = _scale_address(seq.r_scales, fr, f"sequence {b} r scales")
        addresses.append((c, cs, r, rs))
        if seq.c_codes.shape[0] > 1:  # a single row's stride is never used
            strides.add((c_stride, cs_stride, r_stride, rs_stride))
    if len(strides) > 1:
        raise ValueError(f"the sequences' row strides differ: {sorted(strides)}")
    stride = strides.pop() if strides else (c_stride, cs_stride, r_stride, rs_stride)
    align = [
        math.gcd(16, stride[part] * fmt.unit_bytes, *(a[part] for a in addresses))
        for part, fmt in ((0, fc), (2, fr))
    ]
    table = torch.tensor(addresses, dtype=torch.int64).T.contiguous().to(device)  # [4, B]
    return table, stride, align


def mla_decode(
    query: torch.Tensor,
    codec_c: Codec,
    codec_r: Codec,
    rows: Sequence[SequenceRows],
    lengths: torch.Tensor | Sequence[int],
    index: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    precision: str = "ieee",
    block_t: int = BLOCK_T,
    block_h: int = BLOCK_H,
    num_warps: int = NUM_WARPS,
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context [B, H, Lkv] and lse [B, H] of one decode token per sequence (module docstring)."""
    fc, fr = _format(codec_c), _format(codec_r)
    B, H, W = query.shape
    n_c = fc.width
    if n_c + fr.width != W or len(rows) != B:
        raise ValueError(f"query {tuple(query.shape)} for {len(rows)} sequences of rows {n_c} + {fr.width}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    device = query.device
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    if index is not None and (index.dim() != 2 or index.shape[0] != B):
        raise ValueError(f"index must be [B, K], got {tuple(index.shape)}")
    q = query.to(torch.float32)
    qc, qr = q[..., :n_c], q[..., n_c:]
    if fc.rotation is not None:
        qc = fc.rotation.rotate(qc)
    if fr.rotation is not None:
        qr = fr.rotation.rotate(qr)
    q = torch.cat([qc, qr], dim=-1).contiguous()  # [B, H, W]
    table, (c_stride, cs_stride, r_stride, rs_stride), (c_align, r_align) = _tables(rows, fc, fr, device)

    head_blocks = -(-H // block_h)
    if splits is None:
        longest = int(lengths.max()) if B else 0
        splits = pick_splits(head_blocks * B, longest, multiprocessors(device), block_t)
    out = torch.empty(B, H, n_c, dtype=torch.float32, device=device)
    lse = torch.empty(B, H, dtype=torch.float32, device=device)
    if splits == 1:  # the first kernel writes the result
        part, part_lse = out.unsqueeze(1), lse.unsqueeze(1)
    else:
        part = torch.empty(B, splits, H, n_c, dtype=torch.float32, device=device)
        part_lse = torch.empty(B, splits, H, dtype=torch.float32, device=device)
    gather = index is not None
    idx = index.to(device=device, dtype=torch.int32).contiguous() if gather else lengths
    kernels.mla_decode_split[(head_blocks, B, splits)](
        q, q.stride(0), q.stride(1),
        table[0], c_stride, table[1], cs_stride, _table(fc, str(device)), fc.gain,
        table[2], r_stride, table[3], rs_stride, _table(fr, str(device)), fr.gain,
        lengths, idx, idx.stride(0) if gather else 0,
        part, part.stride(0), part.stride(1), part.stride(2),
        part_lse, part_lse.stride(0), part_lse.stride(1),
        H, splits,
        CF=fc.constants(), RF=fr.constants(), C_ALIGN=c_align, R_ALIGN=r_align, BLOCK_H=block_h, BLOCK_T=block_t, GATHER=gather,
        DOT=PRECISIONS[precision], num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        kernels.mla_decode_merge[(head_blocks, B)](
            part, part.stride(0), part.stride(1), part.stride(2),
            part_lse, part_lse.stride(0), part_lse.stride(1),
            out, out.stride(0), out.stride(1), lse, lse.stride(0),
            H, splits, C_WIDTH=n_c, C_PADDED=fc.padded, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    if fc.rotation is not None:
        out = fc.rotation.unrotate(out)
    return out, lse


__all__ = ["PRECISIONS", "SequenceRows", "mla_decode", "multiprocessors", "pick_splits"]
