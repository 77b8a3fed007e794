"""Checkpoint -> model: fp8 block-quantized weights, bf16 weights, fused experts, shape and name errors.

Each case rewrites a copy of builtin:tiny and compares the loaded model's logits with a reference
model whose weights were prepared independently (in float64 for the fp8 case).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentkv.models.loader import CheckpointError
from latentkv.models.weights import load_model

FP8_BLOCK = (32, 32)  # small enough that the tiny model has whole and partial tiles
NOT_QUANTIZED = ("model.embed_tokens.weight", "lm_head.weight")  # as in DeepSeek's fp8 releases
FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(FP8_BLOCK),
}


def _write(directory: Path, tensors: dict, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _tiny(tiny_dir: Path) -> tuple[dict, dict]:
    return load_file(tiny_dir / "model.safetensors"), json.loads((tiny_dir / "config.json").read_text())


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return (
        t.dim() == 2
        and name.endswith(".weight")
        and name not in NOT_QUANTIZED
        and not name.endswith("mlp.gate.weight")  # the router stays in high precision
    )


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, model.make_cache(), all_logits=True)


@pytest.fixture(scope="module")
def fp8_pair(tiny_dir, tmp_path_factory, helpers):
    """builtin:tiny with its matrices stored fp8 + weight_scale_inv, and the same weights
    dequantized in float64 (stored f32) as the reference."""
    tensors, config = _tiny(tiny_dir)
    fp8, reference = {}, {}
    for name, t in tensors.items():
        if _quantizable(name, t):
            q, s = helpers.quantize_fp8_blocks(t, FP8_BLOCK)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            reference[name] = helpers.dequantize_reference64(q, s, FP8_BLOCK).float()
        else:
            fp8[name] = reference[name] = t
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir = _write(root / "fp8", fp8, {**config, "quantization_config": FP8_QUANT_CONFIG})
    ref_dir = _write(root / "ref", reference, config)
    return fp8_dir, ref_dir, fp8


def test_fp8_block_quantized_checkpoint_loads_like_its_dequantized_weights(fp8_pair, tiny_dir, helpers):
    fp8_dir, ref_dir, fp8 = fp8_pair
    n_fp8 = sum(t.dtype == torch.float8_e4m3fn for t in fp8.values())
    assert n_fp8 > 50  # attention, indexer, dense MLP and every expert
    ids = helpers.random_ids(30, seed=500)
    got = _logits(load_model(fp8_dir, device="cpu"), ids)
    want = _logits(load_model(ref_dir, device="cpu"), ids)
    assert (got - want).abs().max().item() <= 1e-5
    # And fp8 stays near the original f32 model (3 mantissa bits per weight: a few % per logit).
    original = _logits(load_model(tiny_dir, device="cpu"), ids)
    assert ((got - original).norm() / original.norm()).item() < 0.2


def test_fp8_weight_without_its_scale_is_refused(fp8_pair, tmp_path):
    fp8_dir, _, fp8 = fp8_pair
    config = json.loads((fp8_dir / "config.json").read_text())
    name = "model.layers.2.self_attn.q_b_proj.weight"
    tensors = {k: v for k, v in fp8.items() if k != name.removesuffix("weight") + "weight_scale_inv"}
    with pytest.raises(CheckpointError, match=f"{name} is fp8 but the checkpoint has no .*weight_scale_inv"):
        load_model(_write(tmp_path, tensors, config), device="cpu")


def test_fp8_weights_without_a_block_size_in_the_config_are_refused(fp8_pair, tmp_path):
    fp8_dir, _, fp8 = fp8_pair
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    with pytest.raises(CheckpointError, match="weight_block_size"):
        load_model(_write(tmp_path, fp8, config), device="cpu")


def test_bf16_weights_stay_close_to_f32(ours, tiny_dir, helpers):
    f32, bf16 = ours("glm5-tiny"), load_model(tiny_dir, "bf16", device="cpu")
    assert bf16.blocks[0].attn.w.q_b.dense.dtype == torch.bfloat16
    assert bf16.blocks[3].mlp.experts.get([0])[0].gate_up.dense.dtype == torch.bfloat16
    assert bf16.blocks[0].attn_norm.weight.dtype == torch.float32  # norms stay f32
    ids = helpers.random_ids(64, seed=501)
    a, b = _logits(f32, ids), _logits(bf16, ids)
    assert b.dtype == torch.float32
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.8  # random weights give near-ties; bf16 flips a few of them
    cache = bf16.make_cache()  # and prefill/decode agree within bf16 as well
    stepped = torch.cat([bf16.forward(ids[i : i + 1], cache) for i in range(16)])
    assert (stepped - b[:16]).abs().max().item() < 1e-2


def test_unknown_weight_dtype_is_refused(tiny_dir):
    with pytest.raises(
        ValueError, match="unknown weight format 'fp16'; valid formats: bf16, f32, int4, int8"
    ):
        load_model(tiny_dir, "fp16", device="cpu")


def test_fused_expert_layout_loads_like_per_expert_tensors(tiny_dir, tmp_path, ours, helpers):
    """transformers' in-memory layout: experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I]."""
    tensors, config = _tiny(tiny_dir)
    for layer, kind in enumerate(config["mlp_layer_types"]):
        if kind != "sparse":
            continue
        p = f"model.layers.{layer}.mlp.experts."
        E = config["n_routed_experts"]
        gate_up = [
            torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
            for e in range(E)
        ]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    ids = helpers.random_ids(20, seed=502)
    fused = load_model(_write(tmp_path, tensors, config), device="cpu")
    assert (_logits(fused, ids) - _logits(ours("glm5-tiny"), ids)).abs().max().item() <= 1e-6


