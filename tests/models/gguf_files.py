"""GGUF files for the tests, written with the `gguf` package from our checkpoints.

Names come from gguf's own tensor map (`get_tensor_name_map`), metadata from GGUFWriter's
`add_*` calls as llama.cpp's converter makes them (conversion/deepseek.py), MLA's kv_b split
into attn_k_b (transposed per head) and attn_v_b as that converter splits it, experts stacked per
layer. Quantized types the gguf package can encode (Q8_0, Q4_0, Q4_1, Q5_0, F16, BF16) go through
`gguf.quants.quantize`; Q4_K and Q6_K through the plain encoders below, which round to the
nearest code under a max-abs scale (valid blocks, not llama.cpp's searched ones).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import numpy as np
import torch

from latentkv.config import ModelConfig
from latentkv.models.loader import Checkpoint

ARCH = {"glm_moe_dsa": "glm-dsa", "deepseek_v3": "deepseek2", "deepseek_v32": "deepseek32"}


def gguf_tensors(directory: Path) -> dict[str, np.ndarray]:
    """A checkpoint's float32 tensors under llama.cpp's names, in its layout."""

    cfg = ModelConfig.from_hf(directory)
    names = _name_map(cfg)
    ckpt = Checkpoint(directory)
    out: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[int, np.ndarray]] = {}
    H, P, V = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name in ckpt.keys():  # noqa: SIM118
        t = ckpt.get(name).float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        parts = name.split(".")
        if ".mlp.experts." in name and parts[5].isdigit():  # one expert's own tensor: stacked below
            kind = parts[6].removesuffix("_proj")
            per_expert.setdefault(f"blk.{layer}.ffn_{kind}_exps.weight", {})[int(parts[5])] = t
        elif name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = t[:, :inter]
            out[f"blk.{layer}.ffn_up_exps.weight"] = t[:, inter:]
        elif name.endswith("experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = t
        elif name.endswith("e_score_correction_bias"):
            out[f"blk.{layer}.exp_probs_b.bias"] = t  # the converter's rename
        elif name.endswith("kv_b_proj.weight"):
            kv = t.reshape(H, P + V, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv[:, :P].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv[:, P:])
        else:
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert mapped is not None, name
            out[mapped] = t
    for name, experts in per_expert.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def _name_map(cfg: ModelConfig):
    """gguf's tensor name map; GLM-5's has the DSA indexer's names, which DeepSeek-V3.2 shares."""
    import gguf

    arch = gguf.MODEL_ARCH.DEEPSEEK2 if cfg.dsa is None else gguf.MODEL_ARCH.GLM_DSA
    return gguf.get_tensor_name_map(arch, cfg.num_layers + cfg.num_mtp_layers)


def write_gguf(
    directory: Path,
    out: Path,
    types: dict[str, str],
    chat_template: str | None = None,
    split_max_tensors: int = 0,
    arch: str | None = None,
) -> Path:
    """`directory`'s model as a GGUF; `types` maps fnmatch patterns of GGUF tensor names to a
    type name (the first match wins; unmatched tensors stay F32). With `split_max_tensors` the
    file is split into shards of that many tensors (OUT-0000i-of-0000N.gguf; returns the first)."""
    import gguf

    cfg = ModelConfig.from_hf(directory)
    raw = json.loads((directory / "config.json").read_text())
    arch = arch or ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    _metadata(w, cfg, raw, directory, chat_template)
    for name, t in gguf_tensors(directory).items():
        kind = next((k for pattern, k in types.items() if fnmatch.fnmatch(name, pattern)), "F32")
        data, qtype = encode(t, kind)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(out.parent.glob(out.stem + "-00001-of-*.gguf"))[0]
    return out


def encode(t: np.ndarray, kind: str):
    """(data, raw dtype or None) for GGUFWriter.add_tensor."""
    import gguf

    if kind == "F32":
        return t.astype(np.float32), None
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ENCODERS:
        return ENCODERS[kind](t.astype(np.float32)), qtype
    return gguf.quants.quantize(t.astype(np.float32), qtype), qtype


