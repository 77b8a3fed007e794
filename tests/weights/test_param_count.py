"""The parameter count (the load line, bench rows) is the model's, not its storage's: the same in
every weight format, and equal to the checkpoint's own tensor count."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from latentkv.models.weights import load_model


def _checkpoint_count(directory) -> int:
    return sum(t.numel() for t in load_file(directory / "model.safetensors").values())


@pytest.mark.parametrize(
    ("weights", "experts"), [("f32", None), ("bf16", None), ("int8", None), ("int4", None), ("bf16", "int4")]
)
def test_count_does_not_depend_on_the_format(tiny_dir, weights, experts):
    model = load_model(tiny_dir, weights, expert_dtype=experts, device="cpu")
    assert model.num_parameters() == _checkpoint_count(tiny_dir)


@pytest.mark.parametrize("fmt", ["f32", "int8", "int4"])
def test_a_tied_head_is_counted_once(tiny_dir, tmp_path, fmt):
    """Without lm_head.weight and with tied embeddings, the head is the embedding's weights (f32
    shares the tensor; a packed head is a separate copy that must not count twice)."""
    for f in tiny_dir.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tiny_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = load_model(tmp_path, fmt, device="cpu")
    assert model.num_parameters() == sum(t.numel() for t in tensors.values())


def test_weight_bytes_follow_the_format(tiny_dir):
    """f32: four bytes per parameter exactly; each packed format smaller than the one above it."""
    size = {
        fmt: load_model(tiny_dir, fmt, device="cpu").weight_bytes() for fmt in ("f32", "bf16", "int8", "int4")
    }
    assert size["f32"] == 4 * _checkpoint_count(tiny_dir)
    assert size["f32"] > size["bf16"] > size["int8"] > size["int4"], size
