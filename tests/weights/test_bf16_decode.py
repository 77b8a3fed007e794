"""bf16 weights at one row (decode): `torch.mv` against float64 over the stored matrix, the
one-row and many-row paths against each other, the per-head products, and the same one-row
products under torch's AVX2 and plain C++ kernels (what a CPU without AVX-512 runs). Inputs are
fresh random draws each run; the seed is in every failure message."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from latentkv import native
from latentkv.weights import bf16, describe, make_linear
from latentkv.weights.bf16 import gemv_one_row
from latentkv.weights.heads import HeadLinears

# x is rounded to bfloat16 in the reference too: what is left is the output's rounding to
# bfloat16 (2^-9 relative to the largest output, after a float32 sum) and the order of the sum.
TOL = 8e-3


def _gen() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def _ref(x: torch.Tensor, lin) -> torch.Tensor:
    """float64 x (rounded to bfloat16, as the kernel reads it) @ the stored matrix^T."""
    return x.to(torch.bfloat16).double() @ lin.dequantize().double().T


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])  # leading axes of one row are kept
@pytest.mark.parametrize("width", [24, 1000, 2048])
def test_one_row_matches_float64(shape, width):
    g, seed = _gen()
    lin = make_linear(torch.randn(384, width, generator=g), "bf16")
    x = torch.randn(*shape, width, generator=g)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (*shape, 384)
    assert _rel_err(y, _ref(x, lin)) < TOL, f"seed {seed}"
    residual = torch.randn(*shape, 384, generator=g)
    want = residual.double() + _ref(x, lin)
    assert _rel_err(lin.add_to(residual, x), want) < TOL, f"seed {seed}"
    assert torch.equal(lin.add_to(None, x), y)


@pytest.mark.parametrize("native_kernel", [True, False])
def test_one_row_is_the_kernel_or_torch_mv_and_more_rows_are_f_linear(native_kernel, monkeypatch):
    """Paths compared within one run: one row of a matrix up to NATIVE_MAX_BYTES is exactly
    latentkv's bf16_mm (residual included), of a bigger one exactly torch.mv on the stored matrix
    (F.linear where this CPU lacks native bf16); two rows exactly F.linear (unchanged); all
    agree within the output's bfloat16 rounding."""
    if native_kernel and native.kernels() is None:
        pytest.skip(f"latentkv's kernels are not built here: {native.unavailable()}")
    if not native_kernel:
        monkeypatch.setattr(bf16, "NATIVE_MAX_BYTES", 0)
    g, seed = _gen()
    lin = make_linear(torch.randn(512, 768, generator=g), "bf16")
    x = torch.randn(2, 768, generator=g)
    xb = x.to(torch.bfloat16)
    one = lin(x[:1])
    residual = torch.randn(1, 512, generator=g)
    if native_kernel:
        assert torch.equal(one, native.kernels().bf16_mm(x[:1], lin.weight))
        assert torch.equal(lin.add_to(residual, x[:1]), native.kernels().bf16_mm(x[:1], lin.weight, residual))
    else:
        want = torch.mv(lin.weight, xb[0]) if gemv_one_row() else F.linear(xb[:1], lin.weight)[0]
        assert torch.equal(one[0], want.float())
    assert torch.equal(lin(x), F.linear(xb, lin.weight).float())
    assert _rel_err(one, lin(x)[:1].double()) < TOL, f"seed {seed}"
    assert _rel_err(lin(x), _ref(x, lin)) < TOL, f"seed {seed}"


def test_a_transposed_matrix_keeps_f_linear():
    """A matrix stored as a transposed view (the fused every-expert down matrix) is read through
    its contiguous transpose, as before: one row computes exactly as the old `x @ W^T`."""
    g, seed = _gen()
    w_t = torch.randn(96, 64, generator=g).to(torch.bfloat16)  # [in, out], contiguous
    lin = make_linear(w_t.T, "bf16")
    x = torch.randn(1, 96, generator=g)
    assert torch.equal(lin.add_to(None, x), (x.to(torch.bfloat16) @ w_t).float())
    assert torch.equal(lin(x), F.linear(x.to(torch.bfloat16), w_t.T).float())
    assert _rel_err(lin(x), _ref(x, lin)) < TOL, f"seed {seed}"