def test_mtp_layers_past_num_hidden_layers_are_ignored(tiny_dir, tmp_path, ours, helpers):
    tensors, config = _tiny(tiny_dir)
    n = config["num_hidden_layers"]
    for name in [k for k in tensors if k.startswith("model.layers.4.")]:
        tensors[name.replace("model.layers.4.", f"model.layers.{n}.")] = torch.full_like(tensors[name], 7.0)
    config["num_nextn_predict_layers"] = 1
    ids = helpers.random_ids(12, seed=503)
    model = load_model(_write(tmp_path, tensors, config), device="cpu")
    assert model.cfg.num_mtp_layers == 1
    assert len(model.blocks) == n
    assert (_logits(model, ids) - _logits(ours("glm5-tiny"), ids)).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.indexer.wq_b.weight",
        "model.layers.4.mlp.experts.6.down_proj.weight",
        "model.embed_tokens.weight",
        "model.layers.2.input_layernorm.weight",
    ],
)
def test_a_weight_of_the_wrong_shape_is_named(name, tiny_dir, tmp_path):
    tensors, config = _tiny(tiny_dir)
    good = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(good[0] - 1, *good[1:])
    with pytest.raises(
        CheckpointError,
        match=f"{name} has shape .* but the config implies {good}".replace("(", r"\(").replace(")", r"\)"),
    ):
        load_model(_write(tmp_path, tensors, config), device="cpu")


def test_a_config_that_does_not_fit_the_weights_names_a_mismatched_tensor(tiny_dir, tmp_path):
    tensors, config = _tiny(tiny_dir)
    config["kv_lora_rank"] = 16
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.\S+ has shape .* is config.json the one"
    ):
        load_model(_write(tmp_path, tensors, config), device="cpu")


def test_a_missing_weight_is_named(tiny_dir, tmp_path):
    tensors, config = _tiny(tiny_dir)
    del tensors["model.layers.4.mlp.experts.7.up_proj.weight"]
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.4.mlp.experts.7.up_proj.weight'"):
        load_model(_write(tmp_path, tensors, config), device="cpu")
