"""int4 weights on a CUDA device: the layout conversion here on CPU tensors; the rest (packing,
the product, reading a weight back) needs a CUDA device and is skipped without one."""

from __future__ import annotations

import pytest
import torch

from latentkv.weights.base import make_linear
from latentkv.weights.int4 import Int4Linear, pack_nibbles
from latentkv.weights.int4_cuda import cuda_nibbles, inner_k_tiles


def test_cuda_nibbles_put_the_even_column_high():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8)  # [out, in] codes
    assert pack_nibbles(q).tolist() == [[0x21, 0x43], [0x0F, 0x78]]  # portable: even column low
    assert cuda_nibbles(pack_nibbles(q)).tolist() == [[0x12, 0x34], [0xF0, 0x87]]  # CUDA: even column high


def test_inner_k_tiles_widest_that_divides():
    assert [inner_k_tiles(k) for k in (128, 256, 64, 192, 32, 96)] == [8, 8, 4, 4, 2, 2]
    with pytest.raises(ValueError, match="multiple of 32"):
        inner_k_tiles(48)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


@needs_cuda
@pytest.mark.parametrize(("out_f", "in_f", "group"), [(48, 128, 64), (20, 96, 32), (64, 512, 128)])
def test_cuda_int4_matches_its_dequantized_reference(out_f, in_f, group):
    gen = torch.Generator().manual_seed(out_f)
    w = torch.randn(out_f, in_f, generator=gen)
    cpu = make_linear(w, "int4", group_size=group)
    state = Int4Linear.quantize_state(w, group_size=group)  # the file's pieces, moved to the GPU
    gpu = Int4Linear.from_state({k: v.cuda() for k, v in state.items()}, in_f)
    assert isinstance(gpu, Int4Linear) and gpu.packed.is_cuda
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())  # the same weight, read back exactly
    x = torch.randn(5, in_f, generator=gen)
    ref = x.to(torch.bfloat16).double() @ cpu.dequantize().double().T
    got = gpu(x.cuda()).double().cpu()
    assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
