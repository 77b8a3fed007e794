"""The Triton int8 kernel (weights/int8_triton.py: int8 codes on a CUDA device) under triton's
interpreter on CPU tensors, against a float64 dequantize-then-multiply; the tile paths' outputs
follow the device of their input (meta here)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from latentkv.weights.int8 import Int8Linear  # noqa: E402

# float32 accumulation over at most a few hundred products of values ~1: the error stays below
# 1e-4 relative to the output's scale; a wrong scale, mask or group index is off by O(1).
TOL = 1e-4


def _reference(x: torch.Tensor, lin: Int8Linear) -> torch.Tensor:
    return x.double() @ lin.dequantize().double().T


@pytest.mark.parametrize("group_size", [None, 16, 32])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("shape", [(70, 100), (33, 64), (128, 200)])
def test_kernel_matches_dequantized_float64(group_size, rows, shape, kernel_device):
    from latentkv.weights.int8_triton import int8_mm

    dev = kernel_device
    g = torch.Generator().manual_seed(hash((group_size, rows, shape)) % (1 << 31))
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g) * 3
    lin = Int8Linear.from_float(w, group_size=group_size)
    x = torch.randn(rows, in_f, generator=g)
    want = _reference(x, lin)
    scale = lin.scale.float() if group_size is None else lin.scale
    got = int8_mm(x.to(dev), lin.q.to(dev), scale.to(dev), lin.in_features, lin.group_size)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= TOL * max(1.0, want.abs().max().item()), err


def test_kernel_ignores_padded_columns(kernel_device):
    """Codes stored past in_features (the op's padding) never enter the sum: fill them with
    nonzero codes and the result must not move."""
    from latentkv.weights.int8_triton import int8_mm

    dev = kernel_device
    g = torch.Generator().manual_seed(7)
    lin = Int8Linear.from_float(torch.randn(40, 100, generator=g))
    q = lin.q.clone()
    assert q.shape[1] > 100
    q[:, 100:] = 77
    x = torch.randn(2, 100, generator=g)
    got = int8_mm(x.to(dev), q.to(dev), lin.scale.float().to(dev), 100, None).cpu().double()
    assert (got - _reference(x, lin)).abs().max().item() <= TOL * 10


def test_empty_rows(kernel_device):
    from latentkv.weights.int8_triton import int8_mm

    lin = Int8Linear.from_float(torch.randn(8, 32))
    dev = kernel_device
    assert int8_mm(
        torch.zeros(0, 32, device=dev), lin.q.to(dev), lin.scale.float().to(dev), 32, None
    ).shape == (0, 8)


@pytest.mark.parametrize("group_size", [None, 32])
def test_tiles_follow_the_input_device(group_size):
    """Prefill's tile paths allocate on x's device (they run on CUDA too), not the default one."""
    lin = Int8Linear.from_float(torch.randn(24, 64), group_size=group_size)
    meta = Int8Linear(lin.q.to("meta"), lin.scale.to("meta"))
    x = torch.empty(40, 64, device="meta")
    y = meta._tiled_groups(x) if group_size else meta._tiled(x)
    assert y.device.type == "meta" and y.shape == (40, 24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_linear_on_cuda(group_size):
    """On a GPU an Int8Linear runs the Triton kernel for decode rows and tiles for prefill."""
    w = torch.randn(96, 160)
    cpu = Int8Linear.from_float(w, group_size=group_size)
    gpu = Int8Linear(cpu.q.cuda(), cpu.scale.cuda())
    gpu.in_features = cpu.in_features
    assert gpu.kernel.startswith("latentkv triton")
    for rows in (1, 5, 48):
        x = torch.randn(rows, 160)
        got, want = gpu(x.cuda()).cpu().double(), _reference(x, cpu)
        # prefill's tiles may multiply in bfloat16 (matmul_dtype): relative 1e-2
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
