"""Frozen configuration, built once at the boundary (CLI, server) and passed down.

`ModelConfig.from_hf` turns a transformers `config.json` into the one model description the
rest of the stack reads. This is the only module that reads environment variables.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type -> family. The family decides which optional parts exist (the DSA indexer) and how
# the indexer applies RoPE; everything else is read from the config itself.
FAMILIES: dict[str, str] = {
    "glm_moe_dsa": "glm5",  # GLM-5: MLA + MoE + DSA indexer (interleaved RoPE, full/shared layers)
    "deepseek_v32": "dsv32",  # DeepSeek-V3.2: MLA + MoE + DSA indexer (half-split RoPE in the indexer)
    "deepseek_v3": "dsv3",  # DeepSeek-V3 / R1 / Kimi-K2: MLA + MoE
    "kimi_k2": "dsv3",  # Kimi-K2 ships as deepseek_v3; accept its own name too
    "glm4_moe_lite": "dsv3",  # GLM-4.7-Flash: MLA + MoE, no indexer
}


class ConfigError(ValueError):
    """A config.json we cannot serve, with a message that says why."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DsaConfig:
    """DeepSeek Sparse Attention: a lightning indexer picks `index_topk` past tokens per query."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...]  # per layer: "full" runs the indexer, "shared" reuses the last full one
    rope_interleave: bool  # GLM-5: interleaved; DeepSeek-V3.2: half-split


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dsa: DsaConfig | None = None
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    def _problems(self):
        positive = [
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                yield f"{name} must be positive (got {getattr(self, name)})"
            elif getattr(self, name) > (MAX_VOCAB if name == "vocab_size" else MAX_DIM):
                yield f"{name} {getattr(self, name)} is beyond any real model: the config is damaged"
        yield from self._more_problems()
        if self.qk_rope_head_dim % 2:
            yield f"qk_rope_head_dim must be even for RoPE (got {self.qk_rope_head_dim})"
        if len(self.mlp_layer_types) != self.num_layers:
            yield f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {self.num_layers} layers"
        if bad := set(self.mlp_layer_types) - {"dense", "sparse"}:
            yield f"unknown mlp layer types {sorted(bad)} (expected 'dense' or 'sparse')"
        if "sparse" in self.mlp_layer_types:
            if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
                yield "MoE layers need n_routed_experts and moe_intermediate_size"
            elif self.n_routed_experts % self.n_group:
                yield f"n_routed_experts ({self.n_routed_experts}) is not divisible by n_group ({self.n_group})"
            if not 0 < self.topk_group <= self.n_group:
                yield f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})"
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                yield f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..n_routed_experts"
        if self.dsa is not None:
            d = self.dsa
            if len(d.indexer_types) != self.num_layers:
                yield f"indexer_types has {len(d.indexer_types)} entries for {self.num_layers} layers"
            elif d.indexer_types[0] != "full":
                yield "the first layer's indexer must be 'full' (shared layers reuse an earlier selection)"
            if bad := set(d.indexer_types) - {"full", "shared"}:
                yield f"unknown indexer types {sorted(bad)} (expected 'full' or 'shared')"
            if d.index_head_dim < self.qk_rope_head_dim:
                yield f"index_head_dim ({d.index_head_dim}) is smaller than qk_rope_head_dim"
            if not self.q_lora_rank:
                yield "a DSA indexer needs q_lora_rank (its queries read the q-LoRA latent)"
            if d.index_topk <= 0:
                yield f"index_topk must be positive (got {d.index_topk})"

    def _more_problems(self):
        """Sizes and relations the model's code relies on (beyond the positive dimensions)."""
        if not 0 < self.max_position_embeddings <= MAX_CONTEXT:
            yield f"max_position_embeddings must be in 1..{MAX_CONTEXT} (got {self.max_position_embeddings})"
        if not self.rms_norm_eps > 0:
            yield f"rms_norm_eps must be positive (got {self.rms_norm_eps})"
        if self.q_lora_rank is not None and not 0 < self.q_lora_rank <= MAX_DIM:
            yield f"q_lora_rank must be positive (got {self.q_lora_rank})"
        if "dense" in self.mlp_layer_types and not 0 < self.intermediate_size <= MAX_DIM:
            yield f"dense layers need intermediate_size in 1..{MAX_DIM} (got {self.intermediate_size})"
        if self.n_shared_experts < 0 or self.num_mtp_layers < 0:
            yield "n_shared_experts and num_nextn_predict_layers must be >= 0"
        if "sparse" in self.mlp_layer_types:
            if self.n_routed_experts > MAX_EXPERTS or self.moe_intermediate_size > MAX_DIM:
                yield f"n_routed_experts ({self.n_routed_experts}) or moe_intermediate_size is beyond any model"
            if self.n_group < 1:
                yield f"n_group must be positive (got {self.n_group})"
            elif self.n_routed_experts % self.n_group == 0 and 0 < self.topk_group <= self.n_group:
                reachable = self.topk_group * (self.n_routed_experts // self.n_group)
                if self.num_experts_per_tok > reachable:
                    yield (
                        f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {reachable} experts "
                        f"of topk_group ({self.topk_group}) groups"
                    )
        for name, ids in (("eos_token_id", self.eos_token_ids), ("bos_token_id", (self.bos_token_id,))):
            if bad := [i for i in ids if i is not None and not 0 <= i < self.vocab_size]:
                yield f"{name} {bad[:3]} outside the vocabulary of {self.vocab_size}"
        if self.dsa is not None:
            d = self.dsa
            for name in ("index_head_dim", "index_n_heads"):
                if not 0 < getattr(d, name) <= MAX_DIM:
                    yield f"{name} must be positive (got {getattr(d, name)})"

    # --- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_width(self) -> int:
        """Values cached per token per layer: the latent c plus the shared rope key r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    def expanded_kv_values_per_token_layer(self) -> int:
        """What a per-head K/V cache (transformers for GLM-5) holds per token per layer."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)

    # --- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a transformers config.json (a path, a model directory, or the parsed dict).
        ConfigError, one line naming the file and the field, for anything it cannot use."""
        if isinstance(source, dict):
            where, raw = "config.json", source
        else:
            path = Path(source)
            if path.is_dir() and path.name != "config.json":
                path = path / "config.json"
            where, raw = str(path), read_json_object(path)
        try:
            return _from_hf_dict(_Raw(raw))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from a regular UTF-8 file; ConfigError (one line naming it) otherwise."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"no {path.name} at {path}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ConfigError(f"{path} is {kind}; it must be a JSON file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}: 0x{data[exc.start]:02x})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path} is not usable JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {_json_kind(raw)}")
    return raw


def _json_kind(value: Any) -> str:
    kinds = [(bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string")]
    kinds += [(list, "a list"), (dict, "an object")]
    return next((name for t, name in kinds if isinstance(value, t)), "null")


# Bounds no real checkpoint comes near (DeepSeek-V3: hidden 7168, 256 experts, 61 layers, 128K
# context); past them a config is damaged, and believing it would allocate without end.
MAX_DIM = 1 << 20
MAX_VOCAB = 1 << 24
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_CONTEXT = 1 << 26


class _Raw:
    """config.json's object, read field by field: a wrong type is a ConfigError naming the field
    (never a bool taken as 1, a float truncated, a string parsed)."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, *, source: dict | None = None) -> int:
        value = (self.raw if source is None else source).get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"lacks {key!r}")
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer (got {value!r:.60})")
        return value

    def float(self, key: str, default: float, *, source: dict | None = None) -> float:
        import math

        value = (self.raw if source is None else source).get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number (got {value!r:.60})")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false (got {value!r:.60})")
        return value

    def object(self, key: str) -> dict[str, Any]:
        value = self.raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be an object (got {_json_kind(value)})")
        return value

    def names(self, key: str, value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings (got {value!r:.60})")
        return value

    def ids(self, key: str) -> tuple[int, ...]:
        value = self.raw.get(key)
        items = value if isinstance(value, list) else ([] if value is None else [value])
        if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
            raise ConfigError(f"{key} must be a token id or a list of them (got {value!r:.60})")
        return tuple(items)


def _from_hf_dict(raw: _Raw) -> ModelConfig:
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ConfigError(
            f"unsupported model_type {model_type!r:.60}; supported: {', '.join(sorted(FAMILIES))}"
        )
    family = FAMILIES[model_type]
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw.get('hidden_act')!r:.60} is not supported (only 'silu')")
    n_layers = raw.int("num_hidden_layers")
    if not 0 < n_layers <= MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers must be in 1..{MAX_LAYERS} (got {n_layers})")

    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        # deepseek_v3 / kimi: first_k_dense_replace dense layers, then MoE (with moe_layer_freq 1);
        # glm4_moe_lite defaults to one dense layer.
        default_dense = 1 if model_type == "glm4_moe_lite" else 3
        n_dense = min(max(raw.int("first_k_dense_replace", default_dense), 0), n_layers)
        freq = max(raw.int("moe_layer_freq", 1), 1)
        mlp_types = ["sparse" if (i >= n_dense and i % freq == 0) else "dense" for i in range(n_layers)]
    raw.names("mlp_layer_types", mlp_types)

    dsa = None
    if family in ("glm5", "dsv32"):
        dsa = DsaConfig(
            index_topk=raw.int("index_topk", 2048),
            index_head_dim=raw.int("index_head_dim", 128),
            index_n_heads=raw.int("index_n_heads", 64 if family == "dsv32" else 32),
            indexer_types=tuple(_indexer_types(raw, n_layers, family)),
            rope_interleave=family == "glm5",
        )
    q_lora = raw.int("q_lora_rank", 0)
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw.int("vocab_size"),
        hidden_size=raw.int("hidden_size"),
        intermediate_size=raw.int("intermediate_size", 0),
        moe_intermediate_size=raw.int("moe_intermediate_size", 0),
        num_layers=n_layers,
        num_heads=raw.int("num_attention_heads"),
        q_lora_rank=q_lora or None,
        kv_lora_rank=raw.int("kv_lora_rank"),
        qk_nope_head_dim=raw.int("qk_nope_head_dim"),
        qk_rope_head_dim=raw.int("qk_rope_head_dim"),
        v_head_dim=raw.int("v_head_dim"),
        n_routed_experts=raw.int("n_routed_experts", 0) or raw.int("num_experts", 0),
        n_shared_experts=raw.int("n_shared_experts", 0),
        num_experts_per_tok=raw.int("num_experts_per_tok", 0),
        n_group=raw.int("n_group", 0) or 1,
        topk_group=raw.int("topk_group", 0) or 1,
        norm_topk_prob=raw.bool("norm_topk_prob", True),
        routed_scaling_factor=raw.float("routed_scaling_factor", 1.0),
        mlp_layer_types=tuple(mlp_types),
        rms_norm_eps=raw.float("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.int("max_position_embeddings", 4096),
        rope=_rope(raw),
        rope_interleave=raw.bool("rope_interleave", True),
        attention_bias=raw.bool("attention_bias", False),
        tie_word_embeddings=raw.bool("tie_word_embeddings", False),
        bos_token_id=(raw.ids("bos_token_id") or (None,))[0],
        eos_token_ids=raw.ids("eos_token_id"),
        dsa=dsa,
        num_mtp_layers=raw.int("num_nextn_predict_layers", raw.int("num_mtp_layers", 0)),
    )