def test_one_row_with_a_bias_keeps_f_linear():
    g, seed = _gen()
    w, b = torch.randn(64, 96, generator=g), torch.randn(64, generator=g)
    lin = make_linear(w, "bf16", bias=b)
    x = torch.randn(1, 96, generator=g)
    ref = _ref(x, lin) + lin.bias.double()
    assert torch.equal(lin(x), F.linear(x.to(torch.bfloat16), lin.weight, lin.bias).float())
    assert _rel_err(lin(x), ref) < TOL, f"seed {seed}"


@pytest.mark.parametrize("rows", [1, 2, 4, 9])
def test_bf16_heads_match_float64(rows):
    g, seed = _gen()
    w = torch.randn(8, 256, 192, generator=g)  # 768 KiB in bf16: above the per-head byte floor
    heads = HeadLinears.from_float(w, "bf16")
    x = torch.randn(8, rows, 192, generator=g)
    y = heads(x)
    assert y.dtype == torch.float32 and y.shape == (8, rows, 256)
    ref = x.to(torch.bfloat16).double() @ heads.dequantize().double().transpose(1, 2)
    assert _rel_err(y, ref) < TOL, f"seed {seed}"


def test_f32_heads_keep_one_product_per_head():
    """The f32 path is unchanged: a few rows of big heads are one F.linear per head, bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 256, 192, generator=g)
    heads = HeadLinears.from_float(w, "f32")
    x = torch.randn(8, 1, 192, generator=g)
    want = torch.stack([F.linear(x[h], heads.stacked[h]) for h in range(8)])
    assert torch.equal(heads(x), want)


def test_describe_names_the_bf16_kernels():
    line = describe("bf16")
    assert line.startswith("weights: bf16")
    assert ("torch.mv" in line and "oneDNN" in line) if gemv_one_row() else "torch matmul" in line
    own = native.kernels()
    assert (f"latentkv's {own.name} kernel up to 4 MiB matrices" in line) if own else "latentkv" not in line


_PORTABLE = textwrap.dedent(
    """
    import sys, torch, torch.nn.functional as F
    from latentkv.weights import make_linear
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    print(torch.backends.cpu.get_cpu_capability())
    for width in (24, 1000, 2048):
        lin = make_linear(torch.randn(320, width, generator=g), "bf16")
        x = torch.randn(1, width, generator=g)
        xb = x.to(torch.bfloat16)
        ref = xb.double() @ lin.dequantize().double().T
        ys = [lin(x), torch.mv(lin.weight, xb[0])[None], F.linear(xb, lin.weight), lin(x.expand(2, -1))[:1]]
        print(*(float((y.double() - ref).abs().max() / ref.abs().max()) for y in ys))
    """
)


@pytest.mark.parametrize(
    ("capability", "onednn"),
    [("avx2", "AVX2"), pytest.param("default", "SSE41", marks=pytest.mark.slow)],  # ~2 s each
)
def test_one_row_under_narrower_cpu_kernels(capability, onednn):
    """torch picks its kernels by CPU (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA cap them): a CPU
    with AVX2 only, or none, runs the same code to the same tolerance."""
    seed = random.randrange(2**31)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, ONEDNN_MAX_CPU_ISA=onednn)
    out = subprocess.run(
        [sys.executable, "-c", _PORTABLE, str(seed)], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0].lower() == capability, out[0]
    for line in out[1:4]:  # the Linear at one row, torch.mv, F.linear, the Linear at two rows
        errors = list(map(float, line.split()))
        assert len(errors) == 4 and max(errors) < TOL, f"seed {seed} under {capability}: {errors}"
