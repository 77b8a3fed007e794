"""Weight formats against their references: each format's matmul vs its own dequantized matrix
(in float64), and the f32 format bit for bit against the helper the model used before formats."""

import pytest
import torch
import torch.nn.functional as F

from latentkv.weights import FORMATS, Linear, make_linear
from latentkv.weights.base import format_class


def _old_linear(x, weight, bias=None):
    """The model's matmul before the Linear seam (models/layers.py `linear`), verbatim."""
    if x.dtype != weight.dtype:
        return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    return F.linear(x, weight, bias)


def _old_linear_add(residual, x, weight_t):
    """models/layers.py `linear_add` before the seam, verbatim."""
    if x.dtype != weight_t.dtype:
        out = (x.to(weight_t.dtype) @ weight_t).to(x.dtype)
        return out if residual is None else residual + out
    return torch.mm(x, weight_t) if residual is None else torch.addmm(residual, x, weight_t)


# the tolerance of each format's product against float64 over its own dequantized matrix
TOLERANCE = {"f32": 1e-5, "bf16": 2e-2}


@pytest.mark.parametrize("fmt", sorted(TOLERANCE))
@pytest.mark.parametrize("bias", [False, True])
def test_format_matches_its_dequantized_reference(fmt, bias):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    lin = make_linear(w, fmt, bias=b)
    assert isinstance(lin, Linear) and lin.format == fmt
    assert (lin.out_features, lin.in_features) == (48, 64)
    x = torch.randn(5, 64, generator=g)
    ref = x.double() @ lin.dequantize().double().T
    if b is not None:
        ref = ref + lin.bias.double()
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (5, 48)
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < TOLERANCE[fmt], err
    residual = torch.randn(5, 48, generator=g)
    if b is None:
        torch.testing.assert_close(lin.add_to(residual, x), residual + y, rtol=1e-5, atol=1e-5)
    # dequantize is the stored matrix read back: bf16 rounds, f32 is exact
    deq = lin.dequantize()
    assert deq.dtype == torch.float32 and deq.shape == (48, 64)
    assert (deq - w).abs().max() <= (0 if fmt == "f32" else 2**-7 * w.abs().max())


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_dense_formats_compute_exactly_as_before(fmt):
    """The f32 and bf16 formats run the same ops as the old helper: bit-identical results."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 32, generator=g)
    b = torch.randn(40, generator=g)
    x = torch.randn(3, 32, generator=g)
    residual = torch.randn(3, 40, generator=g)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[fmt]
    stored = w.to(dtype)
    lin = make_linear(w, fmt)
    assert torch.equal(lin(x), _old_linear(x, stored))
    assert torch.equal(make_linear(w, fmt, bias=b)(x), _old_linear(x, stored, b.to(dtype)))
    assert torch.equal(lin.add_to(residual, x), _old_linear_add(residual, x, stored.T))
    assert torch.equal(lin.add_to(None, x), _old_linear_add(None, x, stored.T))
    assert lin.nbytes == w.numel() * stored.element_size()


def test_f32_keeps_the_tensor_it_is_given():
    w = torch.randn(4, 3)
    assert make_linear(w, "f32").dense is w  # no copy: a tied lm_head shares the embedding


def test_unknown_format_lists_the_valid_names():
    with pytest.raises(ValueError, match="valid formats: .*bf16.*f32"):
        make_linear(torch.zeros(2, 2), "int3")
    with pytest.raises(ValueError, match="takes no parameters"):
        make_linear(torch.zeros(2, 2), "f32", group_size=32)
    assert format_class("f32") is FORMATS["f32"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_linear_add_against_float64(dtype, with_residual):
    g = torch.Generator().manual_seed(3)
    x, w, r = (
        torch.randn(1, 24, generator=g),
        torch.randn(16, 24, generator=g),
        torch.randn(1, 16, generator=g),
    )
    w = w.to(dtype)
    fmt = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    got = make_linear(w, fmt).add_to(r if with_residual else None, x)
    want = x.double() @ w.double().T + (r.double() if with_residual else 0)
    assert got.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
