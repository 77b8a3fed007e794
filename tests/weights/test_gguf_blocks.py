"""GGUF blocks mapped onto int8 / int4: every code and scale kept.

Fresh random blocks (random bytes, finite f16 scales) of each exactly-mapped type go through
`exact_state` into our format; the format's `dequantize` must equal the `gguf` package's own
dequantization bit for bit, and a float64 decoder written here from llama.cpp's reference
(ggml-quants.c, dequantize_row_*) to within float32 rounding. The product of each weight is then
checked against x @ dequantize().T as the format's other tests do.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tests.weights.test_native import quantization_steps

from latentkv import native
from latentkv.weights.base import format_class
from latentkv.weights.gguf_blocks import BLOCKS, EXACT, IQ4_VALUES, exact_state, requantize_target

F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208], "Q5_0": [0]}
F16_FIELDS |= {"IQ4_NL": [0], "IQ4_XS": [0]}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    n, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, cols // n * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in F16_FIELDS[kind]:
        scales = (rng.standard_normal(blocks.shape[0]) * 10.0 ** rng.uniform(-4, 0, blocks.shape[0])).astype(
            np.float16
        )
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def _h(block: np.ndarray, at: int) -> float:
    return float(block[at : at + 2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def reference(kind: str, raw: np.ndarray) -> np.ndarray:
    """float64 values of `raw` (rows of blocks), block by block as ggml's dequantize_row_* does."""
    n, size = BLOCKS[kind]
    out = []
    for b in raw.reshape(-1, size):
        y = np.zeros(n)
        if kind == "Q8_0":
            y = _h(b, 0) * b[2:].view(np.int8).astype(np.float64)
        elif kind in ("Q4_0", "Q4_1", "IQ4_NL"):
            qs = b[4:] if kind == "Q4_1" else b[2:]
            d = _h(b, 0)
            for j in range(16):
                lo, hi = int(qs[j]) & 0xF, int(qs[j]) >> 4
                if kind == "Q4_0":
                    y[j], y[j + 16] = (lo - 8) * d, (hi - 8) * d
                elif kind == "Q4_1":
                    y[j], y[j + 16] = lo * d + _h(b, 2), hi * d + _h(b, 2)
                else:
                    y[j], y[j + 16] = d * IQ4_VALUES[lo], d * IQ4_VALUES[hi]
        elif kind == "Q5_0":
            d, qh, qs = _h(b, 0), int(b[2:6].view(np.uint32)[0]), b[6:]
            for j in range(16):
                y[j] = (((int(qs[j]) & 0xF) | (((qh >> j) & 1) << 4)) - 16) * d
                y[j + 16] = (((int(qs[j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16) * d
        elif kind == "Q4_K":
            d, dmin, scales, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:]
            for j in range(4):
                sc1, m1 = _scale_min_k4(2 * j, scales)
                sc2, m2 = _scale_min_k4(2 * j + 1, scales)
                for l in range(32):
                    q = int(qs[32 * j + l])
                    y[64 * j + l] = d * sc1 * (q & 0xF) - dmin * m1
                    y[64 * j + 32 + l] = d * sc2 * (q >> 4) - dmin * m2
        elif kind == "Q6_K":
            ql, qh, sc, d = b[:128], b[128:192], b[192:208].view(np.int8), _h(b, 208)
            for half in range(2):
                L, H, S = ql[64 * half :], qh[32 * half :], sc[8 * half :]
                for l in range(32):
                    s = l // 16
                    q1 = ((int(L[l]) & 0xF) | ((int(H[l]) & 3) << 4)) - 32
                    q2 = ((int(L[l + 32]) & 0xF) | (((int(H[l]) >> 2) & 3) << 4)) - 32
                    q3 = ((int(L[l]) >> 4) | (((int(H[l]) >> 4) & 3) << 4)) - 32
                    q4 = ((int(L[l + 32]) >> 4) | (((int(H[l]) >> 6) & 3) << 4)) - 32
                    base = 128 * half
                    y[base + l] = d * S[s] * q1
                    y[base + l + 32] = d * S[s + 2] * q2
                    y[base + l + 64] = d * S[s + 4] * q3
                    y[base + l + 96] = d * S[s + 6] * q4
        elif kind == "IQ4_XS":
            d, sh, sl, qs = _h(b, 0), int(b[2:4].view(np.uint16)[0]), b[4:8], b[8:]
            for ib in range(8):
                ls = ((int(sl[ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
                dl = d * (ls - 32)
                for j in range(16):
                    q = int(qs[16 * ib + j])
                    y[32 * ib + j], y[32 * ib + j + 16] = dl * IQ4_VALUES[q & 0xF], dl * IQ4_VALUES[q >> 4]
        out.append(y)
    return np.concatenate(out).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("kind", sorted(EXACT))
def test_each_exact_type_keeps_every_value(kind):
    import gguf

    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    n = BLOCKS[kind][0]
    rows, cols = 5, 2 * max(n, 256)
    raw = random_blocks(kind, rows, cols, rng)
    fmt, state = exact_state(kind, torch.from_numpy(raw), cols)
    assert (fmt, EXACT[kind][1]) == EXACT[kind]
    lin = format_class(fmt).from_state(state, cols)
    ours = lin.dequantize().numpy().astype(np.float64)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    ref = reference(kind, raw)
    if kind not in ("Q4_1", "Q4_K"):  # a code times a scale held exactly: one rounding, as gguf's
        assert np.array_equal(ours, theirs), f"seed {seed}"
        assert np.array_equal(ours, ref.astype(np.float32)), f"seed {seed}"
        return _check_product(lin, ref, cols, seed, fmt)
    # the asymmetric ones: codes exact, scale d * sc held to 2^-17 of itself (16 of its up to 17
    # significant bits), the zero 8 * scale - min rounded once to float32
    n, size = BLOCKS[kind]
    step = np.abs(reference_scales(kind, raw))  # [rows, groups of 32]
    bound = (2.0**-17 * 15 + 2.0**-23 * 24) * np.repeat(step, 32, axis=1) + 2.0**-23 * np.abs(ref)
    assert (np.abs(ours - ref) <= bound).all(), f"seed {seed}"
    assert np.abs(ours - theirs).max() <= bound.max(), f"seed {seed}"
    _check_product(lin, ref, cols, seed, fmt)


def reference_scales(kind: str, raw: np.ndarray) -> np.ndarray:
    """The float64 scale of each group of 32 (d, or d * sc), from the blocks."""
    n, size = BLOCKS[kind]
    out = []
    for b in raw.reshape(-1, size):
        if kind == "Q4_1":
            out.append([_h(b, 0)])
        else:
            out.append([_h(b, 0) * _scale_min_k4(j, b[4:16])[0] for j in range(8)])
    return np.array(out).reshape(raw.shape[0], -1)


def _check_product(lin, ref: np.ndarray, cols: int, seed: int, fmt: str) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, cols, generator=g)
    own = native.kernels()
    if fmt == "int4" and own is not None and own.isa4 == 4:  # latentkv's kernel on int8 x
        want, bound = x.double() @ torch.from_numpy(ref).T, _x8_bound(lin, x, ref)
        assert bool(((lin(x).double() - want).abs() <= bound).all()), f"seed {seed}"
        return
    # grouped int8 runs float32 tiles; int4 the op, which takes x in bfloat16 and returns bfloat16
    xr = x.double() if fmt == "int8" else x.to(torch.bfloat16).double()
    want = xr @ torch.from_numpy(ref).T
    tol = 1e-5 if fmt == "int8" else 8e-3
    assert float((lin(x).double() - want).abs().max() / want.abs().max()) < tol, f"seed {seed}"


def _x8_bound(lin, x: torch.Tensor, ref: np.ndarray) -> torch.Tensor:
    """|y - x @ W^T| for int4 on AVX-512 VNNI, x [M, K] quantized to int8 per group: each
    activation within 0.51 of its step (test_native) times what the codes' products multiply it
    by, scale * (q - 8) = W - zero (the zeros themselves meet float x), plus float32's roundings."""
    w = torch.from_numpy(ref)
    n, k = w.shape
    group = lin.group_size
    zero = lin.zero_t.T if lin.zero_t is not None else lin.scale_zeros[:, :n, 1].T  # [n, groups]
    mags = w.abs() + zero.double().abs().repeat_interleave(group, dim=1)[:, :k]
    steps = quantization_steps(x, group, -(-k // group) * group, 127)
    return (0.51 * steps) @ mags.T + 1e-5 * (x.double().abs() @ mags.T)


def test_the_reference_decoder_reads_what_the_gguf_package_writes():
    """The float64 decoder above against gguf's own quantizer, for the types it can encode."""
    import gguf

    rng = np.random.default_rng(random.randrange(2**31))
    w = rng.standard_normal((4, 256)).astype(np.float32)
    for kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        ref = reference(kind, raw)
        assert np.abs(ref - w).max() < 0.25 * np.abs(w).max()  # it is the matrix, quantized
        assert np.allclose(
            ref, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), rtol=0, atol=1e-6
        )


def test_types_without_an_exact_format_go_to_the_nearest_width():
    assert requantize_target("Q5_K") == requantize_target("Q5_1") == "int8"
    assert requantize_target("Q2_K") == requantize_target("IQ2_XXS") == requantize_target("Q3_K") == "int4"


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="Q8_0 rows of 64 values need 68 bytes"):
        exact_state("Q8_0", torch.zeros(2, 60, dtype=torch.uint8), 64)
