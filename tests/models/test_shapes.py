"""checkpoint_shapes (config.json alone) against the tensors real checkpoints hold."""

from __future__ import annotations

import pytest

from latentkv.config import ModelConfig
from latentkv.eval import oracle
from latentkv.models.loader import Checkpoint
from latentkv.models.registry import builtin_path
from latentkv.models.shapes import checkpoint_shapes


def held_shapes(directory) -> dict[str, tuple[int, ...]]:
    """The checkpoint's own names and shapes, transformers' fused experts listed one by one."""
    ckpt = Checkpoint(directory)
    shapes = {}
    for name in ckpt.keys():  # noqa: SIM118
        shape = tuple(ckpt.shape(name))
        if name.endswith("experts.gate_up_proj"):
            head = name.removesuffix("gate_up_proj")
            E, two_i, D = shape
            for e in range(E):
                shapes[f"{head}{e}.gate_proj.weight"] = shapes[f"{head}{e}.up_proj.weight"] = (two_i // 2, D)
        elif name.endswith("experts.down_proj"):
            head = name.removesuffix("down_proj")
            for e in range(shape[0]):
                shapes[f"{head}{e}.down_proj.weight"] = shape[1:]
        else:
            shapes[name] = shape
    return shapes


@pytest.mark.parametrize("name", ["builtin:fixture", *oracle.SPECS])
def test_the_config_names_every_tensor_the_checkpoint_holds(name, checkpoint):
    directory = builtin_path("fixture") if name == "builtin:fixture" else checkpoint(name)
    cfg = ModelConfig.from_hf(directory)
    expected = checkpoint_shapes(cfg)
    held = held_shapes(directory)
    if not any(k.startswith(f"model.layers.{cfg.num_layers}.") for k in held):
        expected = checkpoint_shapes(cfg, mtp=False)  # a config that declares MTP, weights without it
    assert held == expected


def test_tied_embeddings_and_attention_biases_change_the_list(tiny_dir):
    import dataclasses

    cfg = ModelConfig.from_hf(tiny_dir)
    base = checkpoint_shapes(cfg)
    tied = checkpoint_shapes(dataclasses.replace(cfg, tie_word_embeddings=True))
    assert set(base) - set(tied) == {"lm_head.weight"}
    biased = checkpoint_shapes(dataclasses.replace(cfg, attention_bias=True))
    extra = set(biased) - set(base)
    assert extra == {
        f"model.layers.{i}.self_attn.{p}.bias"
        for i in range(cfg.num_layers)
        for p in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
    }