def _indexer_types(raw: _Raw, n_layers: int, family: str) -> list[str]:
    """Per-layer indexer mode, read the way transformers derives it."""
    if raw.get("indexer_types") is not None:
        return list(raw.names("indexer_types", raw.get("indexer_types")))
    if family == "dsv32":
        return ["full"] * n_layers
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if bad := set(pattern) - {"F", "S"}:
                raise ConfigError(f"index_topk_pattern has letters other than F and S: {sorted(bad)}")
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(raw.names("index_topk_pattern", pattern))
    freq = max(raw.int("index_topk_freq", 1), 1)
    offset = raw.int("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]


def _rope(raw: _Raw) -> RopeConfig:
    """RoPE parameters from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older)."""
    params = dict(raw.object("rope_parameters"))
    for key, value in raw.object("rope_scaling").items():
        params.setdefault(key, value)
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = raw.float("rope_theta", raw.float("rope_theta", 10000.0), source=params)
    if not theta > 0:
        raise ConfigError(f"rope_theta must be positive (got {theta})")
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r:.60} is not supported (supported: default, yarn)")
    original = raw.int("original_max_position_embeddings", 0, source=params)
    factor = raw.float("factor", 0.0, source=params)
    if not factor:
        if original <= 0:
            raise ConfigError("yarn RoPE needs 'factor' or 'original_max_position_embeddings'")
        factor = raw.int("max_position_embeddings", 4096) / original
    optional = {}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            optional[key] = raw.float(key, 0.0, source=params)
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original or raw.int("max_position_embeddings", 4096),
        beta_fast=raw.float("beta_fast", 0.0, source=params) or 32.0,
        beta_slow=raw.float("beta_slow", 0.0, source=params) or 1.0,
        truncate=params.get("truncate", True) is not False,
        **optional,
    )


