"""The native block encoder (native/kv_blocks.cpp) against the torch encoder it replaces on
the CPU: q8_0, q4_0, q8s and q4s write the same bytes either way, on fresh random rows of every
block size and of scales from fp16's subnormals to past its range, with inert rows."""

from __future__ import annotations

import pytest
import torch

from latentkv import native
from latentkv.kv.codecs import blocks as block_codecs
from latentkv.kv.codecs import get_codec

NAMES = ("q8_0", "q4_0", "q8s", "q4s")

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason="latentkv's native kernels are not built here"
)


def rows(width: int, seed: int) -> torch.Tensor:
    """Rows at scales from 1e-9 (fp16-subnormal block scales) to 1e9 (scales past fp16: inert
    blocks), with an outlier channel, zero runs, a zero row, a NaN row and an infinite row."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-9, 1e-6, 3e-5, 1e-3, 0.1, 1.0, 7.0, 1e3, 6e4, 1e6, 1e7, 1e9])
    x = torch.randn(len(scales) * 40, width, generator=g) * scales.repeat_interleave(40)[:, None]
    x[:, width // 3] *= 9.0
    x[::7, ::3] = 0.0
    x[5] = 0.0
    x[11, width - 1] = float("nan")
    x[13, 0] = float("-inf")
    return x


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("width", (8, 16, 32, 64, 96, 512))
def test_native_bytes_equal_the_torch_encoder(name, width):
    codec = get_codec(name, width)
    x = rows(width, seed=width * 31 + len(name))
    native_codes = codec.encode(x).codes
    reference = codec.encode_reference(x).codes
    assert native_codes.shape == reference.shape == (x.shape[0], codec.code_bytes)
    assert torch.equal(native_codes, reference)
    assert not native_codes[11].any() and not native_codes[13].any()  # non-finite rows: inert
    decoded = codec.decode(codec.encode(x[20:200]))  # finite rows decode close to what they were
    assert (decoded - x[20:200]).abs().max() <= 0.2 * x[20:200].abs().max()


def test_encode_takes_the_native_path_and_falls_back_without_it(monkeypatch):
    codec = get_codec("q4s", 64)
    x = rows(64, seed=3)
    calls = []
    real = torch.ops.latentkv.encode_blocks

    class Spy:
        def __call__(self, *args):
            calls.append(args[1:])
            return real(*args)

    monkeypatch.setattr(torch.ops.latentkv, "encode_blocks", Spy())
    fast = codec.encode(x).codes
    assert calls == [(3, 32)]  # q4s, blocks of 32
    monkeypatch.setattr(native, "kernels", lambda: None)  # a machine without a C++ compiler
    assert block_codecs.native_encode("q4s", x, 32) is None
    assert torch.equal(codec.encode(x).codes, fast) and len(calls) == 1


def test_other_codecs_and_devices_keep_the_torch_encoder():
    x = torch.randn(4, 64)
    assert block_codecs.native_encode("q5_0", x, 32) is None
    assert block_codecs.native_encode("wq4", x, 32) is None
    assert block_codecs.native_encode("q8s", x.to("meta"), 32) is None


def test_the_op_refuses_bad_input():
    with pytest.raises(RuntimeError, match="whole blocks"):
        torch.ops.latentkv.encode_blocks(torch.zeros(2, 40), 0, 32)
    with pytest.raises(RuntimeError, match="unknown kind"):
        torch.ops.latentkv.encode_blocks(torch.zeros(2, 64), 9, 32)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.latentkv.encode_blocks(torch.zeros(2, 64, dtype=torch.float64), 0, 32)
