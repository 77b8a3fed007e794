"""int4 prefill: many rows run on tiles dequantized from the packed layout (latentkv's kernel's,
or torch's op's where the kernels are not built: then above PREFILL_MIN_ROWS rows, bfloat16).
Tiles, the op and the kernel are checked against the dequantize-then-compute reference in
float64 on fresh random inputs, on shapes with whole row blocks, a partial last block, padded
columns and a bias."""

import pytest
import torch

from latentkv.weights import int4
from latentkv.weights.int4 import Int4Linear, op_layout

# bf16 rounding of x and of the dequantized matrix: ~2^-9 per element; measured ~0.003
REL_TOL = 0.01
SHAPES = [(256, 192, 64), (80, 96, 32), (40, 200, 64), (1100, 128, 128), (2048 + 64, 256, 256)]


def _case(out_f: int, in_f: int, group: int, rows: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) + 0.3 * torch.randn(out_f, 1, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    lin = Int4Linear.from_float(w, bias=b, group_size=group)
    x = torch.randn(rows, in_f, generator=g)
    want = x.double() @ lin.dequantize().double().T + (0 if b is None else b.double())
    return lin, x, want


def _rel(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.double() - want).norm() / want.norm())


def _padded_bf16(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x.to(torch.bfloat16), (0, lin._in_padded - lin.in_features)).contiguous()


def test_this_cpu_layout_is_understood():
    """The op's layout on the CPUs we build for (AVX-512 and AVX2 vector paths) is blocked."""
    layout = op_layout()
    assert layout is not None and int4.TILE_ROWS % layout[0] == 0


@pytest.mark.parametrize(("out_f", "in_f", "group"), SHAPES)
def test_tiles_and_decode_match_the_reference(out_f, in_f, group, decode_kernels):
    lin, x, want = _case(out_f, in_f, group, rows=70, seed=out_f + in_f)
    xb = _padded_bf16(lin, x)
    tiled = lin._tiled(xb)[:, :out_f]
    if decode_kernels == "torch":
        decode = lin._op(xb, lin.packed, lin.scale_zeros)[:, :out_f]
    else:
        decode = lin(x[:8])
        want = want[:8]
        tiled = tiled[:8]
    assert _rel(tiled, want) < REL_TOL and _rel(decode, want) < REL_TOL, (
        _rel(tiled, want),
        _rel(decode, want),
    )
    assert tiled.shape == decode.shape == want.shape


def test_the_tile_is_the_dequantized_matrix(decode_kernels):
    """One tile, unpacked from the packed layout, is the reference matrix rounded to bf16."""
    lin, _, _ = _case(1024 + 128, 192, 64, rows=1, seed=3)
    ref = lin.dequantize()
    block = lin.layout[0]
    for r0, r1 in ((0, 1024), (1024, 1024 + block)):
        tile = lin._dequantized_tile(r0, r1)  # [in, rows]
        assert torch.allclose(tile.float().T, ref[r0:r1], rtol=2**-8, atol=1e-6)
    exact = lin._dequantized_tile(0, 1024, torch.float32)  # the float32 tiles (AVX2 machines)
    assert torch.allclose(exact.T, ref[:1024], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, int4.KERNEL_MAX_ROWS + 1, int4.PREFILL_MIN_ROWS + 1, 300])
def test_call_picks_by_rows_and_stays_right(rows, monkeypatch, decode_kernels):
    lin, x, want = _case(272, 160, 32, rows=rows, seed=rows, bias=True)
    used = []
    monkeypatch.setattr(
        Int4Linear, "_tiled", lambda self, *a, f=Int4Linear._tiled: used.append(1) or f(self, *a)
    )
    y = lin(x.view(1, rows, 160))
    assert y.shape == (1, rows, 272) and _rel(y[0], want) < REL_TOL
    if decode_kernels == "native":
        assert bool(used) == (rows > int4.KERNEL_MAX_ROWS)
    else:
        assert bool(used) == (rows > int4.PREFILL_MIN_ROWS and int4.prefill_tiles())


def test_tiles_hold_no_dequantized_copy():
    """The weight stays resident at int4's size: prefill leaves nothing behind on the Linear."""
    lin, x, _ = _case(1100, 128, 64, rows=100, seed=9)
    before = lin.nbytes, dict(vars(lin))
    lin(x)
    assert lin.nbytes == before[0] and vars(lin).keys() == before[1].keys()


@pytest.mark.parametrize("shape", [(64, 64), (128, 256), (4096, 192), (48, 128), (16, 64)])
def test_pack_for_op_makes_the_ops_own_bytes(shape):
    """The direct byte shuffle (or, where the layout does not fit, the op) gives exactly the bytes
    of torch's own packing, on fresh random codes: what an expert read from disk is built with."""
    from latentkv.weights.int4 import pack_for_op, pack_nibbles

    q = torch.randint(0, 16, shape, dtype=torch.uint8)
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    got = pack_for_op(pack_nibbles(q))
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got, expected)
