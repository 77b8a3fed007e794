"""int8 and int4 formats: each product against float64 over the format's own dequantized matrix
(with latentkv's decode kernels and with torch's ops), the dequantized matrix against the
quantization bounds of its definition, and the int4 layouts (portable nibbles, the packed layout)
read back exactly. Inputs are fresh random draws each run; the seed is in every failure message.
tests/weights/test_native.py checks the kernels themselves, path by path."""

import random

import pytest
import torch
from tests.weights.test_native import quantized_x

from latentkv import native
from latentkv.weights import describe, int8, make_linear
from latentkv.weights.int4 import (
    KERNEL_MAX_ROWS,
    Int4Linear,
    dequantize_int4,
    pack_nibbles,
    quantize_int4,
    unpack_nibbles,
    unpack_op_layout,
    unpack_with,
)
from latentkv.weights.int8 import PREFILL_MIN_ROWS, Int8Linear
from latentkv.weights.kernels import matmul_dtype


def _gen() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


# The ops take x in bfloat16 and return bfloat16: compared with x rounded the same way, what is
# left is the output's rounding (2^-8 relative) and the order of accumulation.
OP_TOL = 8e-3
# The int8 tile path rounds x to bfloat16 where the CPU has native bf16, else stays float32.
TILE_TOL = 8e-3 if matmul_dtype() == torch.bfloat16 else 1e-5
# Against float x (no rounding in the reference): bfloat16's 8 bits of x as well.
LOOSE_TOL = 2e-2
# latentkv's kernels read x in float32 (int16 per group on AVX-512 VNNI: half a step of 2^-15 of
# the group's largest per activation); measured up to 4e-5 of the largest output. int4 on AVX-512
# VNNI reads x in int8 per group: compared with x quantized the same way, and with float x within
# X8_TOL (half a step of 1/127 of the group's largest per activation, ~1e-2 of the largest output).
KERNEL_TOL = 2e-4
X8_TOL = 4e-2


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


