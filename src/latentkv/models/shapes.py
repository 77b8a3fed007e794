"""Every tensor the loader reads, by transformers' name and shape, from config.json alone.

    shapes = checkpoint_shapes(ModelConfig.from_hf("config.json"))
    shapes["model.layers.0.self_attn.kv_b_proj.weight"]     # (H * (P + V), Lkv)

What `latentkv plan` sizes a model by before its weights are downloaded, and what the GGUF
reader names tensors by. Routed experts are listed one by one (`mlp.experts.{e}.gate_proj.weight`,
the layout DeepSeek-V3 and GLM-5 ship); the first MTP layer, when the config declares one, is
layer `num_hidden_layers` with a MoE MLP as both ship it (its copies of the embedding and the
head, which DeepSeek-V3's checkpoint also carries, are never read and not listed).
"""

from __future__ import annotations

import dataclasses

from latentkv.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def checkpoint_shapes(cfg: ModelConfig, mtp: bool = True) -> Shapes:
    """name -> shape of every tensor a model with this config loads (the MTP layer's too when
    `mtp` and the config declares one)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes: Shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg.num_layers):
        shapes.update(_layer(cfg, i, f"model.layers.{i}."))
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    if mtp and cfg.num_mtp_layers >= 1:
        p = f"model.layers.{cfg.num_layers}."
        dsa = dataclasses.replace(cfg.dsa, indexer_types=("full",)) if cfg.dsa is not None else None
        one = dataclasses.replace(cfg, num_layers=1, mlp_layer_types=("sparse",), dsa=dsa, num_mtp_layers=0)
        shapes.update(_layer(one, 0, p))
        shapes.update({p + "enorm.weight": (D,), p + "hnorm.weight": (D,), p + "eh_proj.weight": (D, 2 * D)})
        shapes[p + "shared_head.norm.weight"] = (D,)
    return shapes


def _layer(cfg: ModelConfig, i: int, p: str) -> Shapes:
    D, H = cfg.hidden_size, cfg.num_heads
    P, R, V, Lkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    a = p + "self_attn."
    shapes: Shapes = {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
    projections = {a + "kv_a_proj_with_mqa": (Lkv + R, D), a + "o_proj": (D, H * V)}
    if cfg.q_lora_rank:
        projections[a + "q_a_proj"] = (cfg.q_lora_rank, D)
        shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (H * (P + R), cfg.q_lora_rank)
    else:
        projections[a + "q_proj"] = (H * (P + R), D)
    for name, shape in projections.items():
        shapes[name + ".weight"] = shape
        if cfg.attention_bias:
            shapes[name + ".bias"] = (shape[0],)
    shapes[a + "kv_a_layernorm.weight"] = (Lkv,)
    shapes[a + "kv_b_proj.weight"] = (H * (P + V), Lkv)
    if cfg.dsa is not None and cfg.dsa.indexer_types[i] == "full":
        d, x = cfg.dsa, a + "indexer."
        shapes[x + "wq_b.weight"] = (d.index_n_heads * d.index_head_dim, cfg.q_lora_rank or D)
        shapes[x + "wk.weight"] = (d.index_head_dim, D)
        shapes[x + "k_norm.weight"] = shapes[x + "k_norm.bias"] = (d.index_head_dim,)
        shapes[x + "weights_proj.weight"] = (d.index_n_heads, D)
    m = p + "mlp."
    if cfg.mlp_layer_types[i] == "dense":
        shapes.update(_swiglu(m, D, cfg.intermediate_size))
        return shapes
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    shapes[m + "gate.weight"] = (E, D)
    shapes[m + "gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        shapes.update(_swiglu(f"{m}experts.{e}.", D, I))
    if cfg.n_shared_experts:
        shapes.update(_swiglu(m + "shared_experts.", D, I * cfg.n_shared_experts))
    return shapes


def _swiglu(p: str, D: int, inter: int) -> Shapes:
    return {
        p + "gate_proj.weight": (inter, D),
        p + "up_proj.weight": (inter, D),
        p + "down_proj.weight": (D, inter),
    }
