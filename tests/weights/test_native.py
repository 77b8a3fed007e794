"""latentkv's int8/int4 decode kernels (latentkv/native), every vector path this CPU runs (AVX-512
VNNI with int8 or int16 activations, AVX-512, AVX2, plain C++), against slower references on
fresh random inputs: float64 over the format's dequantized matrix, torch's own op (bfloat16 x),
and for the VNNI paths a float64 product of x quantized to int16 / int8 exactly as the kernel
defines it. Odd shapes (rows past a block,
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

from latentkv import native
from latentkv.weights import bf16, int4, int8, make_linear

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(native.kernels() is None, reason=f"kernels not built here: {native.unavailable()}"),
]

PATHS = [isa for isa in (4, 3, 2, 1, 0) if native.with_isa(isa) is not None]
VNNI = {3: 32767, 4: 127}  # path -> the largest code of its quantized x
ROWS = [1, 2, 3, 4, 5, 8, 17]
EPS = 2.0**-23  # float32's machine epsilon: twice its unit roundoff
BF16 = 2.0**-8  # bfloat16's
# Every tolerance is a bound derived from the case's own inputs, output by output, never a fixed
# fraction of the largest output (which cancellation makes as small as it likes):
# - float32: a sum of n rounded products in any order, fused or not, is within n * EPS of the sum
#   of the products' magnitudes (Higham's gamma_n, n u <= 1/2), so |y - exact| <= n EPS |x| @ A^T,
#   A the magnitudes the path multiplies (int8 |scale q|; int4 |scale (q - 8)| + |zero| or
#   |scale q| + |zero - 8 scale|, as the path splits the zero point off), n the terms and the
#   roundings after them (scales, zero points, group sums, the float32 reference matrix).
# - int16 / int8 x (VNNI): an activation is within 0.51 of its group's step max |x| / L, L = 32767
#   or 127 (half a step from rounding, and the float32 roundings of L / max and of x times it: 3
#   ulps of at most L steps); the integer sums are exact, the float32 ones per group bounded as
#   above.
# - torch's op: x and its output rounded to bfloat16 (half of BF16 each), and int4's weights.


def _gen() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _rounding(x: torch.Tensor, mags: torch.Tensor, terms: int) -> torch.Tensor:
    """What float32 may lose in `terms` roundings of sums of x times magnitudes mags [N, K]."""
    return terms * EPS * (x.double().abs() @ mags.T)


def quantization_steps(x: torch.Tensor, group: int, width: int, levels: int) -> torch.Tensor:
    """Each activation's step on a VNNI path, float64 [M, K]: max |x| of its group / levels."""
    M, K = x.shape
    top = F.pad(x, (0, width - K)).view(M, -1, group).abs().amax(-1, keepdim=True).double()
    return (top / levels).expand(M, width // group, group).reshape(M, width)[:, :K]


def _bounds(x, mags, isa, group, width, terms):
    """(bound against x @ W in float64, bound against the quantized x's product or None) for a
    kernel summing `terms` roundings per output on the float paths, groups of `group` columns
    (int16 or int8 x per group on the VNNI paths) over `width` padded columns."""
    if isa not in VNNI:
        return _rounding(x, mags, terms), None
    steps = quantization_steps(x, group, width, VNNI[isa])
    rounding = _rounding(x.double().abs() + steps, mags, 2 * (width // group) + 8)
    return (0.51 * steps) @ mags.T + rounding, rounding


def _within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> str | None:
    """None when every |y - ref| <= its bound, else how far past it (for the message)."""
    err = (y.double() - ref).abs()
    if bool((err <= bound).all()):
        return None
    over = err / bound
    at = int(over.argmax())
    return f"{float(over.flatten()[at]):.3g}x its bound at {at} (err {float(err.flatten()[at]):.3g})"


def _op_bound(x, mags, kernel_bound, weights_rounded=False):
    """|y - torch's op|: the kernel's bound, plus x and the op's output in bfloat16 (and its
    int4 weights), accumulated in float32."""
    bf16 = (1.5 if weights_rounded else 1.0) * BF16 * 1.01
    return kernel_bound + (bf16 + (x.shape[1] + 4) * EPS) * (x.double().abs() @ mags.T)


def quantized_x(x: torch.Tensor, group: int, width: int, levels: int) -> torch.Tensor:
    """x [M, K] as a VNNI path reads it, in float64: per row and group of columns, the step
    max |x| / L (float32), codes round(x * (L / max)) (float32 product, ties to even), L = levels."""
    M, K = x.shape
    xp = F.pad(x, (0, width - K)).view(M, -1, group)  # [M, groups, G]
    top = xp.abs().amax(-1, keepdim=True)  # float32
    # float32 division as the kernel rounds it (torch's `32767.0 / top` is 32767 * (1 / top),
    # an ulp off for a quarter of the values, and then a code off by one now and then)
    inv = torch.where(top > 0, torch.full_like(top, float(levels)) / top, torch.zeros_like(top))
    codes = (xp * inv).round().clamp(-levels, levels)
    step = torch.where(top > 0, top / float(levels), torch.zeros_like(top))
    return (codes.double() * step.double()).view(M, width)[:, :K]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 17), (96, 160), (257, 1000), (64, 2096)])
