"""Checkpoint reading: single file and shards, mmap-backed views, damaged files, fp8 block dequant."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentkv.models.loader import Checkpoint, CheckpointError, dequantize_fp8_blocks, own_pages


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(11, dtype=torch.int64),
        "d.half": torch.randn(2, 3, 4, generator=g).half(),
        "e.empty": torch.empty(0, 4),
        "f.fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "g.mask": torch.tensor([True, False, True]),
    }


def _write_sharded(directory, tensors: dict, groups: list[list[str]]) -> None:
    weight_map = {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _assert_same(ckpt: Checkpoint, tensors: dict) -> None:
    assert set(ckpt.keys()) == set(tensors)
    for name, want in tensors.items():
        got = ckpt.get(name)
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert ckpt.shape(name) == list(want.shape)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name  # bit-exact, fp8 too
        assert name in ckpt


def test_single_file_loads_every_dtype_bit_exactly(tmp_path, tensors):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _assert_same(Checkpoint(tmp_path), tensors)


def test_sharded_checkpoint_loads_the_same_tensors_as_one_file(tmp_path, tensors):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    save_file(tensors, str(single / "model.safetensors"))
    names = sorted(tensors)
    _write_sharded(sharded, tensors, [names[:2], names[2:5], names[5:]])
    one, many = Checkpoint(single), Checkpoint(sharded)
    _assert_same(many, tensors)
    for name in tensors:
        assert torch.equal(one.get(name).view(torch.uint8), many.get(name).view(torch.uint8))
    assert one.fingerprint() != many.fingerprint()
    assert many.fingerprint() == Checkpoint(sharded).fingerprint()


def test_a_directory_of_safetensors_without_an_index_is_read_whole(tmp_path, tensors):
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:3]}, str(tmp_path / "part-a.safetensors"))
    save_file({n: tensors[n] for n in names[3:]}, str(tmp_path / "part-b.safetensors"))
    _assert_same(Checkpoint(tmp_path), tensors)


def test_tensors_are_views_of_one_mapping_of_the_file(tmp_path):
    """Two tensors of one file sit exactly as far apart in memory as in the file: both are views of
    one mapping, not copies. Reading a tensor twice gives the same memory."""
    path = tmp_path / "model.safetensors"
    save_file({"x": torch.randn(64, 64), "y": torch.randn(32, 16)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    ckpt = Checkpoint(tmp_path)
    x, y = ckpt.get("x"), ckpt.get("y")
    file_gap = header["y"]["data_offsets"][0] - header["x"]["data_offsets"][0]
    assert y.data_ptr() - x.data_ptr() == file_gap
    assert ckpt.get("x").data_ptr() == x.data_ptr()


def test_writing_to_a_loaded_tensor_never_touches_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    original = torch.randn(16, 8)
    save_file({"w": original}, str(path))
    before = path.read_bytes()
    t = Checkpoint(tmp_path).get("w")
    t.mul_(0)  # copy-on-write: a private page, not the file
    assert path.read_bytes() == before
    assert torch.equal(Checkpoint(tmp_path).get("w"), original)


def test_owned_pages_no_longer_follow_the_file(tmp_path):
    """own_pages gives a view's pages a private copy: the file rewritten in place afterwards (what
    the kernel's dropping and re-reading a page cache page amounts to) no longer shows through,
    while a view left alone (the control) does. Values and addresses are unchanged."""
    path = tmp_path / "model.safetensors"
    a, b = torch.randn(3000, 7), torch.randn(5000)  # several pages each, not page-aligned
    save_file({"a": a, "b": b}, str(path))
    owned, left = Checkpoint(tmp_path), Checkpoint(tmp_path)
    ta, tb = owned.get("a"), owned.get("b")
    ptr = ta.data_ptr()
    assert own_pages([ta, tb, ta[1:]]) == ta.numel() * 4 + tb.numel() * 4
    control = left.get("b")
    assert ta.data_ptr() == ptr and torch.equal(ta, a) and torch.equal(tb, b)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    with open(path, "r+b") as fh:  # every data byte changed, the header kept
        fh.seek(8 + n)
        fh.write(bytes(x ^ 0x55 for x in raw[8 + n :]))
    assert torch.equal(ta, a) and torch.equal(tb, b)
    assert not torch.equal(control, b)


# --- damaged checkpoints ----------------------------------------------------------------------


def _valid_file(path, tensors=None) -> bytes:
    save_file(tensors or {"w": torch.randn(8, 8), "b": torch.randn(8)}, str(path))
    return path.read_bytes()


def _header_file(path, header, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_truncated_file_names_the_file_and_the_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    raw = _valid_file(path)
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match="lies outside the file") as err:
        Checkpoint(tmp_path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("size", [0, 5])
def test_file_too_short_for_a_header(tmp_path, size):
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * size)
    with pytest.raises(CheckpointError, match="too short"):
        Checkpoint(tmp_path)


def test_implausible_header_length(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="implausible"):
        Checkpoint(tmp_path)


def test_header_that_is_not_json(tmp_path):
    blob = b"{this is not json}"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        Checkpoint(tmp_path)


def test_header_length_past_the_end_of_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    raw = _valid_file(path)
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(struct.pack("<Q", n + 10_000) + raw[8:])
    with pytest.raises(CheckpointError):
        Checkpoint(tmp_path)


def test_unsupported_dtype(tmp_path):
    _header_file(
        tmp_path / "model.safetensors",
        {"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
        b"\0" * 8,
    )
    with pytest.raises(CheckpointError, match="unsupported dtype C64"):
        Checkpoint(tmp_path)


def test_header_that_is_json_but_not_an_object(tmp_path):
    _header_file(tmp_path / "model.safetensors", ["w", "b"])
    with pytest.raises(CheckpointError):
        Checkpoint(tmp_path)


def test_tensor_entry_without_offsets(tmp_path):
    _header_file(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match="w"):
        Checkpoint(tmp_path)


def test_tensor_whose_bytes_do_not_match_its_shape(tmp_path):
    _header_file(
        tmp_path / "model.safetensors",
        {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}},
        b"\0" * 32,
    )
    with pytest.raises(CheckpointError, match="w"):
        Checkpoint(tmp_path).get("w")


def test_missing_shard_is_named(tmp_path, tensors):
    names = sorted(tensors)
    _write_sharded(tmp_path, tensors, [names[:3], names[3:]])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00002.safetensors"):
        Checkpoint(tmp_path)


def test_unreadable_shard_index(tmp_path, tensors):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="unreadable shard index"):
        Checkpoint(tmp_path)


def test_a_tensor_in_two_shards_is_refused(tmp_path, tensors):
    names = sorted(tensors)
    _write_sharded(tmp_path, tensors, [names[:3], names[2:]])
    with pytest.raises(CheckpointError, match=f"tensor {names[2]} appears in both"):
        Checkpoint(tmp_path)


def test_no_weights_at_all(tmp_path):
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        Checkpoint(tmp_path)


def test_asking_for_a_missing_tensor_names_it(tmp_path, tensors):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no tensor 'nope.weight'"):
        Checkpoint(tmp_path).get("nope.weight")


# --- fp8 block dequantization ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((256, 384), (128, 128)),  # whole tiles
        ((300, 200), (128, 128)),  # partial last tiles on both axes
        ((40, 128), (32, 32)),  # partial rows only
        ((7, 5), (4, 2)),  # tiny, partial both
    ],
)
def test_dequantize_fp8_blocks_against_float64(shape, block, helpers):
    g = torch.Generator().manual_seed(sum(shape))
    # Tiles of very different magnitudes so a wrong scale-to-tile mapping cannot hide.
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]
    q, s = helpers.quantize_fp8_blocks(w, block)
    got = dequantize_fp8_blocks(q, s, block)
    assert got.dtype == torch.float32
    want = helpers.dequantize_reference64(q, s, block)
    torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=0)
    # And it is the weight back, to fp8's precision (3 mantissa bits: relative error <= 1/16).
    err = (got - w).abs()
    assert (err <= w.abs() / 16 + s.max() * 2**-9).all()


def test_dequantize_fp8_blocks_refuses_a_scale_grid_of_the_wrong_shape(helpers):
    q, s = helpers.quantize_fp8_blocks(torch.randn(300, 200), (128, 128))
    assert s.shape == (3, 2)
    with pytest.raises(CheckpointError, match=r"weight_scale_inv has shape \(2, 2\), expected \(3, 2\)"):
        dequantize_fp8_blocks(q, s[:2], (128, 128))


def test_saved_and_reloaded_fp8_round_trips(tmp_path, helpers):
    q, s = helpers.quantize_fp8_blocks(torch.randn(70, 50), (32, 32))
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    got = dequantize_fp8_blocks(ckpt.get("w.weight"), ckpt.get("w.weight_scale_inv"), (32, 32))
    assert torch.equal(got, dequantize_fp8_blocks(q, s, (32, 32)))
    assert torch.equal(
        load_file(tmp_path / "model.safetensors")["w.weight"].view(torch.uint8), q.view(torch.uint8)
    )
