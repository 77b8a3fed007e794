"""Random checkpoints with real model widths, written without transformers.

The "slice" benchmark model has GLM-5's real attention widths (hidden 6144, 64 heads, q_lora
2048, kv_lora 512, qk_rope 64, qk_nope 192, v_head 256) but only 2 layers and 8 experts, so
one box can hold it twice (ours and transformers') and time both. It is built locally on
first use and never committed. Tensor names are the ones transformers writes, so
transformers loads it as a GlmMoeDsaForCausalLM.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

SLICE_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 16384,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense", "sparse"],
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "indexer_types": ["full", "full"],
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a glm_moe_dsa checkpoint, in transformers' naming; with
    `num_nextn_predict_layers`, the MTP layers after the main stack (DeepSeek-V3's layout)."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", (V, D)
    n_layers = len(cfg["mlp_layer_types"])
    for i, kind in enumerate(cfg["mlp_layer_types"]):
        yield from _layer_shapes(cfg, f"model.layers.{i}.", kind, cfg["indexer_types"][i] == "full")
    for i in range(n_layers, n_layers + int(cfg.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{i}."  # an MoE block with its own indexer, plus the MTP parts
        yield from ((p + n, (D,)) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"))
        yield p + "eh_proj.weight", (D, 2 * D)
        yield from _layer_shapes(cfg, p, "sparse", True)
    yield "model.norm.weight", (D,)
    yield "lm_head.weight", (V, D)


def config_shapes(cfg) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of `cfg` (a ModelConfig) holds, DeepSeek-V3's
    and GLM-5's naming: `models.shapes.checkpoint_shapes` (checked against real checkpoints)."""
    from latentkv.models.shapes import checkpoint_shapes

    return iter(checkpoint_shapes(cfg).items())


def _layer_shapes(cfg: dict, p: str, kind: str, indexer: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """One decoder layer's tensors under the name prefix p."""
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    P, R, Vh = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    Lkv, Lq = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    Di, Hi = cfg["index_head_dim"], cfg["index_n_heads"]
    yield p + "input_layernorm.weight", (D,)
    yield p + "post_attention_layernorm.weight", (D,)
    a = p + "self_attn."
    if Lq:
        yield a + "q_a_proj.weight", (Lq, D)
        yield a + "q_a_layernorm.weight", (Lq,)
        yield a + "q_b_proj.weight", (H * (P + R), Lq)
    else:  # no q-LoRA (DeepSeek-V2-Lite): one query projection
        yield a + "q_proj.weight", (H * (P + R), D)
    yield a + "kv_a_proj_with_mqa.weight", (Lkv + R, D)
    yield a + "kv_a_layernorm.weight", (Lkv,)
    yield a + "kv_b_proj.weight", (H * (P + Vh), Lkv)
    yield a + "o_proj.weight", (D, H * Vh)
    if indexer:
        yield a + "indexer.wq_b.weight", (Hi * Di, Lq)
        yield a + "indexer.wk.weight", (Di, D)
        yield a + "indexer.k_norm.weight", (Di,)
        yield a + "indexer.k_norm.bias", (Di,)
        yield a + "indexer.weights_proj.weight", (Hi, D)
    m = p + "mlp."
    if kind == "dense":
        yield from ((m + n, s) for n, s in _swiglu_shapes(D, cfg["intermediate_size"]))
        return
    E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    yield m + "gate.weight", (E, D)
    yield m + "gate.e_score_correction_bias", (E,)
    for e in range(E):
        yield from ((f"{m}experts.{e}.{n}", s) for n, s in _swiglu_shapes(D, inter))
    yield from ((m + "shared_experts." + n, s) for n, s in _swiglu_shapes(D, inter * cfg["n_shared_experts"]))


def _swiglu_shapes(D: int, inter: int):
    return [
        ("gate_proj.weight", (inter, D)),
        ("up_proj.weight", (inter, D)),
        ("down_proj.weight", (D, inter)),
    ]


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(("bias", "e_score_correction_bias")):
        return torch.zeros(shape)
    return torch.randn(shape, generator=g) * 0.02


def write_random_checkpoint(
    cfg: dict,
    directory: Path,
    seed: int = 0,
    max_shard_bytes: int = 2 << 30,
    exclude: Callable[[str], bool] | None = None,
) -> Path:
    """Write config.json + sharded safetensors (with an index) of random weights; tensors whose
    name `exclude` accepts are left out (e.g. routed experts written to an expert store instead)."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = [(name, shape) for name, shape in _shapes(cfg) if exclude is None or not exclude(name)]
    total = sum(torch.Size(s).numel() for _, s in shapes)
    print(
        f"building a random {cfg['model_type']} checkpoint ({total / 1e9:.2f}B parameters) in {directory}",
        file=sys.stderr,
    )
    plan: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = torch.Size(shape).numel() * 4
        if size + nbytes > max_shard_bytes and plan[-1]:
            plan.append([])
            size = 0
        plan[-1].append((name, shape))
        size += nbytes
    weight_map = {}
    for k, members in enumerate(plan):
        fname = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        shard = {name: _init(name, shape, g) for name, shape in members}
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
        del shard
        print(f"  wrote {fname}", file=sys.stderr)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 4}, "weight_map": weight_map}, indent=1)
    )
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def ensure_slice(root: Path) -> Path:
    directory = root / "slice"
    if not (directory / "config.json").exists():
        write_random_checkpoint(SLICE_CONFIG, directory)
    return directory