def test_int8_matches_float64_and_the_op(isa, n, k):
    kernels = native.with_isa(isa)
    g, seed = _gen()
    lin = make_linear(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g), "int8")
    w64 = lin.dequantize().double()  # exact: an int8 times a bfloat16 scale fits float32
    mags, width = w64.abs(), -(-k // 256) * 256
    for m in ROWS:
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
        residual = torch.randn(m, n, generator=g)
        y = kernels.int8_mm(x, lin.q, lin.scale)
        assert y.shape == (m, n) and y.dtype == torch.float32
        bound, rounding = _bounds(x, mags, isa, 256, width, k + 2)
        assert not (why := _within(y, x.double() @ w64.T, bound)), f"seed {seed} m {m}: {why}"
        if isa in VNNI:
            why = _within(y, quantized_x(x, 256, width, VNNI[isa]) @ w64.T, rounding)
            assert not why, f"seed {seed} m {m}: {why}"
        assert torch.equal(kernels.int8_mm(x, lin.q, lin.scale, residual), residual + y), f"seed {seed}"
        if k % 16 == 0:  # torch's bf16 op reads past x otherwise (weights/int8.py)
            op = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), lin.q[:, :k].contiguous(), lin.scale
            )
            why = _within(y, op.double(), _op_bound(x, mags, bound))
            assert not why, f"seed {seed} m {m}: {why}"


def _int4_case(n: int, k: int, group: int, g: torch.Generator):
    """An int4 matrix packed for the kernel (rows padded to 64 with code 8, scale 1, zero 0), its
    float64 dequantized matrix and the magnitudes the kernels multiply ([n, width] each)."""
    w = torch.randn(n, k, generator=g) + torch.randn(n, 1, generator=g)
    q, scale, zero = int4.quantize_int4(int4.pad_columns(w, group), group)
    w64 = int4.dequantize_int4(q, scale, zero).double()
    s, z = (t.double().repeat_interleave(group, dim=1) for t in (scale, zero))
    q64 = q.double()
    mags = torch.maximum(s.abs() * (q64 - 8).abs() + z.abs(), s.abs() * q64 + (z - 8 * s).abs())
    rows = -(-n // 64) * 64
    nibbles = F.pad(int4.pack_nibbles(q), (0, 0, 0, rows - n), value=0x88)
    sz = torch.stack([scale, zero], dim=-1)
    sz = torch.cat([sz, torch.tensor([1.0, 0.0], dtype=torch.bfloat16).expand(rows - n, sz.shape[1], 2)])
    return int4.pack_with(nibbles, int4.KERNEL_LAYOUT), sz.transpose(0, 1).contiguous(), w64, mags


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (100, 70, 32), (130, 512, 256), (257, 1000, 128),
                                                (64, 127, 64), (320, 2048, 64)])  # fmt: skip