# --- runtime configuration ----------------------------------------------------------------

# The tiers, named as vLLM's --kv-cache-dtype: the one list (latentkv.kv.codecs.tiers derives
# each one's codecs from the name), here so this module stays free of imports from the package.
# The mixed tiers (tq4-r8: tq4 latent, fp8 rope key; -r16: bf16 rope key) follow the single-codec ones.
# llama.cpp's block formats (fixed blocks of 32, no --kv-group-size), their rotated variants, and
# the searched-scale block tiers (docs/kv-tiers.md).
BLOCK_KV_CACHE_DTYPES = (
    *("q8_0", "q5_0", "q4_0", "q4_1"),
    *("hq8_0", "hq5_0", "hq4_0", "hq4_1"),
    *("q8s", "q5s", "q4s", "wq4"),
)
KV_CACHE_DTYPES = (
    "f32",
    "bf16",
    "fp8",
    *(f"tq{b}" for b in range(2, 7)),
    *(f"polar{b}" for b in range(2, 7)),
    *(f"{base}-{r}" for base in ("tq4", "tq3", "polar4") for r in ("r8", "r16")),
    *BLOCK_KV_CACHE_DTYPES,
)
# Tiers whose latent codec takes --kv-group-size (one scale per group of values).
GROUPED_KV_CACHE_DTYPES = tuple(
    n for n in KV_CACHE_DTYPES if n not in ("f32", "bf16", *BLOCK_KV_CACHE_DTYPES)
)
KV_CACHE_ALIASES = {"auto": "f32", "fp32": "f32", "float32": "f32", "bfloat16": "bf16", "fp8_e4m3": "fp8"}
DEFAULT_ROTATION_SEED = 0x9E3779B9
# Where a model runs (--device): "auto" is cuda when torch sees a CUDA device, else cpu.
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class CacheConfig:
    """How the latent KV cache is stored: the tier and every parameter that changes its bytes."""

    kv_cache_dtype: str = "f32"
    rotation_seed: int = DEFAULT_ROTATION_SEED  # tq* / polar*
    group_size: int | None = None  # fp8, tq*, polar*: one scale per group_size values instead of per row
    recent_window: int = 0  # the last W tokens read in f32 by attention (0: off); not part of the bytes

    def __post_init__(self) -> None:
        name = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", name)
        if name not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.group_size is not None:
            if name not in GROUPED_KV_CACHE_DTYPES:
                raise ConfigError(f"--kv-group-size applies to fp8, tq* and polar* tiers only, not to {name}")
            check_number("--kv-group-size", self.group_size, 1, MAX_DIM, integer=True)
        check_number("--kv-recent-window", self.recent_window, 0, MAX_CONTEXT, integer=True, note="0 is off")


