"""int4 experts are stored in the packed layout of the writing process (latentkv's kernel's, or the
CPU's int4 op's; so a read expert is used as read), with that layout named in the extent's
params; a process that packs differently repacks them when reading. Checked on fresh random weights against the portable nibbles and against the
Linear the store was written from (its product on the same input, exactly)."""

from __future__ import annotations

import pytest
import torch

from latentkv.experts import extent as extent_mod
from latentkv.experts.base import Expert
from latentkv.weights import int4
from latentkv.weights.int4 import Int4Linear, pack_nibbles, pack_with, unpack_with


def _layouts() -> list[int4.Layout]:
    """Synthetic layouts: consecutive halves, interleaved rows, a scrambled permutation, and
    this CPU's own."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(32, generator=g)
    found = [
        (16, slice(0, 8), slice(8, 16)),
        (8, torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])),
        (32, perm[:16], perm[16:]),
    ]
    for own in (int4.layout(), int4.op_layout()):
        if own is not None:
            found.append(own)
    return found


@pytest.mark.parametrize("layout", _layouts(), ids=lambda x: f"block{x[0]}" if isinstance(x, tuple) else None)
def test_pack_with_and_unpack_with_are_inverse(layout):
    block = layout[0]
    q = torch.randint(0, 16, (4 * block, 96), dtype=torch.uint8)
    nibbles = pack_nibbles(q)
    packed = pack_with(nibbles, layout)
    assert packed.shape == nibbles.shape and packed.dtype == torch.uint8
    assert torch.equal(unpack_with(packed, layout), nibbles)
    assert int4.same_layout(int4.layout_from_spec(int4.layout_spec(layout)), layout)


def test_this_cpus_layout_is_the_ops_layout():
    layout = int4.op_layout()
    if layout is None:
        pytest.skip("this CPU's int4 layout is not understood: stores keep portable nibbles")
    q = torch.randint(0, 16, (2 * layout[0], 128), dtype=torch.uint8)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(unpack_with(want, layout), pack_nibbles(q))


@pytest.mark.parametrize(
    "spec",
    [{"block": 4, "low": [0, 1], "high": [1, 3]}, {"block": 3, "low": [0], "high": [1]}, {"low": []}, [1]],
)
def test_a_bad_layout_spec_is_refused(spec):
    with pytest.raises(ValueError, match="not an int4 packed layout"):
        int4.layout_from_spec(spec)


def _linear(out_f: int, in_f: int, bias: bool) -> Int4Linear:
    w = torch.randn(out_f, in_f) * 0.05 + 0.01 * torch.randn(out_f, 1)
    return Int4Linear.from_float(w, torch.randn(out_f) if bias else None, group_size=32)


@pytest.mark.parametrize(("out_f", "in_f", "bias"), [(128, 64, False), (72, 80, True)])
def test_raw_tensors_rebuild_the_same_linear_without_a_copy(out_f, in_f, bias, decode_kernels):
    lin = _linear(out_f, in_f, bias)
    params, raw = extent_mod._int4_to_raw(lin)
    if lin.layout is None or lin._out_padded % lin.layout[0]:
        assert "nibbles" in raw  # the portable form
    else:
        assert set(raw) - {"bias"} == {"packed", "scale_zeros"} and "layout" in params
    back = extent_mod._int4_from_raw("int4", params, raw)
    x = torch.randn(3, in_f)
    assert torch.equal(back(x), lin(x))
    if "packed" in raw:
        assert back.packed.data_ptr() == raw["packed"].data_ptr()  # used as read


@pytest.mark.parametrize("layout", _layouts()[:3], ids=["halves", "interleaved", "scrambled"])
def test_a_store_from_a_cpu_with_another_layout_is_repacked(layout, decode_kernels):
    """Bytes packed in a foreign layout (as an extent written on another CPU holds them) give
    this CPU's Linear: the same product as the Linear they were packed from."""
    lin = _linear(256, 64, bias=True)
    nibbles, _scale, _zero = lin.nibbles()
    raw = {"packed": pack_with(nibbles, layout), "scale_zeros": lin.scale_zeros, "bias": lin.bias}
    params = {"in_features": 64, "out_features": 256, "layout": int4.layout_spec(layout)}
    back = extent_mod._int4_from_raw("int4", params, raw)
    x = torch.randn(5, 64)
    assert torch.equal(back.packed, lin.packed)
    assert torch.equal(back(x), lin(x))


def test_an_int4_expert_round_trips_through_a_store(tmp_path):
    from latentkv.experts.reader import ExpertReader
    from latentkv.streaming.convert import write_store

    experts = [Expert(_linear(64, 48, False), _linear(48, 32, False)) for _ in range(3)]
    write_store(tmp_path, "f" * 64, [(1, 3, lambda e: experts[e])])
    with ExpertReader(tmp_path, "f" * 64) as reader:
        for e, want in enumerate(experts):
            got = extent_mod.expert_from_extent(reader.read(1, e))
            for part in ("gate_up", "down"):
                x = torch.randn(2, getattr(want, part).in_features)
                assert torch.equal(getattr(got, part)(x), getattr(want, part)(x))


@pytest.mark.parametrize("packed", [True, False])
def test_portable_pieces_from_either_form(packed, monkeypatch):
    """What tools read from a store (the twin's converter): the writer's own nibbles, scales
    and zeros, whichever form the extent holds."""
    lin = _linear(120, 64, bias=False)  # 120 rows: padded to 128 in the packed form
    if not packed:
        monkeypatch.setattr(lin, "layout", None)
    params, raw = extent_mod._int4_to_raw(lin)
    assert ("packed" in raw) == packed or int4.layout() is None
    nibbles, scale, zero = extent_mod.int4_portable(params, raw)
    want = lin.nibbles()
    for got, ref in zip((nibbles, scale, zero), want, strict=True):
        assert torch.equal(got, ref)


def test_float32_scales_survive_the_extent():
    """An int4 weight with float32 scales and zeros (GGUF's Q4 blocks) keeps them through an
    expert's raw tensors: rebuilt over a flat buffer it is the same weight. (In the packed form
    only the bfloat16 scale_zeros travelled: the zeros were lost, an error of ~1.)"""
    from latentkv.experts.extent import expert_from_views, expert_layout, flat_view
    from latentkv.weights.int4 import quantize_int4

    g = torch.Generator().manual_seed(3)

    def wide(out_f: int, in_f: int) -> Int4Linear:
        q, scale, zero = quantize_int4(torch.randn(out_f, in_f, generator=g), 32)
        return Int4Linear(pack_nibbles(q), scale.float() * 1.0001, zero.float() + 1e-3, in_f)

    expert = Expert(wide(128, 64), wide(64, 64))
    layout, raws = expert_layout(expert)
    buffer = torch.empty(layout.length, dtype=torch.uint8)
    for t, raw in zip(layout.tensors, raws, strict=True):
        flat_view(buffer, layout, t.name).copy_(raw)
    back = expert_from_views(layout, lambda name: flat_view(buffer, layout, name))
    x = torch.randn(3, 64, generator=g)
    for part in ("gate_up", "down"):
        want, got = getattr(expert, part), getattr(back, part)
        assert torch.equal(got.dequantize(), want.dequantize())
        assert torch.equal(got(x), want(x))
