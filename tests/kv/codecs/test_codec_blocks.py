"""llama.cpp's block formats (q8_0, q5_0, q4_0, q4_1) and the rotated hq* variants.

The reference below is written from ggml's reference quantizers (quantize_row_q*_ref), one
block at a time with numpy float32 scalars and struct-packed bytes, independently of the codec's
vectorised torch code: the bytes must agree exactly. A float64 check bounds the error of every
decoded value by what each format's levels allow.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from latentkv.kv.codecs import get_codec
from latentkv.kv.codecs.rotation import Rotation

PLAIN = ["q8_0", "q5_0", "q4_0", "q4_1"]
ROTATED = [f"h{n}" for n in PLAIN]
F = np.float32


def _fp16(v: float) -> bytes:
    return struct.pack("<e", float(v))


def _half16(b: bytes) -> float:
    return struct.unpack("<e", b)[0]


def ref_block(fmt: str, x: np.ndarray) -> bytes:
    """One block of float32 values -> ggml's bytes for it."""
    n = len(x)
    if fmt == "q8_0":
        d = F(max(abs(float(v)) for v in x)) / F(127)
        inv = F(1) / d if d else F(0)
        q = []
        for v in x:
            t = float(F(v) * inv)
            q.append(int(np.sign(t) * np.floor(abs(t) + 0.5)))
        return _fp16(d) + struct.pack(f"<{n}b", *q)
    if fmt == "q4_1":
        lo, hi = F(min(x)), F(max(x))
        d = (hi - lo) / F(15)
        inv = F(1) / d if d else F(0)
        q = [min(15, int((F(v) - lo) * inv + F(0.5))) for v in x]
        return _fp16(d) + _fp16(lo) + _nibbles(q)
    offset = 8 if fmt == "q4_0" else 16
    top, amax = F(0), F(0)
    for v in x:  # the first value of the largest magnitude, with its sign
        if amax < abs(F(v)):
            amax, top = abs(F(v)), F(v)
    d = top / F(-offset)
    inv = F(1) / d if d else F(0)
    q = [min(2 * offset - 1, int(F(v) * inv + F(offset + 0.5))) for v in x]
    if fmt == "q4_0":
        return _fp16(d) + _nibbles(q)
    high = sum(((v >> 4) & 1) << j for j, v in enumerate(q))
    return _fp16(d) + high.to_bytes(n // 8, "little") + _nibbles(q)


def _nibbles(q: list[int]) -> bytes:
    half = len(q) // 2
    return bytes((q[j] & 15) | ((q[j + half] & 15) << 4) for j in range(half))


def ref_decode_block(fmt: str, raw: bytes, n: int) -> np.ndarray:
    """ggml's dequantize_row_q*, float64."""
    d = _half16(raw[:2])
    if fmt == "q8_0":
        return np.array(struct.unpack(f"<{n}b", raw[2:]), dtype=np.float64) * d
    if fmt == "q4_1":
        m, body = _half16(raw[2:4]), raw[4:]
        q = [b & 15 for b in body] + [b >> 4 for b in body]
        return np.array(q, dtype=np.float64) * d + m
    high, body = (0, raw[2:]) if fmt == "q4_0" else (int.from_bytes(raw[2 : 2 + n // 8], "little"), raw[2 + n // 8 :])
    q = [b & 15 for b in body] + [b >> 4 for b in body]
    offset = 8 if fmt == "q4_0" else 16
    q = [v | (((high >> j) & 1) << 4) for j, v in enumerate(q)]
    return (np.array(q, dtype=np.float64) - offset) * d


def ref_encode(fmt: str, rows: torch.Tensor, block: int) -> bytes:
    out = b""
    for row in rows.numpy():
        for start in range(0, len(row), block):
            out += ref_block(fmt, row[start : start + block])
    return out


def sample_rows(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, width, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))
    rows[0, 3] = 40.0  # an outlier channel
    rows[1] = 0.0  # a zero row
    rows[2, :8] = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, 1.0, -1.0, 0.0])  # ties of magnitude
    return rows


@pytest.mark.parametrize("fmt", PLAIN)
@pytest.mark.parametrize(("width", "block"), [(32, 32), (128, 32), (64, 32), (8, 8), (48, 16)])
def test_bytes_equal_ggml_reference(fmt, width, block):
    codec = get_codec(fmt, width)
    assert codec.block == block and codec.params()["block"] == block
    rows = sample_rows(6, width, seed=width)
    enc = codec.encode(rows)
    assert enc.scales.shape == (6, 0) and codec.scale_count == 0
    assert enc.codes.numpy().tobytes() == ref_encode(fmt, rows, block)


@pytest.mark.parametrize("fmt", PLAIN)
def test_decode_equals_ggml_dequantize_and_bounds_the_error(fmt):
    width, block = 128, 32
    codec = get_codec(fmt, width)
    rows = sample_rows(8, width, seed=7)
    enc = codec.encode(rows)
    out = codec.decode(enc).double()
    raw = enc.codes.numpy().tobytes()
    step = codec.block_bytes
    ref = np.stack(
        [
            np.concatenate(
                [ref_decode_block(fmt, raw[(r * 4 + b) * step : (r * 4 + b + 1) * step], block) for b in range(4)]
            )
            for r in range(8)
        ]
    )
    torch.testing.assert_close(out, torch.from_numpy(ref), rtol=1e-6, atol=0)
    # float64 error bound per block: half a level (q8_0, q4_1 up to its fp16 minimum), one level on
    # the clipped side of q4_0 / q5_0, plus the fp16 rounding of the scale over the whole range
    x = rows.double().view(8, 4, block)
    amax = x.abs().amax(dim=-1, keepdim=True)
    levels = {"q8_0": 127, "q5_0": 16, "q4_0": 8, "q4_1": 7.5}[fmt]
    slack = {"q8_0": 0.5, "q5_0": 1.0, "q4_0": 1.0, "q4_1": 0.5}[fmt]
    bound = amax / levels * (slack + 2e-3 * levels) + 1e-6
    assert torch.all((out.view(8, 4, block) - x).abs() <= bound)


@pytest.mark.parametrize("fmt", PLAIN)
def test_rotated_variant_is_the_block_format_of_the_rotated_row(fmt):
    width = 64
    rows = sample_rows(5, width, seed=3)
    hq, plain = get_codec("h" + fmt, width, seed=11), get_codec(fmt, width)
    rot = Rotation(width, 11)
    assert torch.equal(hq.encode(rows).codes, plain.encode(rot.rotate(rows)).codes)
    assert hq.params()["rotation_seed"] == 11 and hq.params()["name"] == "h" + fmt
    # decode unrotates: a float64 reference rotation (H D as a dense matrix) gives the same rows
    h = torch.tensor([[1.0]], dtype=torch.float64)
    while h.shape[0] < width:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)]) / 2**0.5
    signs = rot.signs(torch.float64)
    values = plain.decode(plain.encode(rot.rotate(rows))).double()
    expected = (values @ h.T) * signs  # R^T y = D H y (H symmetric)
    torch.testing.assert_close(hq.decode(hq.encode(rows)).double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", PLAIN + ROTATED)
def test_non_finite_and_zero_rows_are_inert(name):
    codec = get_codec(name, 64)
    rows = torch.randn(4, 64)
    rows[0, 5] = float("nan")
    rows[1, 40] = float("inf")
    rows[2] = 0.0
    out = codec.decode(codec.encode(rows))
    assert torch.isfinite(out).all() and torch.all(out[:3] == 0)  # a NaN or inf anywhere: the whole row
    assert (out[3] - rows[3]).norm() < 0.2 * rows[3].norm()  # the finite row is kept
    assert torch.all(codec.decode(codec.empty(2)) == 0)


def test_bytes_per_token_per_layer_match_llama_cpp():
    # fixture widths (c 128, r 32) and GLM-5 widths (c 512, r 64)
    expect = {"q8_0": (170, 612), "q5_0": (110, 396), "q4_0": (90, 324), "q4_1": (100, 360)}
    for name, (fixture, glm5) in expect.items():
        for prefix in ("", "h"):
            assert get_codec(prefix + name, 128).bytes_per_row + get_codec(prefix + name, 32).bytes_per_row == fixture
            assert get_codec(prefix + name, 512).bytes_per_row + get_codec(prefix + name, 64).bytes_per_row == glm5


@pytest.mark.parametrize("name", PLAIN)
def test_widths_without_whole_blocks_are_refused(name):
    with pytest.raises(ValueError, match=f"{name} stores rows in blocks of 32.*12 wide; use fp8"):
        get_codec(name, 12)
    with pytest.raises(ValueError, match=f"h{name} needs power-of-two row widths"):
        get_codec("h" + name, 96)
    with pytest.raises(ValueError, match="group size"):
        get_codec(name, 64, group_size=16)


def test_rotation_lowers_the_error_of_rows_with_an_outlier_channel():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(256, 128, generator=g)
    rows[:, 7] *= 30.0  # one channel far larger than the rest, as trained latents have
    for fmt in PLAIN:
        err = {
            name: ((get_codec(name, 128).decode(get_codec(name, 128).encode(rows)) - rows).norm() / rows.norm()).item()
            for name in (fmt, "h" + fmt)
        }
        assert err["h" + fmt] < 0.7 * err[fmt], err


# --- searched scales: q8s (q8_0's bytes), nq4 / nq5 (non-uniform levels, 8-bit scales) ---------


def test_q8s_is_read_by_the_q8_0_reference_and_beats_q8_0():
    rows = sample_rows(64, 128, seed=5)
    q8s, q8_0 = get_codec("q8s", 128), get_codec("q8_0", 128)
    enc = q8s.encode(rows)
    raw = enc.codes.numpy().tobytes()
    ref = np.concatenate([ref_decode_block("q8_0", raw[i * 34 : (i + 1) * 34], 32) for i in range(64 * 4)])
    torch.testing.assert_close(q8s.decode(enc).double().flatten(), torch.from_numpy(ref), rtol=1e-6, atol=0)
    err = {c.name: (c.decode(c.encode(rows)) - rows).double().square().view(64, 4, 32).sum(-1) for c in (q8s, q8_0)}
    assert torch.all(err["q8s"] <= err["q8_0"] * (1 + 1e-6) + 1e-12)  # q8_0's own scale is among the trials
    assert err["q8s"].sum() < 0.95 * err["q8_0"].sum()


def nq_reference_decode(raw: bytes, bits: int, block: int, levels: tuple[float, ...]) -> np.ndarray:
    """float64 decode of nq bytes: d = 2^((k - 128) / 8), value = level[code] d."""
    table = [-v for v in reversed(levels)] + list(levels)
    k, rest = raw[0], raw[1:]
    high = 0
    if bits == 5:
        high, rest = int.from_bytes(rest[: block // 8], "little"), rest[block // 8 :]
    codes = [b & 15 for b in rest] + [b >> 4 for b in rest]
    codes = [c | (((high >> j) & 1) << 4) for j, c in enumerate(codes)]
    d = 0.0 if k == 0 else 2.0 ** ((k - 128) / 8)
    return np.array([table[c] * d for c in codes])


@pytest.mark.parametrize("bits", [4, 5])
def test_nq_decodes_as_the_reference_and_beats_the_ggml_format_of_its_bytes(bits):
    from latentkv.kv.codecs.blocks import NQ_LEVELS

    width = 64
    codec = get_codec(f"nq{bits}", width)
    assert codec.block == 16 and codec.block_bytes == (9 if bits == 4 else 11)
    rows = sample_rows(32, width, seed=bits)
    enc = codec.encode(rows)
    raw = enc.codes.numpy().tobytes()
    step = codec.block_bytes
    ref = np.concatenate(
        [nq_reference_decode(raw[i * step : (i + 1) * step], bits, 16, NQ_LEVELS[bits]) for i in range(32 * 4)]
    )
    out = codec.decode(enc).double()
    torch.testing.assert_close(out.flatten(), torch.from_numpy(ref), rtol=1e-6, atol=1e-30)
    ggml = get_codec("q4_0" if bits == 4 else "q5_0", width)
    assert ggml.bytes_per_row == codec.bytes_per_row  # the same bytes ...
    x = rows.double()
    ours = (out - x).square().sum()
    theirs = (ggml.decode(ggml.encode(rows)).double() - x).square().sum()
    assert ours < 0.9 * theirs  # ... and less squared error
    # every code is the nearest level under the block's chosen scale
    k = torch.tensor([raw[i * step] for i in range(32 * 4)])
    zero = k == 0  # scale 0: exactly the all-zero blocks (row 1)
    assert torch.equal(zero, (x.view(-1, 16) == 0).all(-1)) and torch.all(out.view(-1, 16)[zero] == 0)
    d = torch.exp2((k[~zero].double() - 128) / 8)
    table = codec.table.double()
    u = x.view(-1, 16)[~zero] / d[:, None]
    nearest = table[(u[..., None] - table).abs().argmin(-1)]
    torch.testing.assert_close(out.view(-1, 16)[~zero] / d[:, None], nearest, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["q8s", "nq4", "nq5"])
def test_searched_codecs_inert_rows_and_refusals(name):
    codec = get_codec(name, 64)
    rows = torch.randn(3, 64)
    rows[0, 1] = float("nan")
    rows[1] = 0.0
    out = codec.decode(codec.encode(rows))
    assert torch.all(out[:2] == 0) and (out[2] - rows[2]).norm() < 0.15 * rows[2].norm()
    with pytest.raises(ValueError, match=f"{name} stores rows in blocks.*12 wide; use fp8"):
        get_codec(name, 12)
