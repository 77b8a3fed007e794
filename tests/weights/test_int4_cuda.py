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


@pytest.mark.parametrize(("out_f", "in_f", "group"), [(64, 128, 64), (128, 256, 32), (192, 512, 128)])
def test_the_host_layout_unpacks_to_the_same_weight(out_f, in_f, group):
    """What a VRAM expert slot receives is the host's packed bytes as they are (this CPU's layout);
    the device unpacks them to portable nibbles before the CUDA op packs them. Unpacked here on the
    CPU, they dequantize to exactly the host weight."""
    from latentkv.weights.int4 import dequantize_int4, unpack_nibbles, unpack_with

    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(out_f + group))
    host = make_linear(w, "int4", group_size=group)
    if host.layout is None:
        pytest.skip("this CPU's int4 op layout is not understood: the host holds portable nibbles")
    nibbles = unpack_with(host.packed, host.layout)[:out_f]
    scale, zero = host.scale_zeros[:, :out_f, 0].t(), host.scale_zeros[:, :out_f, 1].t()
    assert torch.equal(dequantize_int4(unpack_nibbles(nibbles), scale, zero)[:, :in_f], host.dequantize())


@pytest.mark.parametrize(("out_f", "in_f"), [(64, 128), (128, 96), (64, 512)])
def test_to_cuda_layout_converts_in_place_on_the_device(out_f, in_f):
    """The whole conversion, torch's CUDA packing op included (its meta kernel), on the meta device:
    no tensor made on the CPU on the way, and the op's int32 codes fit in the uint8 codes' bytes,
    returned as a view of them (the slot keeps one copy)."""
    from latentkv.weights.int4 import KERNEL_LAYOUT, to_cuda_layout
    from latentkv.weights.int4_cuda import pack_cuda

    slot = torch.empty(4096 + out_f * in_f // 2, dtype=torch.uint8, device="meta")
    packed = slot[4096:].view(out_f, in_f // 2)
    codes = to_cuda_layout(packed, KERNEL_LAYOUT)
    tiles = inner_k_tiles(in_f)
    assert codes.dtype == torch.int32 and tuple(codes.shape) == (
        out_f // 8,
        in_f // (16 * tiles),
        32,
        tiles // 2,
    )
    assert codes.untyped_storage()._cdata == slot.untyped_storage()._cdata  # the same memory
    assert codes.storage_offset() * 4 == 4096
    assert tuple(pack_cuda(torch.empty(out_f, in_f // 2, dtype=torch.uint8, device="meta")).shape) == tuple(
        codes.shape
    )


def test_to_cuda_layout_writes_what_the_conversion_made():
    """With a stand-in for the CUDA op (here: the portable nibbles themselves, as int32 words), the
    bytes of `packed` become the conversion's output, and the view reads it."""
    from latentkv.weights.int4 import KERNEL_LAYOUT, pack_with, to_cuda_layout

    nibbles = torch.randint(0, 256, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_with(nibbles, KERNEL_LAYOUT)
    keep = packed.data_ptr()
    codes = to_cuda_layout(packed, KERNEL_LAYOUT, convert=lambda nib: nib.contiguous().view(torch.int32))
    assert codes.data_ptr() == keep and torch.equal(packed, nibbles)
    assert torch.equal(codes, nibbles.view(torch.int32))
    with pytest.raises(ValueError, match="not in place"):
        to_cuda_layout(packed, KERNEL_LAYOUT, convert=lambda nib: nib[:64].contiguous().view(torch.int32))