def test_int4_matches_float64_and_the_op(isa, n, k, group):
    kernels = native.with_isa(isa)
    g, seed = _gen()
    packed, sz, w64, mags = _int4_case(n, k, group, g)
    width = w64.shape[1]
    w64, mags = w64[:, :k], mags[:, :k]
    for m in ROWS:
        x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
        residual = torch.randn(m, n, generator=g)
        y = kernels.int4_mm(x, packed, sz, group, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        bound, rounding = _bounds(x, mags, isa, group, width, k + 2 * (width // group) + 4)
        assert not (why := _within(y, x.double() @ w64.T, bound)), f"seed {seed} m {m}: {why}"
        if isa in VNNI:
            why = _within(y, quantized_x(x, group, width, VNNI[isa]) @ w64.T, rounding)
            assert not why, f"seed {seed} m {m}: {why}"
        assert torch.equal(kernels.int4_mm(x, packed, sz, group, n, residual), residual + y), f"seed {seed}"
    if int4.same_layout(int4.op_layout(), int4.KERNEL_LAYOUT):  # the op reads the same bytes here
        xb = F.pad(x, (0, width - k)).to(torch.bfloat16)
        op = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group, sz)[:, :n]
        why = _within(y, op.double(), _op_bound(x, mags, bound, weights_rounded=True))
        assert not why, f"seed {seed}: {why}"


@pytest.mark.parametrize("isa", PATHS)
def test_paths_agree_on_zero_and_extreme_rows(isa):
    """A row of zeros gives exact zeros (no division by a zero scale); a row with one huge
    activation is still within its bound of float64."""
    kernels = native.with_isa(isa)
    g, seed = _gen()
    lin = make_linear(torch.randn(64, 512, generator=g), "int8")
    packed, sz, w64, mags = _int4_case(64, 512, 64, g)
    x = torch.zeros(3, 512)
    x[1] = torch.randn(512, generator=g)
    x[2, 7] = 1e4
    x[2, 100:] = torch.randn(412, generator=g) * 1e-3
    w8 = lin.dequantize().double()
    for y, ref, bound in (
        (
            kernels.int8_mm(x, lin.q, lin.scale),
            x.double() @ w8.T,
            _bounds(x, w8.abs(), isa, 256, 512, 514)[0],
        ),
        (
            kernels.int4_mm(x, packed, sz, 64, 64),
            x.double() @ w64.T,
            _bounds(x, mags, isa, 64, 512, 512 + 20)[0],
        ),
    ):
        assert torch.equal(y[0], torch.zeros(64)), f"seed {seed}"
        assert not (why := _within(y, ref, bound)), f"seed {seed}: {why}"


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 17), (96, 160), (257, 1000), (64, 2096)])
def test_bf16_matches_float64(isa, n, k):
    """bf16_mm: x (float32, not rounded) times the bfloat16 matrix widened exactly, float32 sums:
    within float32's bound of the float64 product, output by output, for 1-4 rows (one read
    through a row stride wider than K); the residual is one float32 add after the product."""
    g, seed = _gen()
    kernels = native.with_isa(isa)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4).to(torch.bfloat16)
    for rows in (1, 2, 3, 4):
        wide = torch.randn(rows, k + 7, generator=g)
        x = wide[:, :k] if rows == 3 else wide[:, :k].contiguous()
        y = kernels.bf16_mm(x, w)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        exact = x.double() @ w.double().T
        bound = _rounding(x, w.double().abs(), k + 2)
        assert not (why := _within(y, exact, bound)), f"seed {seed}, {rows} rows: {why}"
        residual = torch.randn(rows, n, generator=g)
        assert torch.equal(kernels.bf16_mm(x, w, residual), y + residual), f"seed {seed}"


