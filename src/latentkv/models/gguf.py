"""GGUF files as checkpoints: MODEL may be a .gguf, or the first shard of a split one.

llama.cpp writes MLA models as architecture `deepseek2` (DeepSeek-V3 / R1, Kimi-K2, and
GLM-4.7-Flash, whose `glm4_moe_lite` it converts to deepseek2), `glm-dsa` (GLM-5) and
`deepseek32` (DeepSeek-V3.2). A GGUF is read through the `gguf` package, memory-mapped, and
presented to the loader as a checkpoint under transformers' names:

- `view(path)` makes (once, under the cache directory) a small folder for it: config.json from
  the metadata (`hf_config`), tokenizer.json and tokenizer_config.json from the tokenizer
  metadata (`gguf_vocab.py`), the manifest of its quantized matrices (`latentkv-weights.json`,
  "source": "gguf"), and `latentkv-gguf.json` naming the GGUF's shards. Every command then
  takes that folder as it takes any model folder; `Checkpoint` opens the GGUF behind it.
- `GgufSource` serves the tensors: float types (F32, F16, BF16) as views of the file;
  quantized matrices both as their format's state (`NAME.int8.q`, ...: exact for the types
  `weights/gguf_blocks.EXACT` maps, re-quantized otherwise) and, for code that wants floats, as
  their dequantized values. Routed experts (one [E, out, in] tensor per projection in GGUF)
  appear one by one; MLA's `attn_k_b` [H, Lkv, P] and `attn_v_b` [H, V, Lkv] appear as
  `self_attn.k_b_proj.weight` [H * Lkv, P] and `v_b_proj.weight` [H * V, Lkv] (each head's
  rows, as the loader's per-head matrices want them: no re-quantization) and folded back into
  `kv_b_proj.weight` [H * (P + V), Lkv] as floats.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from latentkv.weights.base import format_class
from latentkv.weights.gguf_blocks import EXACT, REQUANT_GROUP, exact_state, requantize_target

ARCHITECTURES = {"deepseek2": "deepseek_v3", "glm-dsa": "glm_moe_dsa", "deepseek32": "deepseek_v32"}
VIEW_FORMAT, VIEW_VERSION = "latentkv-gguf-view", 1
SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SIGMOID = 2  # expert_gating_func: 1 softmax (DeepSeek-V2), 2 sigmoid (V3 and later)
# Matrices the loader keeps in float32 whatever the format (the router, the indexer's head
# weights): served dequantized, never as a format's pieces.
FLOAT_ONLY = ("mlp.gate.weight", "indexer.weights_proj.weight")

# GGUF tensor name within block i (after "blk.{i}.") -> transformers' name after "model.layers.{i}."
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_q": "self_attn.q_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "indexer.k_norm": "self_attn.indexer.k_norm",
    "indexer.proj": "self_attn.indexer.weights_proj",
    "indexer.attn_k": "self_attn.indexer.wk",
    "indexer.attn_q_b": "self_attn.indexer.wq_b",
    "nextn.eh_proj": "eh_proj",
    "nextn.enorm": "enorm",
    "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm",
}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Copies the MTP layer carries of the main model's embedding and head (never read), RoPE tables.
SKIPPED = ("nextn.embed_tokens", "nextn.shared_head_head", "rope_freqs")


class GgufError(ValueError):
    """A GGUF file we cannot load, said in one line naming it."""


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def shard_paths(path: Path) -> list[Path]:
    """The shards of a (possibly split) GGUF, given the first: NAME-00001-of-0000N.gguf."""
    match = SHARD.match(path.name)
    if match is None:
        return [path]
    if int(match["no"]) != 1:
        raise GgufError(
            f"{path} is shard {int(match['no'])} of a split GGUF: give the first, -00001-of-{match['count']}.gguf"
        )
    count = int(match["count"])
    paths = [path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf") for i in range(1, count + 1)]
    if missing := [p.name for p in paths if not p.is_file()]:
        raise GgufError(f"{path} is split in {count} shards; missing beside it: {', '.join(missing[:4])}")
    return paths


class GgufModel:
    """The metadata and tensors of one GGUF model (all its shards), memory-mapped."""

    def __init__(self, paths: list[Path]):
        from gguf import GGUFReader

        self.paths = paths
        self.readers = []
        for p in paths:
            try:
                self.readers.append(GGUFReader(p, "c"))  # copy-on-write: writable views, file untouched
            except (ValueError, OSError, KeyError, IndexError) as exc:
                raise GgufError(f"{p}: not a readable GGUF file ({str(exc)[:160]})") from None
        self.meta: dict[str, Any] = {k: f.contents() for k, f in self.readers[0].fields.items()}
        self.tensors = {t.name: t for r in self.readers for t in r.tensors}
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GgufError(
                f"{paths[0]}: architecture {self.arch!r} is not an MLA model we run "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )

    def key(self, name: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{name}", default)

    def need(self, name: str) -> Any:
        value = self.key(name)
        if value is None:
            raise GgufError(f"{self.paths[0]}: metadata lacks {self.arch}.{name}")
        return value

    def header_bytes(self) -> bytes:
        """Every shard's bytes before its tensor data (metadata and tensor table): what the
        model's fingerprint hashes."""
        return b"".join(bytes(r.data[: r.data_offset]) for r in self.readers)