def parse_kv_cache_dtypes(text: str) -> list[str]:
    """A comma-separated tier list (or `all`) -> canonical names, validated."""
    if text.strip() == "all":
        return list(KV_CACHE_DTYPES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError("--kv-cache-dtype is empty")
    return [CacheConfig(n).kv_cache_dtype for n in names]


def kv_cache_dtype_from_env(environ: dict[str, str] | None = None) -> tuple[str | None, list[str]]:
    """The seed system's switches, as aliases of --kv-cache-dtype: (tier or None, notices).

    KV8=1 -> fp8; KV_TQ=b -> tq{b} (1 lands on tq4 with a notice, above 6 clamps to 6);
    KV_TQ_POLAR=1 -> polar{b} (b from KV_TQ, else 4). KV8 together with KV_TQ: the 4-bit
    tier wins, with a warning.
    """
    env = os.environ if environ is None else environ
    notices: list[str] = []
    kv8 = env.get("KV8", "").strip() not in ("", "0")
    tq_raw = env.get("KV_TQ", "").strip()
    polar = env.get("KV_TQ_POLAR", "").strip() not in ("", "0")
    bits = None
    if tq_raw not in ("", "0"):
        try:
            bits = int(tq_raw)
        except ValueError:
            raise ConfigError(f"KV_TQ must be a bit width 1..6, got {tq_raw!r}") from None
        if bits == 1:
            notices.append("KV_TQ=1: there is no 1-bit tier; using the recommended 4-bit tier (tq4)")
            bits = 4
        elif bits > 6:
            notices.append(f"KV_TQ={bits}: clamped to 6 bits")
            bits = 6
        elif bits < 1:
            raise ConfigError(f"KV_TQ must be a bit width 1..6, got {tq_raw!r}")
    if polar and bits is None:
        bits = 4
    if bits is None:
        return ("fp8" if kv8 else None), notices
    name = f"polar{bits}" if polar else f"tq{bits}"
    if kv8:
        notices.append(f"both KV8 and KV_TQ are set: the 4-bit tier wins ({name}), fp8 is ignored")
    return name, notices


@dataclass(frozen=True)
class EngineConfig:
    """How a model is loaded and run. The weight formats are names in the registry of
    `latentkv.weights` (checked where it is known: the CLI's choices, `runtime.resolve_load`)."""

    weight_dtype: str = "f32"
    threads: int | None = None  # None: torch's default
    cache: CacheConfig = field(default_factory=CacheConfig)
    compile: bool = False  # decode one token per step through torch.compile (models/compiled.py)
    expert_dtype: str | None = None  # routed experts' format; None: the same as weight_dtype
    ram_gb: float | None = None  # stream routed experts from disk within this RAM budget (GiB)
    vram_gb: float | None = None  # plan one GPU's memory (GiB): experts in VRAM, or cached there
    expert_policy: str = "lru"  # the expert cache's eviction policy when streaming
    cluster: ClusterConfig | None = None  # expert-parallel over a cluster (started by torchrun)
    device: str = "cpu"  # --device: cpu, cuda or auto (resolved once, by `runtime.resolve_device`)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"unknown --device {self.device!r}; choose from {', '.join(DEVICES)}")
        if self.threads is not None:
            check_threads(self.threads)
        if self.ram_gb is not None:
            check_gib("--ram-gb", self.ram_gb)
        if self.vram_gb is not None:
            check_gib("--vram-gb", self.vram_gb)
        if self.ram_gb is not None and self.compile:
            raise ConfigError("--compile does not apply to streamed experts (--ram-gb): drop one of them")
        if self.vram_gb is not None and self.compile:
            raise ConfigError(
                "--compile does not apply to experts planned for a GPU (--vram-gb): drop one of them"
            )
        if self.cluster is not None and self.compile:
            raise ConfigError("--compile does not apply to a cluster (experts on several ranks): drop it")

    @property
    def experts(self) -> str:
        """The routed experts' weight format."""
        return self.expert_dtype or self.weight_dtype

    @property
    def weights_label(self) -> str:
        """`int4` or `bf16 (experts int4)`: how a run names its weights."""
        return (
            self.weight_dtype
            if self.experts == self.weight_dtype
            else f"{self.weight_dtype} (experts {self.experts})"
        )


@dataclass(frozen=True)
class ServerConfig:
    """`latentkv serve`: what the HTTP server binds, whom it admits, and how much it batches."""

    model: str  # the MODEL argument (a directory or builtin:NAME)
    served_model_name: str  # the name clients pass as `model`
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    max_num_seqs: int = 8  # sequences decoded together in one batched step
    max_queue: int = 64  # requests waiting for a slot; one more is refused with 429
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_dir: Path | None = None  # session files; None: sessions_dir()
    engine_process: bool = True  # the model and scheduler in a child process (engine/remote.py)
    pin_cpus: bool = False  # with engine_process: the engine and the HTTP process on separate CPUs
    speculative_draft_tokens: int = 0  # --speculative mtp --draft-tokens N; 0: no drafting
    request_timeout_s: float = 30.0  # a request's headers, then its body, must arrive within this (408)

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("--served-model-name is empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (got {self.port})")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key is empty (leave it out to serve without a key)")
        check_number("--max-num-seqs", self.max_num_seqs, 1, MAX_SEQS, integer=True)
        check_number("--max-queue", self.max_queue, 1, MAX_QUEUE, integer=True)
        if not 0 <= self.speculative_draft_tokens <= 8:
            raise ConfigError(f"--draft-tokens must be in 1..8 (got {self.speculative_draft_tokens})")
        if self.max_model_len is not None:
            check_number("--max-model-len", self.max_model_len, 2, MAX_CONTEXT, integer=True)
        check_number("--request-timeout", self.request_timeout_s, 0, 3600, above=True, unit=" s")


# --- numeric flags that size memory or count tokens: one check -----------------------------------

MAX_GIB = 1 << 16  # 64 TiB: past the memory of any one machine (--ram-gb, --vram-gb)
MAX_SEQS = 1 << 12  # sequences decoded together
MAX_QUEUE = 1 << 20  # requests waiting


def check_number(
    flag: str,
    value: float,
    low: float,
    high: float,
    *,
    integer: bool = False,
    above: bool = False,
    unit: str = "",
    note: str = "",
) -> float:
    """`value` if it is a finite number (an integer when `integer`) in [low, high] (or (low,
    high] when `above`), else ConfigError, one line naming the flag: for every numeric flag
    that sizes memory or counts tokens (--ram-gb, window sizes, token counts), so nan, inf,
    1e999 or 2**63 is refused here rather than overflowing (or allocating) further down."""
    ok = (isinstance(value, int) or (not integer and isinstance(value, float))) and not isinstance(
        value, bool
    )
    ok = ok and math.isfinite(value) and (low < value if above else low <= value) and value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        span = f"above {_n(low)} and at most {_n(high)}" if above else f"from {_n(low)} to {_n(high)}"
        shown = repr(value) if len(repr(value)) <= 24 else f"{repr(value)[:21]}..."
        why = f" ({note})" if note else ""
        raise ConfigError(f"{flag} must be {kind} {span}{unit}{why} (got {shown})")
    return value


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def check_gib(flag: str, value: float) -> float:
    """A memory budget in GiB: positive, finite, at most MAX_GIB."""
    return check_number(flag, value, 0, MAX_GIB, above=True, unit=" GiB")


def check_tokens(flag: str, value: int, low: int = 1, high: int = MAX_CONTEXT) -> int:
    """A token count (a context, a window, tokens to generate): an integer in [low, high]."""
    return int(check_number(flag, value, low, high, integer=True))


def env_api_key() -> str | None:
    """LATENTKV_API_KEY, an alias of --api-key (keeps the key out of the process list)."""
    return os.environ.get("LATENTKV_API_KEY") or None


def max_threads() -> int:
    """The most torch threads we start: 4 per CPU, at most 1024 (far more only crashes torch)."""
    return min(1024, 4 * (os.cpu_count() or 1))


def check_threads(threads: int) -> int:
    """`threads` if it is in 1..max_threads(), else ConfigError (one line naming the flag)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= max_threads():
        raise ConfigError(
            f"--threads (or LATENTKV_THREADS) must be in 1..{max_threads()}: at most 4 per CPU "
            f"(this machine has {os.cpu_count() or 1}) and 1024 (got {threads})"
        )
    return threads


def env_threads() -> int | None:
    """LATENTKV_THREADS, an alias of --threads."""
    value = os.environ.get("LATENTKV_THREADS")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"LATENTKV_THREADS must be an integer (got {value!r:.40})") from None


def cache_root() -> Path:
    """The user's cache directory for latentkv: $LATENTKV_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    if explicit := os.environ.get("LATENTKV_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "latentkv"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, where `hf download` puts models: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub (the same
    order huggingface_hub itself follows)."""
    if explicit := os.environ.get("HF_HUB_CACHE"):
        return Path(explicit).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "huggingface" / "hub"


def sessions_dir() -> Path:
    """Where `--session NAME` keeps its KV files when --kv-dir is not given: cache_root()/sessions."""
    return cache_root() / "sessions"


# --- a cluster of ranks (expert parallelism, docs/distributed.md) ----------------------------

DEFAULT_CLUSTER_TIMEOUT_S = 60.0  # a rank that does not answer within this is lost
DEFAULT_CLUSTER_START_TIMEOUT_S = 900.0  # start-up: every rank joins (and writes its share) within this


@dataclass(frozen=True)
class ClusterConfig:
    """This process's place in a cluster started by torchrun (or anything that sets torch's
    env:// variables): `world_size` ranks, rank 0 the head. Built by `cluster_from_env`."""

    world_size: int
    rank: int
    master_addr: str
    master_port: int
    local_world_size: int = 1  # ranks on this machine (they share its memory)
    agent_store: bool = False  # torchrun's agent hosts the rendezvous store (rank 0 connects to it)
    timeout_s: float = DEFAULT_CLUSTER_TIMEOUT_S
    start_timeout_s: float = DEFAULT_CLUSTER_START_TIMEOUT_S
    secret: str | None = None  # a token every rank must present at start-up
    placement: Path | None = None  # a placement file (`latentkv plan --nodes N --placement-out`)
    head_experts: bool = True  # the head owns a share of the experts
    disk_gbps: float | None = None  # this rank's disk read speed; None: measured

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ConfigError(f"a cluster needs WORLD_SIZE >= 2 (got {self.world_size})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK must be in 0..{self.world_size - 1} (got {self.rank})")
        if not 0 < self.master_port <= 65535:
            raise ConfigError(f"MASTER_PORT must be in 1..65535 (got {self.master_port})")
        if not self.master_addr:
            raise ConfigError("MASTER_ADDR is empty: the head's address (torchrun --master-addr)")
        if not self.timeout_s > 0 or not self.start_timeout_s > 0:
            raise ConfigError("--cluster-timeout and --cluster-start-timeout must be positive")
        if self.secret is not None and not self.secret:
            raise ConfigError("the cluster secret is empty (leave it out to run without one)")
        if self.disk_gbps is not None and not self.disk_gbps > 0:
            raise ConfigError(f"--disk-gbps must be positive (got {self.disk_gbps})")

    @property
    def is_head(self) -> bool:
        return self.rank == 0


