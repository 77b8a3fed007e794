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
    high, body = (
        (0, raw[2:]) if fmt == "q4_0" else (int.from_bytes(raw[2 : 2 + n // 8], "little"), raw[2 + n // 8 :])
    )
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
                [
                    ref_decode_block(fmt, raw[(r * 4 + b) * step : (r * 4 + b + 1) * step], block)
                    for b in range(4)
                ]
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
    signs = rot.signs(torch.float64, torch.device("cpu"))
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
    assert torch.all(codec.decode(codec.empty(2, device=torch.device("cpu"))) == 0)


def test_bytes_per_token_per_layer_match_llama_cpp():
    # fixture widths (c 128, r 32) and GLM-5 widths (c 512, r 64)
    expect = {"q8_0": (170, 612), "q5_0": (110, 396), "q4_0": (90, 324), "q4_1": (100, 360)}
    for name, (fixture, glm5) in expect.items():
        for prefix in ("", "h"):
            assert (
                get_codec(prefix + name, 128).bytes_per_row + get_codec(prefix + name, 32).bytes_per_row
                == fixture
            )
            assert (
                get_codec(prefix + name, 512).bytes_per_row + get_codec(prefix + name, 64).bytes_per_row
                == glm5
            )


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
            name: (
                (get_codec(name, 128).decode(get_codec(name, 128).encode(rows)) - rows).norm() / rows.norm()
            ).item()
            for name in (fmt, "h" + fmt)
        }
        assert err["h" + fmt] < 0.7 * err[fmt], err


# --- searched scales: q8s (q8_0's bytes), wq4 (q4_0's shape, non-uniform levels) --------------


def weighted_error(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per block of 32: sum x^2 (x_hat - x)^2, float64 [N, B]."""
    x = rows.double()
    return ((out.double() - x) * x).square().view(x.shape[0], -1, 32).sum(-1)


def test_q8s_is_read_by_the_q8_0_reference_and_beats_q8_0():
    rows = sample_rows(64, 128, seed=5)
    q8s, q8_0 = get_codec("q8s", 128), get_codec("q8_0", 128)
    enc = q8s.encode(rows)
    raw = enc.codes.numpy().tobytes()
    ref = np.concatenate([ref_decode_block("q8_0", raw[i * 34 : (i + 1) * 34], 32) for i in range(64 * 4)])
    out = q8s.decode(enc)
    torch.testing.assert_close(out.double().flatten(), torch.from_numpy(ref), rtol=1e-6, atol=0)
    ours, theirs = weighted_error(out, rows), weighted_error(q8_0.decode(q8_0.encode(rows)), rows)
    assert ours.sum() < 0.9 * theirs.sum()


def wq4_reference_decode(raw: bytes) -> np.ndarray:
    """float64 decode of one wq4 block: fp16 d, then value j in the low nibble of byte j (j < 16),
    value j + 16 in its high nibble; x_hat = level[code] d with the symmetric level table."""
    from latentkv.kv.codecs.blocks import WQ4_LEVELS

    table = [-v for v in reversed(WQ4_LEVELS)] + list(WQ4_LEVELS)
    d = _half16(raw[:2])
    codes = [b & 15 for b in raw[2:]] + [b >> 4 for b in raw[2:]]
    return np.array([table[c] * d for c in codes])


def test_wq4_decodes_as_the_reference_codes_are_nearest_and_beats_q4_0():
    rows = sample_rows(32, 64, seed=9)
    codec, q4_0 = get_codec("wq4", 64), get_codec("q4_0", 64)
    assert codec.bytes_per_row == q4_0.bytes_per_row == 36
    enc = codec.encode(rows)
    raw = enc.codes.numpy().tobytes()
    ref = np.concatenate([wq4_reference_decode(raw[i * 18 : (i + 1) * 18]) for i in range(32 * 2)])
    out = codec.decode(enc)
    torch.testing.assert_close(out.double().flatten(), torch.from_numpy(ref), rtol=1e-6, atol=0)
    # each value's code is the nearest level under its block's scale (zero blocks: scale 0)
    d = torch.tensor([_half16(raw[i * 18 : i * 18 + 2]) for i in range(64)], dtype=torch.float64)
    live = d != 0
    assert torch.equal(~live, (rows.view(-1, 32) == 0).all(-1))
    table = codec.table.double()
    u = rows.double().view(-1, 32)[live] / d[live, None]
    nearest = table[(u[..., None] - table).abs().argmin(-1)]
    torch.testing.assert_close(out.double().view(-1, 32)[live] / d[live, None], nearest, rtol=1e-6, atol=1e-9)
    ours, theirs = weighted_error(out, rows), weighted_error(q4_0.decode(q4_0.encode(rows)), rows)
    assert ours.sum() < 0.85 * theirs.sum()


@pytest.mark.parametrize("name", ["q8s", "q5s", "q4s", "wq4"])
def test_searched_codecs_inert_rows_and_refusals(name):
    codec = get_codec(name, 64)
    # a fixed draw: a 4-bit code's error on one random row of 64 reaches 0.3 of its norm now and
    # then (1 draw in 8 for wq4), so an unseeded one made this test fail at random
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    rows[0, 1] = float("nan")
    rows[1] = 0.0
    out = codec.decode(codec.encode(rows))
    assert torch.all(out[:2] == 0) and (out[2] - rows[2]).norm() < 0.2 * rows[2].norm()
    with pytest.raises(ValueError, match=f"{name} stores rows in blocks.*12 wide; use fp8"):
        get_codec(name, 12)


@pytest.mark.parametrize(("name", "ggml", "step"), [("q4s", "q4_0", 18), ("q5s", "q5_0", 22)])
def test_q4s_q5s_are_read_by_the_ggml_reference_and_beat_it(name, ggml, step):
    rows = sample_rows(64, 128, seed=13)
    ours_codec, base_codec = get_codec(name, 128), get_codec(ggml, 128)
    assert ours_codec.code_bytes == base_codec.code_bytes == 4 * step
    enc = ours_codec.encode(rows)
    raw = enc.codes.numpy().tobytes()
    ref = np.concatenate([ref_decode_block(ggml, raw[i * step : (i + 1) * step], 32) for i in range(64 * 4)])
    out = ours_codec.decode(enc)
    torch.testing.assert_close(out.double().flatten(), torch.from_numpy(ref), rtol=1e-6, atol=0)
    base = base_codec.decode(base_codec.encode(rows))
    assert weighted_error(out, rows).sum() < 0.95 * weighted_error(base, rows).sum()
    assert (out - rows).square().sum() < (base - rows).square().sum()
