"""Triton kernels of absorbed MLA decode over stored KV rows (flash-decoding, split-K).

For each sequence b, head h and its stored rows t (see `latentkv.models.mla` for the math):

    s[h, t] = q_c[h] . c_t * f_c(t) + q_r[h] . r_t * f_r(t)        (softmax scale folded into q)
    o[h]    = sum_t softmax(s[h])_t f_c(t) c_t                       [Lkv]

where c_t, r_t are the values one codec stored (read in place from their bytes, `_load_part`) and
f the per-row factor a codec keeps out of the dot product (fp8's scale, tq's radius / sqrt(n)).

Split-K: program (head block, b, split) walks rows [lo, hi) of its split, BLOCK_T rows a tile,
with the online softmax (running max m, normaliser l, accumulator acc), and writes its partial
context acc / l and log-sum-exp m + log l; `_merge` combines the splits of one (b, head block):

    o = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M),   M = max_s lse_s

With one split the first kernel writes the final context directly (the caller passes the output
as the partial buffer). Rows: sequence b's rows are read through a pointer table (the address of
its row 0 for each stored tensor), so B separately allocated caches are read in place, ragged
(`lengths[b]` rows each). With GATHER, tile position t reads row `index[b, t]` (DSA's top-k) and
`lengths[b]` counts the valid indices.

Precision (DOT): 0 multiplies in float32 ("ieee"); 1 feeds the tensor cores bfloat16 operands
(the query and the decoded values, or the probabilities) with float32 accumulation.

A part's format is a constexpr tuple (`formats.PartFormat.constants`):
    (KIND, WIDTH, PADDED, BITS, BLOCK, NB, BLOCK_BYTES, HEADER, HIGH, OFFSET, AFFINE, TABLE,
     SCALES, GROUP, CODE_BYTES)
"""

from __future__ import annotations

import triton
import triton.language as tl

# formats.F32, BF16, FP8, BLOCK, TQ
_F32: tl.constexpr = tl.constexpr(0)
_BF16: tl.constexpr = tl.constexpr(1)
_FP8: tl.constexpr = tl.constexpr(2)
_BLOCK: tl.constexpr = tl.constexpr(3)
_TQ: tl.constexpr = tl.constexpr(4)