@pytest.mark.parametrize("rows", [1, 3, PREFILL_MIN_ROWS // 2 + 4, PREFILL_MIN_ROWS + 1, 70])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [160, 24])  # 24: the op needs padding to 32 (it crashes otherwise)
def test_int8_product_matches_its_dequantized_matrix(rows, bias, width, decode_kernels):
    g, seed = _gen()
    w = torch.randn(96, width, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    lin = make_linear(w, "int8", bias=b)
    assert lin.dequantize().shape == (96, width)
    x = torch.randn(2, rows, width, generator=g)  # leading axes are kept
    bias64 = 0 if b is None else b.double()
    native = decode_kernels == "native"
    tile = 2 * rows > (int8.KERNEL_MAX_ROWS if native else PREFILL_MIN_ROWS)
    kernel = not tile and native
    exact = kernel or (tile and matmul_dtype() == torch.float32)
    ref = (x.double() if exact else _bf16(x)) @ lin.dequantize().double().T + bias64
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (2, rows, 96)
    tol = KERNEL_TOL if kernel else TILE_TOL if tile else OP_TOL
    assert _rel_err(y, ref) < tol, f"seed {seed}"
    assert _rel_err(y, x.double() @ lin.dequantize().double().T + bias64) < LOOSE_TOL, f"seed {seed}"
    if b is None and not tile:  # add_to: the residual folded into the kernel (or added after the op)
        residual = torch.randn(2 * rows, 96, generator=g)
        got = lin.add_to(residual, x.view(-1, width))
        assert _rel_err(got, residual.double() + ref.view(-1, 96)) < tol, f"seed {seed}"


def test_int8_is_within_half_a_step_of_the_float_matrix():
    g, seed = _gen()
    w = torch.randn(64, 200, generator=g) * torch.rand(64, 1, generator=g) * 3
    w[5] = 0  # an all-zero row stays exactly zero
    deq = Int8Linear.from_float(w).dequantize().double()
    # the step is amax / 127 rounded up to bfloat16: at most 2^-7 relative above it
    step = w.double().abs().amax(dim=1, keepdim=True) / 127 * (1 + 2**-7)
    assert ((deq - w.double()).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all(), f"seed {seed}"
    assert torch.equal(deq[5], torch.zeros(200, dtype=torch.float64))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(48, 256), (20, 200), (130, 96)])  # the last two need padding
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int4_product_matches_its_dequantized_matrix(group, shape, rows, decode_kernels):
    g, seed = _gen()
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g)
    lin = make_linear(w, "int4", bias=b, group_size=group)
    x = torch.randn(rows, shape[1], generator=g)
    y = lin(x)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    kernel = decode_kernels == "native" and rows <= KERNEL_MAX_ROWS
    x8 = kernel and native.kernels().isa4 == 4
    exact = kernel or (decode_kernels == "native" and matmul_dtype() == torch.float32)
    xr = x.double() if exact else _bf16(x)
    if x8:
        xr = quantized_x(x, group, -(-shape[1] // group) * group, 127)
    ref = xr @ lin.dequantize().double().T + b.double()
    assert _rel_err(y, ref) < (KERNEL_TOL if kernel else OP_TOL), f"seed {seed}"
    loose = X8_TOL if x8 else LOOSE_TOL
    assert _rel_err(y, x.double() @ lin.dequantize().double().T + b.double()) < loose, f"seed {seed}"


@pytest.mark.parametrize("group", [32, 128])
def test_int4_is_within_half_a_step_of_the_float_matrix(group):
    g, seed = _gen()
    w = torch.randn(32, 512, generator=g) + torch.linspace(-2, 2, 512)  # groups with offsets
    deq = Int4Linear.from_float(w, group_size=group).dequantize().double()
    wg = w.double().view(32, -1, group)
    # half a step (the range / 15, rounded up to bfloat16), plus the zero point's bfloat16 rounding
    step = (wg.amax(-1) - wg.amin(-1)) / 15 * (1 + 2**-7)  # [32, groups]
    zero_rounding = (wg.amax(-1) + wg.amin(-1)).abs() / 2 * 2**-8 + step
    err = (deq - w.double()).view(32, -1, group).abs()
    assert (err <= step[..., None] / 2 + zero_rounding[..., None] * 2**-8 + 1e-6).all(), f"seed {seed}"


def test_int4_reference_formula_and_layouts_round_trip(decode_kernels):
    g, seed = _gen()
    w = torch.randn(80, 192, generator=g)
    q, scale, zero = quantize_int4(w, 64)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (80, 3)
    assert scale.dtype == zero.dtype == torch.bfloat16
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    lin = Int4Linear(pack_nibbles(q), scale, zero, 192)
    if decode_kernels == "torch":  # the op's own layout, 80 rows padded to 80
        assert torch.equal(unpack_op_layout(lin.packed, 80, 192), q), f"seed {seed}"
    else:  # the kernel's layout, 80 rows padded to 128 with code 8
        assert lin.packed.shape == (128, 96)
        assert torch.equal(unpack_nibbles(unpack_with(lin.packed, lin.layout))[:80], q), f"seed {seed}"
    nib, s2, z2 = lin.nibbles()
    assert torch.equal(nib, pack_nibbles(q)) and torch.equal(s2, scale) and torch.equal(z2, zero)
    # the formula written out in float64, independent of dequantize_int4
    qg = q.double().view(80, 3, 64)
    expected = ((qg - 8) * scale.double()[..., None] + zero.double()[..., None]).view(80, 192)
    assert (expected - w.double()).abs().max() < 0.5
    assert torch.allclose(lin.dequantize().double(), expected, rtol=0, atol=1e-6)
    assert torch.allclose(dequantize_int4(q, scale, zero).double(), expected, rtol=0, atol=1e-6)


def test_resident_bytes():
    w = torch.randn(64, 256)
    assert make_linear(w, "int8").nbytes == 64 * 256 + 64 * 2
    # 4 bits per weight plus a bfloat16 scale and zero per group of 64
    assert make_linear(w, "int4", group_size=64).nbytes == 64 * 128 + 64 * 4 * 4
    assert make_linear(w, "int4", group_size=64).nbytes < make_linear(w, "int8").nbytes / 1.5


def test_bad_parameters_say_what_is_valid():
    with pytest.raises(ValueError, match="one of"):
        make_linear(torch.randn(16, 64), "int4", group_size=16)
    with pytest.raises(ValueError, match="int8 group size must be one of"):
        make_linear(torch.randn(16, 64), "int8", group_size=24)
    with pytest.raises(ValueError, match="takes only group_size"):
        make_linear(torch.randn(16, 64), "int8", bits=8)
    with pytest.raises(ValueError, match="valid formats: .*int4.*int8"):
        make_linear(torch.randn(16, 64), "int2")


def test_describe_names_the_kernel_and_the_cpu():
    line = describe("int4")
    own = native.kernels()
    kernel = f"latentkv's {own.name} kernel" if own is not None else "_weight_int4pack_mm_for_cpu"
    assert line.startswith("weights: int4") and kernel in line
    assert torch.backends.cpu.get_cpu_capability() in line


@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("rows", [1, PREFILL_MIN_ROWS + 3])
def test_grouped_int8_within_half_a_step_and_its_product(group, rows):
    """int8 with one float32 scale per group of columns (GGUF's Q8_0, Q6_K): each weight within
    half its group's step; the product (float32 tiles) against float64 over the matrix."""
    g, seed = _gen()
    w = torch.randn(40, 200, generator=g) * torch.rand(40, 1, generator=g)  # 200: padded to the group
    lin = make_linear(w, "int8", group_size=group)
    assert lin.group_size == group and lin.in_features == 200
    deq = lin.dequantize().double()
    padded = torch.nn.functional.pad(w.double(), (0, -200 % group)).view(40, -1, group)
    step = (padded.abs().amax(-1, keepdim=True) / 127).expand_as(padded).reshape(40, -1)[:, :200]
    # half a step, plus the float32 roundings of the scale and of q * scale (up to 2^-23 of |w|)
    bound = step / 2 + 2.0**-22 * w.double().abs() + 1e-12
    assert ((deq - w.double()).abs() <= bound).all(), f"seed {seed}"
    x = torch.randn(rows, 200, generator=g)
    assert _rel_err(lin(x), x.double() @ deq.T) < 1e-5, f"seed {seed}"
    groups = -(-200 // group)
    assert lin.nbytes == 40 * groups * group + 40 * groups * 4  # int8 codes (padded) + float32 scales


def test_int4_with_float32_scales_computes_with_them():
    """int4 states with float32 scales and zeros (GGUF's Q4_0 / Q4_1 / Q4_K): `dequantize` is the
    scale as its two bfloat16 parts and the float32 zero; every path multiplies by that."""
    g, seed = _gen()
    out_f, in_f = 40, 96  # 40 rows: padded to the op's 16
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g)
    scale = (torch.rand(out_f, in_f // 32, generator=g) * 0.01).half().float()  # f16 values: held exactly
    zero = torch.randn(out_f, in_f // 32, generator=g) * 0.05
    lin = Int4Linear.from_state({"nibbles": pack_nibbles(q), "scale": scale, "zero": zero}, in_f)
    want = ((q.double().view(out_f, -1, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]).view(
        out_f, in_f
    )
    assert torch.equal(lin.dequantize(), want.float()), f"seed {seed}"  # one rounding of the exact value
    zeros = zero.double().repeat_interleave(32, dim=1)  # [out, in]: each group's zero
    _, s2, z2 = lin.nibbles()
    assert s2.dtype == z2.dtype == torch.float32 and torch.equal(s2, scale) and torch.equal(z2, zero)
    for rows in (1, 5, 120):  # the kernel or the op, and (where the CPU tiles prefill) the tiles
        x = torch.randn(rows, in_f, generator=g)
        if lin._kernel is not None and lin._kernel.isa4 == 4 and rows <= KERNEL_MAX_ROWS:
            # int4 on AVX-512 VNNI multiplies the codes with x quantized to int8 per group and
            # adds each group's zero times the float sum of x (measured: 9e-8 of this reference)
            ref = quantized_x(x, 32, in_f, 127) @ (want - zeros).T + x.double() @ zeros.T
            tol = KERNEL_TOL
        else:
            ref, tol = _bf16(x) @ want.T, OP_TOL
        assert _rel_err(lin(x), ref) < tol, f"seed {seed}, {rows} rows"


def test_row_stack_is_its_parts_side_by_side():
    from latentkv.weights.stack import RowStack

    g, seed = _gen()
    parts = [
        make_linear(torch.randn(24, 64, generator=g), "int4"),
        make_linear(torch.randn(8, 64, generator=g), "int8", group_size=32),
    ]
    stack = RowStack(parts)
    x = torch.randn(3, 64, generator=g)
    assert (stack.out_features, stack.in_features) == (32, 64)
    assert torch.equal(stack(x), torch.cat([p(x) for p in parts], -1))
    assert torch.equal(stack.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert stack.nbytes == sum(p.nbytes for p in parts)


def test_describe_says_why_the_kernels_are_not_used(torch_ops, monkeypatch):
    monkeypatch.setattr(native, "unavailable", lambda: "OSError: no C++ compiler (g++, c++, clang++) on PATH")
    line = describe("int8")
    assert "torch's _weight_int8pack_mm (latentkv's kernels unavailable: OSError: no C++ compiler" in line