def test_bf16_paths_agree_within_rounding_and_refuse_bad_arguments():
    g, seed = _gen()
    w = torch.randn(300, 500, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 500, generator=g)
    ys = [native.with_isa(isa).bf16_mm(x, w) for isa in PATHS]
    bound = _rounding(x, w.double().abs(), 2 * 502)
    for y in ys[1:]:
        assert not (why := _within(y, ys[0].double(), bound)), f"seed {seed}: {why}"
    kernels = native.kernels()
    for call, message in [
        (lambda: kernels.bf16_mm(torch.zeros(5, 500), w), "up to 4 rows"),
        (lambda: kernels.bf16_mm(torch.zeros(1, 499), w), "K the matrix's columns"),
        (lambda: kernels.bf16_mm(torch.zeros(1, 500), w.float()), "bfloat16"),
        (lambda: kernels.bf16_mm(torch.zeros(1, 300), w.T), "contiguous"),
        (lambda: kernels.bf16_mm(torch.zeros(1, 500), w, torch.zeros(2, 300)), "residual"),
        (lambda: torch.ops.latentkv.bf16_mm(torch.zeros(1, 500), w, None, 9), "path"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call()


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
    if native.with_isa(4) is not None:  # int8 x reads 4 columns of a group at a time
        cases.append(
            (
                lambda: torch.ops.latentkv.int4_mm(
                    torch.zeros(1, 12),
                    torch.zeros(64, 6, dtype=torch.uint8),
                    torch.zeros(2, 64, 2, dtype=torch.bfloat16),
                    6,
                    64,
                    None,
                    4,
                ),
                "divisible by 4",
            )
        )
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_the_process_path_follows_torchs_capability():
    """The path is torch's capability (ATEN_CPU_CAPABILITY lowers both), where this CPU runs it;
    on AVX-512 VNNI int8 weights read int16 x (path 3), int4 weights int8 x (path 4)."""
    best = native.isa_for(torch.backends.cpu.get_cpu_capability())
    own = native.kernels()
    assert own.isa == max(p for p in PATHS if p <= best)
    assert own.isa4 == (4 if own.isa == 3 else own.isa)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=os.pathsep.join(sys.path))
    code = "from latentkv import native; k = native.kernels(); print(k.isa, k.isa4)"
    if 1 in PATHS:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "1 1", out.stderr


def test_no_compiler_means_torchs_ops_and_a_reason(monkeypatch):
    monkeypatch.setattr(native, "COMPILERS", ("no-such-c++-compiler",))
    with pytest.raises(OSError, match="no C\\+\\+ compiler"):
        native._build()


def _process_isa(fmt: str) -> int:
    """The path this process runs a format's matrices on."""
    own = native.kernels()
    return own.isa4 if fmt == "int4" else own.isa


def _linear_bound(x: torch.Tensor, lin, isa: int) -> torch.Tensor:
    """|kernel - float64| for x [M, K] (or its magnitudes) through an int8/int4/bf16 Linear."""
    w64 = lin.dequantize().double()
    n, k = w64.shape
    if lin.format == "bf16":  # float32 x and sums on every path
        return _rounding(x, w64.abs(), k + 2)
    if isinstance(lin, int4.Int4Linear):
        group = lin.group_size
        sz = lin.scale_zeros[:, :n].double()  # [groups, n, 2]
        s, z = (sz[..., j].T.repeat_interleave(group, dim=1)[:, :k] for j in (0, 1))
        q = ((w64 - z) / s).round() + 8
        mags = torch.maximum(s.abs() * (q - 8).abs() + z.abs(), s.abs() * q + (z - 8 * s).abs())
        groups = sz.shape[0]
        return _bounds(x, mags, isa, group, groups * group, k + 2 * groups + 4)[0]
    return _bounds(x, w64.abs(), isa, 256, -(-k // 256) * 256, k + 2)[0]


def _expert(x: torch.Tensor, gate_up, down, isa: int) -> tuple[torch.Tensor, torch.Tensor]:
    """down(silu(gate(x)) * up(x)) in float64 over the dequantized matrices, and the bound of
    the kernel's result: the first product's bound carried through silu (slope within [-0.1,
    1.1], |silu(g)| <= |g|) and the product with up, 8 ulps for the activation's own roundings,
    then the second product's bound over the activation's largest values."""
    gate, up = (x.double() @ gate_up.dequantize().double().T).chunk(2, dim=-1)
    bg, bu = _linear_bound(x, gate_up, isa).chunk(2, dim=-1)
    h = F.silu(gate) * up
    dh = 1.1 * bg * (up.abs() + bu) + gate.abs() * bu + 8 * EPS * (gate.abs() + bg) * (up.abs() + bu)
    wd = down.dequantize().double()
    return h @ wd.T, dh @ wd.abs().T + _linear_bound(h.abs() + dh, down, isa)


EXPERT_FORMATS = ["int8", "int4", "bf16"]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(
    ("fmt", "d", "i"),
    [(f, d, i) for f in EXPERT_FORMATS for d, i in [(128, 64), (96, 80), (200, 128)]] + [("bf16", 37, 21)],
)
def test_a_swiglu_expert_in_one_call(isa, fmt, d, i):
    """down(silu(gate(x)) * up(x)) through `expert_int8` / `expert_int4` / `expert_bf16` against
    float64 over the dequantized matrices (x and the activation in float64), with and without
    the residual; bf16 at odd widths too (int8/int4 matrices take even ones)."""
    kernels = native.with_isa(isa)
    g, seed = _gen()
    gate_up = make_linear(torch.randn(2 * i, d, generator=g) * 0.1, fmt)
    down = make_linear(torch.randn(d, i, generator=g) * 0.1, fmt)
    run = getattr(kernels, f"expert_{fmt}")
    for m in (1, 3, 4) if fmt == "bf16" else (1, 3, 8):
        x = torch.randn(m, d, generator=g)
        want, bound = _expert(x, gate_up, down, isa)
        y = run(x, gate_up, down)
        assert not (why := _within(y, want, bound)), f"seed {seed} m {m}: {why}"
        residual = torch.randn(m, d, generator=g)
        assert torch.equal(run(x, gate_up, down, residual), residual + y), f"seed {seed}"


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_an_expert_takes_the_one_call_path_at_decode(fmt, monkeypatch):
    """Expert.__call__ runs the one-call kernel for int8/int4/bf16 matrices within the decode row
    limit, and its result matches the three-step path (each product through its Linear): both
    within their bound of float64."""
    from latentkv.experts.base import Expert
    from latentkv.weights import swiglu

    g, seed = _gen()
    expert = Expert(
        make_linear(torch.randn(160, 96, generator=g) * 0.1, fmt),
        make_linear(torch.randn(96, 80, generator=g) * 0.1, fmt),
    )
    # bf16: one row, the row its Linears take through the same kernel (more rows of a bf16
    # Linear are rounded to bfloat16 for F.linear, outside this bound)
    rows = 1 if fmt == "bf16" else 2
    x, residual = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
    assert swiglu.fused_swiglu(expert.gate_up, expert.down, rows) is not None
    fused = expert(x, residual)
    monkeypatch.setattr("latentkv.experts.base.fused_swiglu", lambda *a: None)
    steps = expert(x, residual)
    _, bound = _expert(x, expert.gate_up, expert.down, _process_isa(fmt))
    # two results each within `bound` of float64, and each + residual rounded once more
    why = _within(fused, steps.double(), 2 * bound + 2 * EPS * (residual.abs().double() + steps.abs()))
    assert not why, f"seed {seed}: {why}"
    other = "int8" if fmt == "bf16" else "bf16"
    mixed = Expert(expert.gate_up, make_linear(torch.randn(96, 80, generator=g), other))
    assert swiglu.fused_swiglu(mixed.gate_up, mixed.down, 2) is None
    limit = {"int8": int8.KERNEL_MAX_ROWS, "int4": int4.KERNEL_MAX_ROWS, "bf16": bf16.KERNEL_MAX_ROWS}[fmt]
    assert swiglu.fused_swiglu(expert.gate_up, expert.down, limit + 1) is None


def test_big_bf16_matrices_keep_their_linears():
    """A bf16 SwiGLU with a matrix past the one-row kernel's size (`NATIVE_MAX_BYTES`) keeps the
    three steps: torch's kernels read big matrices as fast (bf16-one-row.json)."""
    from latentkv.weights import swiglu

    d = bf16.NATIVE_MAX_BYTES // (2 * 64) + 1  # gate_up [64, d] just past the size, down [d, 32] under it
    down = make_linear(torch.randn(d, 32), "bf16")
    assert swiglu.fused_swiglu(
        make_linear(torch.randn(64, d - 1), "bf16"), make_linear(torch.randn(d - 1, 32), "bf16"), 1
    )
    assert swiglu.fused_swiglu(make_linear(torch.randn(64, d), "bf16"), down, 1) is None


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_a_layers_experts_in_one_call(fmt, rows):
    """PackedExperts (`moe_int8` / `moe_int4` / `moe_bf16`) over a layer's stacked experts, as the
    resident store builds it: the router's weighted sum of each picked expert's own output
    (Expert.__call__, the one-call expert), added in the MoE layer's order (a lone token: the
    router's; a batch: by expert id), bit for bit."""
    from latentkv.experts.resident import ResidentExperts

    g, seed = _gen()
    E, k, d, i = 6, 3, 96, 64
    store = ResidentExperts.from_float(
        torch.randn(E, 2 * i, d, generator=g) * 0.1, torch.randn(E, d, i, generator=g) * 0.1, fmt
    )
    experts, packed = store.experts, store.packed
    assert packed is not None
    x = torch.randn(rows, d, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=g)
    by_id = rows > 1
    want = torch.zeros(rows, d)
    for r in range(rows):
        order = sorted(range(k), key=lambda j: int(idx[r, j])) if by_id else range(k)
        for j in order:
            want[r] += experts[int(idx[r, j])](x[r : r + 1])[0] * weights[r, j]
    got = packed(x, idx, weights, by_id)
    assert torch.equal(got, want), f"seed {seed}: {float((got - want).abs().max()):.3g}"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("h", "n", "k", "s"), [(4, 64, 96, 1), (8, 96, 130, 3), (16, 512, 192, 1)])
def test_every_head_in_one_call(fmt, h, n, k, s):
    """HeadLinears over int8/int4 heads: one `heads_int8` / `heads_int4` call gives each head's
    own product exactly (the same kernel per head), and float64 over the dequantized heads."""
    from latentkv.weights.heads import HeadLinears

    g, seed = _gen()
    heads = HeadLinears.from_float(torch.randn(h, n, k, generator=g), fmt)
    assert heads._packed is not None
    x = torch.randn(h, s, k, generator=g)
    y = heads(x)
    assert y.shape == (h, s, n) and y.dtype == torch.float32
    assert torch.equal(y, torch.stack([head(x[i]) for i, head in enumerate(heads.heads)])), f"seed {seed}"
    isa = _process_isa(fmt)
    for i, head in enumerate(heads.heads):
        want = x[i].double() @ head.dequantize().double().T
        assert not (why := _within(y[i], want, _linear_bound(x[i], head, isa))), (
            f"seed {seed} head {i}: {why}"
        )