def cluster_env(environ: dict[str, str] | None = None) -> dict[str, int | str | bool] | None:
    """torch's env:// variables (what torchrun sets): None unless WORLD_SIZE > 1. ConfigError for
    values that are not what torchrun would set."""
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE", "").strip()
    if not raw:
        return None
    try:
        world = int(raw)
        if world <= 1:
            return None
        out: dict[str, int | str | bool] = {"world_size": world, "rank": int(env.get("RANK", ""))}
        out["master_port"] = int(env.get("MASTER_PORT", ""))
        out["local_world_size"] = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    except ValueError:
        raise ConfigError(
            "WORLD_SIZE, RANK and MASTER_PORT must be integers (torchrun sets them; "
            f"got WORLD_SIZE={raw!r}, RANK={env.get('RANK')!r}, MASTER_PORT={env.get('MASTER_PORT')!r})"
        ) from None
    out["master_addr"] = env.get("MASTER_ADDR", "").strip()
    out["agent_store"] = env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    return out


def env_cluster_secret() -> str | None:
    """LATENTKV_CLUSTER_SECRET, an alias of --cluster-secret (keeps it out of the process list)."""
    return os.environ.get("LATENTKV_CLUSTER_SECRET") or None


def quiet_torch_for_cluster() -> None:
    """Under torchrun (WORLD_SIZE > 1), before torch is imported: torch's C++ warnings off. A rank
    that goes away makes the store and gloo log stack frames on every other rank; latentkv says
    what happened in one line instead. An explicit TORCH_CPP_LOG_LEVEL is kept."""
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
