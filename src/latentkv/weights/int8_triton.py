"""int8 weights on a CUDA device: decode products through a Triton dequantizing kernel.

torch has no CUDA kernel for `_weight_int8pack_mm` (its CPU op) and latentkv's own int8 kernels
are CPU code (`latentkv/native`), so an `Int8Linear` whose codes live on a GPU multiplies here:

    y[m, n] = sum_k x[m, k] * q[n, k] * s[n, k // G]      (per channel: s[n], one group)

Each program owns BLOCK_N output columns of BLOCK_M rows of x and walks the input in BLOCK_K
steps: the int8 codes are read once, widened to float32 in registers, scaled by their group's
scale (grouped) and multiplied with x; a per-channel scale multiplies the finished sums. Decode
is bandwidth-bound (a row of x against the whole matrix), so the point is reading each code
byte once; there is no tensor-core path, and prefill (many rows) takes dequantized tiles and
`F.linear` instead (`Int8Linear._tiled`).

Importing this module imports triton; `Int8Linear` imports it only for codes on a CUDA device.
The kernel is tested on the CPU under triton's interpreter (tests/weights/test_int8_triton.py)
against a float64 dequantize-then-multiply; it has not run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of x one program multiplies (more rows: more programs along the grid's second axis).
BLOCK_M = 4


@triton.jit
def _int8_gemv(
    x_ptr,
    q_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,  # 0: one scale per output row; else input columns per scale
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            q_ptr + rn[:, None] * stride_qn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
        )
        w = w.to(tl.float32)
        if GROUP > 0:
            s = tl.load(
                s_ptr + rn[:, None] * stride_sn + rk[None, :] // GROUP,
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = w * s.to(tl.float32)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if GROUP == 0:
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def int8_mm(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int | None
) -> torch.Tensor:
    """x [M, in_features] -> float32 [M, out]: x @ (q * scale)^T with q int8 [out, >= in]
    (zero columns past `in_features` are never read), scale [out] (per channel, any float
    dtype) or float32 [out, groups] (`group_size` columns each). Every tensor on one device."""
    x = x.float().contiguous()
    out_features = q.shape[0]
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return y
    block_n, block_k = 32, 64
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(x.shape[0], BLOCK_M))
    _int8_gemv[grid](
        x,
        q,
        scale,
        y,
        x.shape[0],
        out_features,
        in_features,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        y.stride(0),
        GROUP=group_size or 0,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y
