"""`latentkv convert`: the converted checkpoint holds the same quantized matrices the loader makes
from the original (bit for bit: loaded without re-quantizing), one extent per expert, a manifest
that names formats and the source, and clear refusals."""

import json
import struct
import subprocess
import sys

import pytest
import torch

from latentkv.models.convert import MANIFEST, convert
from latentkv.models.loader import Checkpoint, CheckpointError
from latentkv.models.weights import load_model


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "tiny-int4"
    convert(tiny_dir, out, "int4", "int4", progress=False)
    return out


def _sparse_block(model):
    return next(b for b in model.blocks if hasattr(b.mlp, "experts"))


def test_converted_matrices_are_the_loaders_own_bit_for_bit(tiny_dir, converted):
    original, loaded = load_model(tiny_dir, "int4", device="cpu"), load_model(converted, "int4", device="cpu")
    for a, b in zip(original.blocks, loaded.blocks, strict=True):
        assert torch.equal(a.w_in.packed, b.w_in.packed) and torch.equal(
            a.w_in.scale_zeros, b.w_in.scale_zeros
        )
        assert torch.equal(a.attn.w.o.packed, b.attn.w.o.packed)
    ea, eb = _sparse_block(original).mlp.experts.experts, _sparse_block(loaded).mlp.experts.experts
    for x, y in zip(ea, eb, strict=True):
        assert torch.equal(x.gate_up.packed, y.gate_up.packed) and torch.equal(x.down.packed, y.down.packed)
        assert torch.equal(x.gate_up.scale_zeros, y.gate_up.scale_zeros)
    # the rest (q_b, kv_b, router, norms) kept in the source's dtype: the same model, exactly
    ids = torch.randint(2, 250, (24,), generator=torch.Generator().manual_seed(1))
    la = original.forward(ids, original.make_cache(), all_logits=True)
    lb = loaded.forward(ids, loaded.make_cache(), all_logits=True)
    assert torch.equal(la, lb)


def test_manifest_names_formats_source_and_expert_extents(tiny_dir, converted):
    manifest = json.loads((converted / MANIFEST).read_text())
    assert manifest["format"] == "latentkv-weights" and manifest["version"] == 1
    assert (manifest["weight_dtype"], manifest["expert_dtype"]) == ("int4", "int4")
    assert manifest["source_fingerprint"] == Checkpoint(tiny_dir).fingerprint()
    raw = (converted / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for layer, extents in manifest["experts"].items():
        assert len(extents) == 8
        for e, (start, end) in enumerate(extents):
            own = [v for k, v in header.items() if k.startswith(f"{layer}.experts.{e}.")]
            assert len(own) == 3 * 3  # gate, up, down x (nibbles, scale, zero)
            spans = sorted((8 + n + a, 8 + n + b) for a, b in (v["data_offsets"] for v in own))
            assert spans[0][0] == start and spans[-1][1] == end  # one extent, nothing else inside
            assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def test_a_converted_model_loads_only_in_its_formats(converted):
    with pytest.raises(CheckpointError, match="converted to int4 weights and int4 experts"):
        load_model(converted, "int8", device="cpu")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "latentkv", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_refuses_bad_inputs_in_one_line(tmp_path, converted):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    for args in (
        ["builtin:tiny", str(tmp_path / "busy"), "--weight-dtype", "int4"],
        ["no/such/model", str(tmp_path / "new"), "--weight-dtype", "int4"],
        [str(converted), str(tmp_path / "again"), "--weight-dtype", "int4"],
        ["builtin:tiny", str(tmp_path / "new"), "--weight-dtype", "int3"],
    ):
        out = _cli("convert", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