def _metadata(w, cfg: ModelConfig, raw: dict, directory: Path, chat_template: str | None) -> None:
    import gguf

    w.add_block_count(cfg.num_layers + cfg.num_mtp_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_leading_dense_block_count(
        cfg.mlp_layer_types.index("sparse") if "sparse" in cfg.mlp_layer_types else cfg.num_layers
    )
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if cfg.rope.kind == "yarn":  # as llama.cpp's converter writes DeepSeek-V3's YaRN
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(cfg.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(cfg.rope.beta_slow)
        if cfg.rope.mscale_all_dim is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope.mscale_all_dim)
    if cfg.num_mtp_layers:
        w.add_nextn_predict_layers(cfg.num_mtp_layers)
    if cfg.dsa is not None:
        w.add_indexer_head_count(cfg.dsa.index_n_heads)
        w.add_indexer_key_length(cfg.dsa.index_head_dim)
        w.add_indexer_top_k(cfg.dsa.index_topk)
        w.add_array(f"{w.arch}.attention.indexer.types", [t == "full" for t in cfg.dsa.indexer_types])
    if (directory / "tokenizer.json").exists():
        _vocab(w, directory, chat_template)


def _vocab(w, directory: Path, chat_template: str | None) -> None:
    """The byte-level BPE tokenizer as llama.cpp's converter stores it (gpt-2 pre-tokenizer)."""
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    specials = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    eos = json.loads((directory / "config.json").read_text()).get("eos_token_id", 0)
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


# --- plain K-quant encoders (the block layouts of ggml-common.h) -------------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def encode_q6_k(t: np.ndarray) -> np.ndarray:
    """float32 [..., n * 256] -> Q6_K blocks, uint8 [..., n * 210]."""
    x = t.reshape(-1, 16, 16).astype(np.float64)  # [blocks, 16 groups, 16]
    group_scale = np.abs(x).max(-1) / 31  # [blocks, 16]
    d = (np.abs(group_scale).max(-1) / 127).astype(np.float16).astype(np.float64)  # [blocks]
    safe_d = np.where(d > 0, d, 1)
    sub = np.clip(np.round(group_scale / safe_d[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sub
    q = np.clip(np.round(x / np.where(step != 0, step, 1)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, halves, runs, 32]
    q1, q2, q3, q4 = q[:, :, 0], q[:, :, 1], q[:, :, 2], q[:, :, 3]
    ql = np.concatenate([(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)], axis=2)
    qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    blocks = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sub.view(np.uint8), _f16_bytes(d)], axis=1
    )
    return blocks.reshape(*t.shape[:-1], t.shape[-1] // 256 * 210)


def encode_q4_k(t: np.ndarray) -> np.ndarray:
    """float32 [..., n * 256] -> Q4_K blocks, uint8 [..., n * 144]."""
    x = t.reshape(-1, 8, 32).astype(np.float64)  # [blocks, 8 groups, 32]
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float64)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float64)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(
        np.round((x + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15
    )
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # [blocks, runs of 64, low / high, 32]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.zeros((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=1)
    return blocks.reshape(*t.shape[:-1], t.shape[-1] // 256 * 144)


def encode_iq4_nl(t: np.ndarray) -> np.ndarray:
    """float32 [..., n * 32] -> IQ4_NL blocks (the nearest of the 16 table values), uint8 [..., n * 18]."""
    from latentkv.weights.gguf_blocks import IQ4_VALUES

    x = t.reshape(-1, 32).astype(np.float64)
    d = (np.abs(x).max(-1) / 127).astype(np.float16).astype(np.float64)
    table = np.array(IQ4_VALUES, dtype=np.float64)
    q = np.abs(x[..., None] / np.where(d > 0, d, 1)[:, None, None] - table).argmin(-1).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    blocks = np.concatenate([_f16_bytes(d), qs], axis=1)
    return blocks.reshape(*t.shape[:-1], t.shape[-1] // 32 * 18)


ENCODERS = {"Q6_K": encode_q6_k, "Q4_K": encode_q4_k, "IQ4_NL": encode_iq4_nl}


def dequantized_checkpoint(gguf_path: Path, source: Path, out: Path) -> Path:
    """The safetensors checkpoint holding what `gguf_path` dequantizes to (by the gguf package),
    under transformers' names in `source`'s layout: the float reference a GGUF load is compared
    with."""
    import shutil

    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    cfg = ModelConfig.from_hf(source)
    H, P = cfg.num_heads, cfg.qk_nope_head_dim
    back = {}
    ckpt = Checkpoint(source)
    names = _name_map(cfg)
    for name in ckpt.keys():  # noqa: SIM118
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        parts = name.split(".")
        if ".mlp.experts." in name and parts[5].isdigit():
            kind = parts[6].removesuffix("_proj")
            v = values[f"blk.{layer}.ffn_{kind}_exps.weight"][int(parts[5])]
        elif name.endswith("experts.gate_up_proj"):
            v = np.concatenate(
                [values[f"blk.{layer}.ffn_gate_exps.weight"], values[f"blk.{layer}.ffn_up_exps.weight"]], 1
            )
        elif name.endswith("experts.down_proj"):
            v = values[f"blk.{layer}.ffn_down_exps.weight"]
        elif name.endswith("e_score_correction_bias"):
            v = values[f"blk.{layer}.exp_probs_b.bias"]
        elif name.endswith("kv_b_proj.weight"):
            k_b, v_b = values[f"blk.{layer}.attn_k_b.weight"], values[f"blk.{layer}.attn_v_b.weight"]
            v = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(H * (P + cfg.v_head_dim), -1)
        else:
            v = values[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        back[name] = torch.from_numpy(np.array(v, dtype=np.float32))
    out.mkdir(parents=True, exist_ok=True)
    save_file(back, str(out / "model.safetensors"))
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    return out