def _f32(value: Any) -> float:
    """A float32 from the metadata as the shortest decimal that reads back as it (1e-05 rather
    than 9.999999747378752e-06): what the config.json it was converted from said."""
    return float(str(np.float32(value)))


def hf_config(m: GgufModel) -> dict[str, Any]:
    """The transformers config.json of a GGUF's model, from its metadata."""
    from latentkv.models.gguf_vocab import special_ids

    if m.key("expert_gating_func", SIGMOID) != SIGMOID:
        raise GgufError(f"{m.paths[0]}: softmax expert gating (DeepSeek-V2) is not supported; sigmoid only")
    nextn = int(m.key("nextn_predict_layers", 0))
    layers = int(m.need("block_count")) - nextn
    R = int(m.need("rope.dimension_count"))
    if m.key("attention.key_length_mla") is not None:
        qk, v = int(m.key("attention.key_length_mla")), int(m.need("attention.value_length_mla"))
    else:  # written before llama.cpp stored MLA as MQA: per-head K and V lengths
        qk, v = int(m.need("attention.key_length")), int(m.need("attention.value_length"))
    dense = int(m.key("leading_dense_block_count", 0))
    bos, eos = special_ids(m.meta)
    cfg: dict[str, Any] = {
        "architectures": [f"gguf:{m.arch}"],
        "model_type": ARCHITECTURES[m.arch],
        "vocab_size": int(m.key("vocab_size") or len(m.meta.get("tokenizer.ggml.tokens") or [])),
        "hidden_size": int(m.need("embedding_length")),
        "intermediate_size": int(m.key("feed_forward_length", 0)),
        "moe_intermediate_size": int(m.key("expert_feed_forward_length", 0)),
        "num_hidden_layers": layers,
        "first_k_dense_replace": dense,
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(layers)],
        "num_attention_heads": int(m.need("attention.head_count")),
        "q_lora_rank": int(m.key("attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(m.need("attention.kv_lora_rank")),
        "qk_rope_head_dim": R,
        "qk_nope_head_dim": qk - R,
        "v_head_dim": v,
        "n_routed_experts": int(m.key("expert_count", 0)),
        "n_shared_experts": int(m.key("expert_shared_count", 0)),
        "num_experts_per_tok": int(m.key("expert_used_count", 0)),
        "n_group": int(m.key("expert_group_count", 1)),
        "topk_group": int(m.key("expert_group_used_count", 1)),
        "norm_topk_prob": bool(m.key("expert_weights_norm", False)),
        "routed_scaling_factor": _f32(m.key("expert_weights_scale", 1.0)),
        "rms_norm_eps": _f32(m.key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(m.key("context_length", 4096)),
        "rope_theta": _f32(m.key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "num_nextn_predict_layers": nextn,
        "hidden_act": "silu",
        "bos_token_id": bos if m.meta.get("tokenizer.ggml.add_bos_token") else None,  # llama.cpp's rule
        "eos_token_id": eos,
    }
    if (scaling := _rope_scaling(m)) is not None:
        cfg["rope_scaling"] = scaling
    if m.arch in ("glm-dsa", "deepseek32"):
        cfg["index_n_heads"] = int(m.need("attention.indexer.head_count"))
        cfg["index_head_dim"] = int(m.need("attention.indexer.key_length"))
        cfg["index_topk"] = int(m.need("attention.indexer.top_k"))
        if (types := m.key("attention.indexer.types")) is not None:
            cfg["indexer_types"] = ["full" if t else "shared" for t in list(types)[:layers]]
    return cfg


def _rope_scaling(m: GgufModel) -> dict[str, Any] | None:
    kind = m.key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise GgufError(f"{m.paths[0]}: RoPE scaling {kind!r} is not supported (none or yarn)")
    scaling: dict[str, Any] = {
        "type": "yarn",
        "factor": _f32(m.need("rope.scaling.factor")),
        "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length")),
        "beta_fast": _f32(m.key("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _f32(m.key("rope.scaling.yarn_beta_slow", 1.0)),
    }
    if (log_mul := m.key("rope.scaling.yarn_log_multiplier")) is not None:
        # llama.cpp's deepseek2 writes 0.1 * mscale_all_dim; it assumes mscale == mscale_all_dim
        # (DeepSeek-V3: both 1.0), which is what transformers' attention factor then reduces to.
        scaling["mscale"] = scaling["mscale_all_dim"] = _f32(float(log_mul) / 0.1)
    return scaling


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF tensor (experts: see `expert_names`); None for tensors the
    loader never reads."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    match = re.match(r"^blk\.(\d+)\.(.+)$", base)
    if match is None or match[2] in SKIPPED or match[2] in EXPERTS:
        return None
    if match[2] == "exp_probs_b":
        return f"model.layers.{match[1]}.{BLOCK_NAMES['exp_probs_b']}"
    part = BLOCK_NAMES.get(match[2])
    return None if part is None else f"model.layers.{match[1]}.{part}.{suffix}"


class _Tensor:
    """One tensor the source serves: a GGUF tensor, or one expert of a stacked one (`index`)."""

    def __init__(self, gguf_name: str, tensor, index: int | None = None):
        self.gguf_name, self.tensor, self.index = gguf_name, tensor, index
        self.type = tensor.tensor_type.name
        dims = [int(d) for d in reversed(tensor.shape.tolist())]  # numpy order
        self.shape = dims[1:] if index is not None else dims
        self.quantized = self.type not in FLOAT_TYPES

    def matrix_shape(self) -> tuple[int, int]:
        """[out, in]: leading dimensions folded into rows (per-head and per-expert stacks)."""
        return math.prod(self.shape[:-1]), self.shape[-1]

    @property
    def listed(self) -> list[int]:
        """The shape it is served with: a per-head stack [H, N, K] as the matrix [H * N, K]."""
        return list(self.matrix_shape()) if len(self.shape) > 2 else list(self.shape)

    def raw(self) -> np.ndarray:
        data = self.tensor.data
        return data[self.index] if self.index is not None else data


class GgufSource:
    """The tensors of a GGUF model under transformers' names, for `Checkpoint`.

    `entries` lists the float tensors (name -> {"shape"}: quantized ones dequantized on `tensor`);
    `packed` the quantized matrices (name -> manifest entry); `tensor(name)` serves both, and the
    pieces `NAME.<format>.<piece>` of a packed matrix. `report` collects, per re-quantized
    matrix, the error it was re-quantized with."""

    def __init__(self, model: GgufModel, cfg: dict[str, Any]):
        self.model, self.path = model, model.paths[0]
        self.header_bytes = model.header_bytes()
        self._by_name: dict[str, _Tensor] = {}
        self._fold: dict[str, tuple[str, str]] = {}  # kv_b_proj name -> (k_b, v_b) names
        self.report: dict[str, dict] = {}
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None  # the last state decoded
        for gname, t in model.tensors.items():
            self._add(gname, t)
        for name in list(self._by_name):
            if name.endswith("self_attn.k_b_proj.weight"):
                kv = name.replace("k_b_proj", "kv_b_proj")
                if kv not in self._by_name:
                    self._fold[kv] = (name, name.replace("k_b_proj", "v_b_proj"))
        H, P = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
        V, Lkv = cfg["v_head_dim"], cfg["kv_lora_rank"]
        hidden = {n for pair in self._fold.values() for n in pair}  # served folded, or packed per head
        self.entries = {n: {"shape": t.listed} for n, t in self._by_name.items() if n not in hidden}
        for kv in self._fold:
            self.entries[kv] = {"shape": [H * (P + V), Lkv]}
        self.packed = {
            n: {
                "format": _target(t.type)[0],
                "shape": list(t.matrix_shape()),
                "gguf_type": t.type,
                "exact": t.type in EXACT,
            }
            for n, t in self._by_name.items()
            if t.quantized and len(t.shape) >= 2 and not n.endswith(FLOAT_ONLY)
        }

    def _add(self, gname: str, t) -> None:
        base = gname.removesuffix(".weight")
        match = re.match(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)$", base)
        if match is not None:
            E = int(t.shape.tolist()[-1])
            for e in range(E):
                name = f"model.layers.{match[1]}.mlp.experts.{e}.{EXPERTS[match[2]]}.weight"
                self._by_name[name] = _Tensor(gname, t, e)
            return
        name = hf_name(gname)
        if name is not None:
            self._by_name[name] = _Tensor(gname, t)

    def has_piece(self, name: str) -> bool:
        base, fmt, piece = _split_piece(name)
        return (
            base in self.packed and self.packed[base]["format"] == fmt and piece in format_class(fmt).pieces
        )

    def tensor(self, name: str) -> torch.Tensor:
        if name in self._fold:
            return self._folded(name)
        if name in self._by_name:
            return self._float(self._by_name[name])
        base, fmt, piece = _split_piece(name)
        return self.state(base)[piece]

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The packed matrix `name` in its format's state: exact for the types EXACT maps, else
        its dequantized values quantized again (the error goes to `report`). The last one is
        kept: the loader asks for its pieces one after another."""
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        t = self._by_name[name]
        out_f, in_f = t.matrix_shape()
        if t.type in EXACT:
            raw = torch.from_numpy(np.ascontiguousarray(t.raw())).reshape(out_f, -1)
            state = exact_state(t.type, raw, in_f)[1]
        else:
            w = self._float(t).reshape(out_f, in_f).float()
            fmt, group = _target(t.type)
            cls = format_class(fmt)
            state = cls.quantize_state(w, group_size=group)
            self.report[name] = requantization_error(t.type, fmt, w, cls.from_state(state, in_f).dequantize())
        self._last = (name, state)
        return state

    def _float(self, t: _Tensor) -> torch.Tensor:
        """A tensor as floats: a view of the file for F32 / F16 / BF16, dequantized (float32,
        by the `gguf` package) for quantized types."""
        data = t.raw()
        if not t.quantized:
            out = torch.from_numpy(data)
            return (out.view(torch.bfloat16) if t.type == "BF16" else out).reshape(t.listed)
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(np.asarray(data), GGMLQuantizationType[t.type])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(t.listed)

    def _folded(self, name: str) -> torch.Tensor:
        """kv_b_proj [H * (P + V), Lkv] from attn_k_b [H, Lkv, P] and attn_v_b [H, V, Lkv]."""
        k_name, v_name = self._fold[name]
        k, v = self._by_name[k_name], self._by_name[v_name]
        k_b = self._float_full(k).float()  # [H, Lkv, P]
        v_b = self._float_full(v).float()  # [H, V, Lkv]
        kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, P + V, Lkv]
        return kv.reshape(-1, kv.shape[-1])

    def _float_full(self, t: _Tensor) -> torch.Tensor:
        return self._float(t).reshape(t.shape)


def percent(fraction: float) -> str:
    """A relative error as a percentage with two significant digits (0.54%, 0.0031%): a fixed
    number of decimals shows a small error as 0.00%."""
    return f"{100 * fraction:.2g}%"


def report_line(packed: dict[str, dict], report: dict[str, dict]) -> str:
    """One line on how a GGUF's quantized matrices loaded: per GGUF type, how many, the format
    and whether exactly; for re-quantized ones the worst relative RMS error (`report`)."""
    rows: dict[str, list] = {}
    for name, entry in packed.items():
        row = rows.setdefault(entry["gguf_type"], [0, entry["format"], entry["exact"], 0.0])
        row[0] += 1
        if name in report:
            row[3] = max(row[3], report[name]["rel_rms_error"])
    parts = [
        f"{n} {t} -> {fmt} ({'exact' if exact else f're-quantized, relative RMS error up to {percent(err)}'})"
        for t, (n, fmt, exact, err) in sorted(rows.items())
    ]
    return "GGUF matrices: " + "; ".join(parts) + "; float tensors in --weight-dtype"


def requantization_error(gguf_type: str, fmt: str, w: torch.Tensor, deq: torch.Tensor) -> dict:
    """How far a re-quantized matrix `deq` is from the GGUF's dequantized values `w`."""
    err = deq.double() - w.double()
    rms = w.double().pow(2).mean().sqrt().clamp_min(1e-30)
    return {
        "gguf_type": gguf_type,
        "format": fmt,
        "rel_rms_error": float(err.pow(2).mean().sqrt() / rms),
        "max_abs_error": float(err.abs().max()),
    }


def _split_piece(name: str) -> tuple[str, str, str]:
    """ "NAME.int4.nibbles" -> ("NAME", "int4", "nibbles"); ("", "", "") for other names."""
    parts = name.rsplit(".", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", "", "")


def _target(gguf_type: str) -> tuple[str, int]:
    return EXACT.get(gguf_type) or (requantize_target(gguf_type), REQUANT_GROUP)


def open_view(pointer: dict[str, Any], cfg: dict[str, Any], where: Path) -> GgufSource:
    """The tensors of the GGUF a view folder stands for, from its pointer file's contents and
    its config.json (`Checkpoint` calls this; `where` names the folder in errors)."""
    if pointer.get("format") != VIEW_FORMAT or pointer.get("version") != VIEW_VERSION:
        raise GgufError(f"{where}: not a GGUF view this latentkv reads; delete the folder")
    paths = [Path(p) for p in pointer.get("shards") or []]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing or not paths:
        raise GgufError(f"{where} stands for a GGUF that is gone: {missing[0] if missing else 'no shards'}")
    return GgufSource(GgufModel(paths), cfg)
