"""latentkv's int8/int4 decode kernels (weights/native), every vector path this CPU runs (AVX-512
VNNI, AVX-512, AVX2, plain C++), against slower references on fresh random inputs: float64 over
the format's dequantized matrix, torch's own op (bfloat16 x), and for the VNNI path a float64
product of x quantized to int16 exactly as the kernel defines it. Odd shapes (rows past a block,
columns past a group, odd widths), every group size, 1 to 17 rows of x, the residual add. The seed
is in every failure message. CI runs these a second time under ATEN_CPU_CAPABILITY=default,
where the process picks the plain C++ path itself."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from latentkv.weights import int4, make_linear, native

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(native.kernels() is None, reason=f"kernels not built here: {native.unavailable()}"),
]

PATHS = [isa for isa in (3, 2, 1, 0) if native.with_isa(isa) is not None]
# float32 x, float32 sums in another order: a few ulps of the largest output per 1000 terms
F32_TOL = 2e-5
# int16 x (VNNI path): half a step of 2^-15 of each group's largest activation per element
INT16_TOL = 2e-4
# against torch's op, which rounds x (and its output) to bfloat16
OP_TOL = 8e-3
ROWS = [1, 2, 3, 4, 5, 8, 17]


def _gen() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _x16(x: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """x [M, K] as the VNNI path reads it, in float64: per row and group of columns, the step
    max |x| / 32767 (float32), codes round(x * (32767 / max)) (float32 product, ties to even)."""
    M, K = x.shape
    xp = F.pad(x, (0, width - K)).view(M, -1, group)  # [M, groups, G]
    top = xp.abs().amax(-1, keepdim=True)  # float32
    inv = torch.where(top > 0, 32767.0 / top, torch.zeros_like(top))  # float32
    codes = (xp * inv).round().clamp(-32767, 32767)
    step = torch.where(top > 0, top / 32767.0, torch.zeros_like(top))
    return (codes.double() * step.double()).view(M, width)[:, :K]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 17), (96, 160), (257, 1000), (64, 2096)])
def test_int8_matches_float64_and_the_op(isa, n, k):
    kernels = native.with_isa(isa)
    g, seed = _gen()
    lin = make_linear(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g), "int8")
    w64 = lin.dequantize().double()
    for m in ROWS:
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
        residual = torch.randn(m, n, generator=g)
        y = kernels.int8_mm(x, lin.q, lin.scale)
        assert y.shape == (m, n) and y.dtype == torch.float32
        exact = x.double() @ w64.T
        assert _rel(y, exact) < (INT16_TOL if isa == 3 else F32_TOL), f"seed {seed} m {m}"
        if isa == 3:
            assert _rel(y, _x16(x, 256, -(-k // 256) * 256) @ w64.T) < F32_TOL, f"seed {seed} m {m}"
        assert torch.equal(kernels.int8_mm(x, lin.q, lin.scale, residual), residual + y), f"seed {seed}"
        if k % 16 == 0:  # torch's bf16 op reads past x otherwise (weights/int8.py)
            op = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), lin.q[:, :k].contiguous(), lin.scale
            )
            assert _rel(y, op.double()) < OP_TOL, f"seed {seed} m {m}"


def _int4_case(n: int, k: int, group: int, g: torch.Generator):
    """An int4 matrix packed for the kernel (rows padded to 64 with code 8, scale 1, zero 0) and
    its float64 dequantized matrix."""
    w = torch.randn(n, k, generator=g) + torch.randn(n, 1, generator=g)
    q, scale, zero = int4.quantize_int4(int4.pad_columns(w, group), group)
    w64 = int4.dequantize_int4(q, scale, zero).double()
    rows = -(-n // 64) * 64
    nibbles = F.pad(int4.pack_nibbles(q), (0, 0, 0, rows - n), value=0x88)
    sz = torch.stack([scale, zero], dim=-1)
    sz = torch.cat([sz, torch.tensor([1.0, 0.0], dtype=torch.bfloat16).expand(rows - n, sz.shape[1], 2)])
    return int4.pack_with(nibbles, int4.KERNEL_LAYOUT), sz.transpose(0, 1).contiguous(), w64


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (100, 70, 32), (130, 512, 256), (257, 1000, 128),
                                                (64, 127, 64), (320, 2048, 64)])  # fmt: skip
def test_int4_matches_float64_and_the_op(isa, n, k, group):
    kernels = native.with_isa(isa)
    g, seed = _gen()
    packed, sz, w64 = _int4_case(n, k, group, g)
    width = w64.shape[1]
    for m in ROWS:
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
        residual = torch.randn(m, n, generator=g)
        y = kernels.int4_mm(x, packed, sz, group, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        exact = x.double() @ w64[:, :k].T
        assert _rel(y, exact) < (INT16_TOL if isa == 3 else F32_TOL), f"seed {seed} m {m}"
        if isa == 3:
            assert _rel(y, _x16(x, group, width) @ w64[:, :k].T) < F32_TOL, f"seed {seed} m {m}"
        assert torch.equal(kernels.int4_mm(x, packed, sz, group, n, residual), residual + y), f"seed {seed}"
    if int4.same_layout(int4.op_layout(), int4.KERNEL_LAYOUT):  # the op reads the same bytes here
        xb = F.pad(x, (0, width - k)).to(torch.bfloat16)
        op = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group, sz)[:, :n]
        assert _rel(y, op.double()) < OP_TOL, f"seed {seed}"


@pytest.mark.parametrize("isa", PATHS)
def test_paths_agree_on_zero_and_extreme_rows(isa):
    """A row of zeros gives exact zeros (no division by a zero scale); a row with one huge
    activation is still within tolerance of float64."""
    kernels = native.with_isa(isa)
    g, seed = _gen()
    lin = make_linear(torch.randn(64, 512, generator=g), "int8")
    packed, sz, w64 = _int4_case(64, 512, 64, g)
    x = torch.zeros(3, 512)
    x[1] = torch.randn(512, generator=g)
    x[2, 7] = 1e4
    x[2, 100:] = torch.randn(412, generator=g) * 1e-3
    for y, ref in (
        (kernels.int8_mm(x, lin.q, lin.scale), x.double() @ lin.dequantize().double().T),
        (kernels.int4_mm(x, packed, sz, 64, 64), x.double() @ w64.T),
    ):
        assert torch.equal(y[0], torch.zeros(64)), f"seed {seed}"
        for r in (1, 2):
            assert _rel(y[r], ref[r]) < (INT16_TOL if isa == 3 else F32_TOL), f"seed {seed} row {r}"


def test_bad_arguments_are_refused_with_a_reason():
    kernels = native.kernels()
    q, scale = torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, dtype=torch.bfloat16)
    cases = [
        (lambda: kernels.int8_mm(torch.zeros(1, 65), q, scale), "more columns|K <="),
        (lambda: kernels.int8_mm(torch.zeros(1, 64, dtype=torch.float64), q, scale), "float32"),
        (lambda: kernels.int8_mm(torch.zeros(1, 64), q, scale.float()), "bfloat16"),
        (lambda: kernels.int8_mm(torch.zeros(2, 64), q, scale, torch.zeros(1, 32)), "residual"),
        (lambda: torch.ops.latentkv.int8_mm(torch.zeros(1, 64), q, scale, None, 9), "isa"),
        (
            lambda: kernels.int4_mm(
                torch.zeros(1, 64),
                torch.zeros(48, 32, dtype=torch.uint8),
                torch.zeros(1, 48, 2, dtype=torch.bfloat16),
                64,
                48,
            ),
            "multiple of 64",
        ),
        (
            lambda: kernels.int4_mm(
                torch.zeros(1, 64),
                torch.zeros(64, 32, dtype=torch.uint8),
                torch.zeros(2, 64, 2, dtype=torch.bfloat16),
                64,
                64,
            ),
            "scale_zeros",
        ),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_the_process_path_follows_torchs_capability():
    """The path is torch's capability (ATEN_CPU_CAPABILITY lowers both), where this CPU runs it."""
    best = native.isa_for(torch.backends.cpu.get_cpu_capability())
    assert native.kernels().isa == max(p for p in PATHS if p <= best)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=os.pathsep.join(sys.path))
    code = "from latentkv.weights import native; print(native.kernels().isa)"
    if 1 in PATHS:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "1", out.stderr


def test_no_compiler_means_torchs_ops_and_a_reason(monkeypatch):
    monkeypatch.setattr(native, "COMPILERS", ("no-such-c++-compiler",))
    with pytest.raises(OSError, match="no C\\+\\+ compiler"):
        native._build()