@triton.jit
def _fp16(lo, hi):
    """Two bytes (little-endian) -> the fp16 they hold, as float32."""
    bits = lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(byte):
    """e4m3 "fn" bytes -> float32, with the codec's table: 0x7F and 0xFF (NaN) read as 0."""
    b = byte.to(tl.int32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man 2^-9
    value = tl.where((b & 128) != 0, -magnitude, magnitude)
    return tl.where((b & 127) == 127, 0.0, value)


@triton.jit
def _block_values(base, stride, rows, ok, table, F: tl.constexpr, ALIGN: tl.constexpr, BLOCK_T: tl.constexpr):
    """ggml-shaped blocks (fp16 d first) of rows [BLOCK_T] -> float32 [BLOCK_T, PADDED], d applied.

    8- and 4-bit blocks on 2-byte aligned rows (ALIGN even) are read as 16-bit words, each giving
    2 or 4 values (a quarter of the load instructions of reading bytes); q5's blocks and rows at
    odd addresses byte by byte."""
    WIDTH: tl.constexpr = F[1]
    PADDED: tl.constexpr = F[2]
    BITS: tl.constexpr = F[3]
    BLOCK: tl.constexpr = F[4]
    NB: tl.constexpr = F[5]
    OFFSET: tl.constexpr = F[9]
    AFFINE: tl.constexpr = F[10]
    TABLE: tl.constexpr = F[11]
    blk = tl.arange(0, NB)  # [NB]
    bmask = ok[:, None] & (blk[None, :] < WIDTH // BLOCK)  # [T, NB]
    if ALIGN % 2 == 0 and BITS != 5:
        code, d, m = _block_words(base, stride, rows, blk, bmask, F, BLOCK_T)
    else:
        code, d, m = _block_bytes(base, stride, rows, blk, bmask, F, BLOCK_T)
    if TABLE:  # noqa: SIM108  (a constexpr branch, compiled alone)
        level = tl.load(table + code)
    else:
        level = (code - OFFSET).to(tl.float32)
    values = level * d[:, :, None]
    if AFFINE:  # q4_1: + m
        values += m[:, :, None]
    return tl.reshape(values, (BLOCK_T, PADDED))


@triton.jit
def _block_words(base, stride, rows, blk, bmask, F: tl.constexpr, BLOCK_T: tl.constexpr):
    """(codes int32 [T, NB, BLOCK] in value order, d and m float32 [T, NB]) from 16-bit words."""
    BITS: tl.constexpr = F[3]
    BLOCK: tl.constexpr = F[4]
    NB: tl.constexpr = F[5]
    BLOCK_BYTES: tl.constexpr = F[6]
    HEADER: tl.constexpr = F[7]
    words = base.to(tl.pointer_type(tl.uint16))
    row = words + rows[:, None] * (stride // 2) + blk[None, :] * (BLOCK_BYTES // 2)  # [T, NB]
    d = tl.load(row, mask=bmask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    m = d * 0.0
    if HEADER == 4:  # q4_1's minimum, the word after d
        m = tl.load(row + 1, mask=bmask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    vmask = bmask[:, :, None]
    if BITS == 8:  # word w: values 2w (low byte) and 2w + 1 (high byte), int8
        w = tl.arange(0, BLOCK // 2)
        word = tl.load(row[:, :, None] + HEADER // 2 + w[None, None, :], mask=vmask, other=0).to(tl.int32)
        pair = tl.join(word & 255, word >> 8)  # [T, NB, BLOCK/2, 2]
        code = (tl.reshape(pair, (BLOCK_T, NB, BLOCK)) ^ 128) - 128  # signed bytes
    else:  # 4 bits: bytes 2w, 2w+1 hold values 2w | 2w+H and 2w+1 | 2w+1+H (H = BLOCK/2)
        w = tl.arange(0, BLOCK // 4)
        word = tl.load(row[:, :, None] + HEADER // 2 + w[None, None, :], mask=vmask, other=0).to(tl.int32)
        low = tl.reshape(tl.join(word & 15, (word >> 8) & 15), (BLOCK_T, NB, BLOCK // 2))  # values 0..H-1
        high = tl.reshape(tl.join((word >> 4) & 15, word >> 12), (BLOCK_T, NB, BLOCK // 2))  # H..BLOCK-1
        code = tl.reshape(tl.permute(tl.join(low, high), (0, 1, 3, 2)), (BLOCK_T, NB, BLOCK))
    return code, d, m


@triton.jit
def _block_bytes(base, stride, rows, blk, bmask, F: tl.constexpr, BLOCK_T: tl.constexpr):
    """(codes int32 [T, NB, BLOCK] in value order, d and m float32 [T, NB]) byte by byte."""
    BITS: tl.constexpr = F[3]
    BLOCK: tl.constexpr = F[4]
    BLOCK_BYTES: tl.constexpr = F[6]
    HEADER: tl.constexpr = F[7]
    HIGH: tl.constexpr = F[8]
    i = tl.arange(0, BLOCK)  # [BLOCK] value within its block
    row = base + rows[:, None] * stride + blk[None, :] * BLOCK_BYTES  # [T, NB] block starts
    d = _fp16(tl.load(row, mask=bmask, other=0), tl.load(row + 1, mask=bmask, other=0))  # [T, NB]
    m = d * 0.0
    if HEADER == 4:  # q4_1's minimum, the fp16 after d
        m = _fp16(tl.load(row + 2, mask=bmask, other=0), tl.load(row + 3, mask=bmask, other=0))
    at = row[:, :, None]  # [T, NB, 1]
    vmask = bmask[:, :, None]
    if BITS == 8:
        byte = tl.load(at + HEADER + i[None, None, :], mask=vmask, other=0)  # [T, NB, BLOCK]
        code = byte.to(tl.int8, bitcast=True).to(tl.int32)
    else:
        HALF: tl.constexpr = BLOCK // 2
        byte = tl.load(at + HEADER + HIGH + (i % HALF)[None, None, :], mask=vmask, other=0).to(tl.int32)
        code = tl.where((i < HALF)[None, None, :], byte & 15, byte >> 4)
        if BITS == 5:  # the fifth bits: bit i of the little-endian field
            field = tl.load(at + HEADER + (i // 8)[None, None, :], mask=vmask, other=0).to(tl.int32)
            code = code | (((field >> (i % 8)[None, None, :]) & 1) << 4)
    return code, d, m


@triton.jit
def _load_part(
    code_addr,
    stride,
    scale_addr,
    scale_stride,
    rows,
    ok,
    table,
    gain,
    F: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The stored values of rows [BLOCK_T] of one part -> (values float32 [BLOCK_T, PADDED], zero
    past WIDTH and on rows not ok; the per-row factor float32 [BLOCK_T]). `stride`: a row's step
    in the part's unit (floats, 16-bit words or bytes); `scale_stride` in floats. ALIGN: what every
    row's address is a multiple of (16 lets a row's values load as 16-byte vectors)."""
    KIND: tl.constexpr = F[0]
    WIDTH: tl.constexpr = F[1]
    PADDED: tl.constexpr = F[2]
    BITS: tl.constexpr = F[3]
    SCALES: tl.constexpr = F[12]
    GROUP: tl.constexpr = F[13]
    CODE_BYTES: tl.constexpr = F[14]
    j = tl.arange(0, PADDED)
    if WIDTH == PADDED:  # no column mask: a row's values load as wide vectors
        mask = tl.broadcast_to(ok[:, None], (BLOCK_T, PADDED))
    else:
        mask = ok[:, None] & (j < WIDTH)[None, :]
    if KIND == _F32:
        base = tl.multiple_of(code_addr.to(tl.pointer_type(tl.float32)), ALIGN)
        values = tl.load(base + rows[:, None] * stride + j[None, :], mask=mask, other=0.0)
    elif KIND == _BF16:
        base = tl.multiple_of(code_addr.to(tl.pointer_type(tl.uint16)), ALIGN)
        half = tl.load(base + rows[:, None] * stride + j[None, :], mask=mask, other=0)
        values = (half.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif KIND == _FP8:
        base = tl.multiple_of(code_addr.to(tl.pointer_type(tl.uint8)), ALIGN)
        values = _e4m3(tl.load(base + rows[:, None] * stride + j[None, :], mask=mask, other=0))
    elif KIND == _BLOCK:
        values = _block_values(
            code_addr.to(tl.pointer_type(tl.uint8)), stride, rows, ok, table, F, ALIGN, BLOCK_T
        )
    elif BITS == 4 and ALIGN % 4 == 0 and WIDTH == PADDED:  # TQ, 4 bits: 32-bit words of 8 codes
        base = tl.multiple_of(code_addr.to(tl.pointer_type(tl.uint32)), ALIGN)
        k = tl.arange(0, PADDED // 8)
        word = tl.load(base + rows[:, None] * (stride // 4) + k[None, :], mask=ok[:, None], other=0)
        code = tl.reshape(_nibbles_in_order(word), (BLOCK_T, PADDED))  # value 8k + i: nibble i
        values = tl.where(mask, tl.load(table + code), 0.0)
    else:  # TQ: BITS-bit codes, value j at bit j * BITS of the row, LSB first
        base = tl.multiple_of(code_addr.to(tl.pointer_type(tl.uint8)), ALIGN) + rows[:, None] * stride
        bit = j * BITS
        word = tl.load(base + (bit >> 3)[None, :], mask=mask, other=0).to(tl.int32)
        if 8 % BITS != 0:  # a code may continue into the next byte
            nxt = mask & ((bit >> 3) + 1 < CODE_BYTES)[None, :]
            word = word | (tl.load(base + ((bit >> 3) + 1)[None, :], mask=nxt, other=0).to(tl.int32) << 8)
        code = (word >> (bit & 7)[None, :]) & ((1 << BITS) - 1)
        values = tl.where(mask, tl.load(table + code), 0.0)
    factor = tl.full((BLOCK_T,), 1.0, tl.float32)
    if SCALES == 1:  # one scale per row: kept out of the dot product
        scale_ptr = scale_addr.to(tl.pointer_type(tl.float32))
        factor = tl.load(scale_ptr + rows * scale_stride, mask=ok, other=0.0) * gain
    elif SCALES > 1:  # one per group: folded into the values
        scale_ptr = scale_addr.to(tl.pointer_type(tl.float32))
        g = tl.load(scale_ptr + rows[:, None] * scale_stride + (j // GROUP)[None, :], mask=mask, other=0.0)
        values = values * (g * gain)
    return values, factor


@triton.jit
def _nibbles_in_order(word):
    """uint32 words [T, K] -> int32 [T, K, 8]: nibble i of word k (LSB first) at [.., k, i]. Each
    join appends an axis, so the nibbles are joined in bit-reversed order to land in place."""
    w = word.to(tl.int32)
    v0, v1, v2, v3 = w & 15, (w >> 4) & 15, (w >> 8) & 15, (w >> 12) & 15
    v4, v5, v6, v7 = (w >> 16) & 15, (w >> 20) & 15, (w >> 24) & 15, (w >> 28) & 15
    return tl.reshape(
        tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7))),
        (w.shape[0], w.shape[1], 8),
    )


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == 1:  # noqa: SIM108  (a constexpr branch, compiled alone)
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def mla_decode_split(
    q_ptr,
    stride_qb,
    stride_qh,
    c_codes,
    c_stride,
    c_scales,
    c_scale_stride,
    c_table,
    c_gain,
    r_codes,
    r_stride,
    r_scales,
    r_scale_stride,
    r_table,
    r_gain,
    lengths,
    index,
    stride_ib,
    out_ptr,
    stride_ob,
    stride_os,
    stride_oh,
    lse_ptr,
    stride_lb,
    stride_ls,
    H,
    splits,
    CF: tl.constexpr,
    RF: tl.constexpr,
    C_ALIGN: tl.constexpr,
    R_ALIGN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GATHER: tl.constexpr,
    DOT: tl.constexpr,
):
    """One (head block, sequence, split): partial context [BLOCK_H, Lkv] and lse [BLOCK_H]."""
    hb = tl.program_id(0)  # head blocks fastest: the programs reading the same rows run together
    b = tl.program_id(1)
    s = tl.program_id(2)
    C_WIDTH: tl.constexpr = CF[1]
    C_PADDED: tl.constexpr = CF[2]
    R_WIDTH: tl.constexpr = RF[1]
    R_PADDED: tl.constexpr = RF[2]
    length = tl.load(lengths + b)
    per = tl.cdiv(length, splits)
    lo = s * per
    hi = tl.minimum(lo + per, length)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    jc = tl.arange(0, C_PADDED)
    jr = tl.arange(0, R_PADDED)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    qc = tl.load(q_row + jc[None, :], mask=hmask[:, None] & (jc < C_WIDTH)[None, :], other=0.0)
    qr = tl.load(q_row + C_WIDTH + jr[None, :], mask=hmask[:, None] & (jr < R_WIDTH)[None, :], other=0.0)
    if DOT == 1:  # the query's operands once, not per tile
        qc = qc.to(tl.bfloat16)
        qr = qr.to(tl.bfloat16)
    c_code = tl.load(c_codes + b)  # addresses of sequence b's row 0 (int64)
    c_scale = tl.load(c_scales + b)
    r_code = tl.load(r_codes + b)
    r_scale = tl.load(r_scales + b)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, C_PADDED), tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = t < hi
        if GATHER:  # noqa: SIM108  (a constexpr branch, compiled alone)
            rows = tl.load(index + b * stride_ib + t, mask=ok, other=0).to(tl.int64)
        else:
            rows = t.to(tl.int64)
        vc, fc = _load_part(
            c_code, c_stride, c_scale, c_scale_stride, rows, ok, c_table, c_gain, CF, C_ALIGN, BLOCK_T
        )  # [T, Cp], [T]
        vr, fr = _load_part(
            r_code, r_stride, r_scale, r_scale_stride, rows, ok, r_table, r_gain, RF, R_ALIGN, BLOCK_T
        )
        scores = _dot(qc, tl.trans(vc), DOT) * fc[None, :] + _dot(qr, tl.trans(vr), DOT) * fr[None, :]
        scores = tl.where(ok[None, :], scores, float("-inf"))  # [BLOCK_H, T]
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every tile has a row in range
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p * fc[None, :], vc, DOT)
        m = m_new

    filled = l > 0
    out = tl.where(filled[:, None], acc / tl.where(filled, l, 1.0)[:, None], 0.0)
    o_ptr = out_ptr + b * stride_ob + s * stride_os + heads[:, None] * stride_oh + jc[None, :]
    tl.store(o_ptr, out, mask=hmask[:, None] & (jc < C_WIDTH)[None, :])
    lse = tl.where(filled, m + tl.log(tl.where(filled, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + s * stride_ls + heads, lse, mask=hmask)


@triton.jit
def mla_decode_merge(
    part_ptr,
    stride_pb,
    stride_ps,
    stride_ph,
    part_lse,
    stride_lb,
    stride_ls,
    out_ptr,
    stride_ob,
    stride_oh,
    lse_ptr,
    stride_eb,
    H,
    splits,
    C_WIDTH: tl.constexpr,
    C_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The splits of one (head block, sequence) -> context [BLOCK_H, Lkv] and its lse."""
    hb = tl.program_id(0)
    b = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    jc = tl.arange(0, C_PADDED)
    mask = hmask[:, None] & (jc < C_WIDTH)[None, :]
    best = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for s in range(0, splits):
        lse = tl.load(part_lse + b * stride_lb + s * stride_ls + heads, mask=hmask, other=float("-inf"))
        best = tl.maximum(best, lse)
    base = tl.where(best == float("-inf"), 0.0, best)  # no row at all: every weight 0
    num = tl.zeros((BLOCK_H, C_PADDED), tl.float32)
    den = tl.zeros((BLOCK_H,), tl.float32)
    for s in range(0, splits):
        lse = tl.load(part_lse + b * stride_lb + s * stride_ls + heads, mask=hmask, other=float("-inf"))
        w = tl.exp(lse - base)  # 0 for an empty split (lse -inf)
        part = tl.load(
            part_ptr + b * stride_pb + s * stride_ps + heads[:, None] * stride_ph + jc[None, :],
            mask=mask,
            other=0.0,
        )
        num += w[:, None] * part
        den += w
    filled = den > 0
    out = tl.where(filled[:, None], num / tl.where(filled, den, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + jc[None, :], out, mask=mask)
    total = tl.where(filled, base + tl.log(tl.where(filled, den, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_eb + heads, total, mask=hmask)
