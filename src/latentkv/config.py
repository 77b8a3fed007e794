"""Frozen configuration, built once at the boundary (CLI, server) and passed down.

`ModelConfig.from_hf` turns a transformers `config.json` into the one model description the
rest of the stack reads. This is the only module that reads environment variables.
"""

from __future__ import annotations

import json
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
        """Read a transformers config.json (a path, a model directory, or the parsed dict)."""
        if isinstance(source, dict):
            raw = source
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                raw = json.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"no config.json at {path}") from None
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return _from_hf_dict(raw)


def _from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    family = FAMILIES[model_type]
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    n_layers = int(_need(raw, "num_hidden_layers"))

    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        # deepseek_v3 / kimi: first_k_dense_replace dense layers, then MoE (with moe_layer_freq 1);
        # glm4_moe_lite defaults to one dense layer.
        default_dense = 1 if model_type == "glm4_moe_lite" else 3
        n_dense = min(int(raw.get("first_k_dense_replace", default_dense) or 0), n_layers)
        freq = int(raw.get("moe_layer_freq", 1) or 1)
        mlp_types = ["sparse" if (i >= n_dense and i % freq == 0) else "dense" for i in range(n_layers)]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    dsa = None
    if family in ("glm5", "dsv32"):
        dsa = DsaConfig(
            index_topk=int(raw.get("index_topk", 2048)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_n_heads=int(raw.get("index_n_heads", 64 if family == "dsv32" else 32)),
            indexer_types=tuple(_indexer_types(raw, n_layers, family)),
            rope_interleave=family == "glm5",
        )
    q_lora = raw.get("q_lora_rank")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_need(raw, "vocab_size")),
        hidden_size=int(_need(raw, "hidden_size")),
        intermediate_size=int(raw.get("intermediate_size", 0) or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0) or 0),
        num_layers=n_layers,
        num_heads=int(_need(raw, "num_attention_heads")),
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(_need(raw, "kv_lora_rank")),
        qk_nope_head_dim=int(_need(raw, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_need(raw, "qk_rope_head_dim")),
        v_head_dim=int(_need(raw, "v_head_dim")),
        n_routed_experts=int(raw.get("n_routed_experts") or raw.get("num_experts") or 0),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        mlp_layer_types=tuple(mlp_types),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope=_rope(raw),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dsa=dsa,
        num_mtp_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0),
    )


def _need(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"config.json lacks {key!r}")
    return raw[key]


def _indexer_types(raw: dict[str, Any], n_layers: int, family: str) -> list[str]:
    """Per-layer indexer mode, read the way transformers derives it."""
    if raw.get("indexer_types") is not None:
        return list(raw["indexer_types"])
    if family == "dsv32":
        return ["full"] * n_layers
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    freq = max(int(raw.get("index_topk_freq", 1) or 1), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]


def _rope(raw: dict[str, Any]) -> RopeConfig:
    """RoPE parameters from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older)."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported (supported: default, yarn)")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if not original:
            raise ConfigError("yarn RoPE needs 'factor' or 'original_max_position_embeddings'")
        factor = raw["max_position_embeddings"] / original
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original or raw.get("max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


# --- runtime configuration ----------------------------------------------------------------

# The tiers, named as vLLM's --kv-cache-dtype: the one list (latentkv.kv.codecs.tiers derives
# each one's codecs from the name), here so this module stays free of imports from the package.
# The mixed tiers (tq4-r8: tq4 latent, fp8 rope key; -r16: bf16 rope key) follow the single-codec ones.
KV_CACHE_DTYPES = (
    "f32",
    "bf16",
    "fp8",
    *(f"tq{b}" for b in range(2, 7)),
    *(f"polar{b}" for b in range(2, 7)),
    *(f"{base}-{r}" for base in ("tq4", "tq3", "polar4") for r in ("r8", "r16")),
)
# Tiers whose latent codec takes --kv-group-size (one scale per group of values).
GROUPED_KV_CACHE_DTYPES = tuple(n for n in KV_CACHE_DTYPES if n not in ("f32", "bf16"))
KV_CACHE_ALIASES = {"auto": "f32", "fp32": "f32", "float32": "f32", "bfloat16": "bf16", "fp8_e4m3": "fp8"}
DEFAULT_ROTATION_SEED = 0x9E3779B9
WEIGHT_DTYPES = ("f32", "bf16")


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
            if self.group_size < 1:
                raise ConfigError(f"--kv-group-size must be positive (got {self.group_size})")
        if self.recent_window < 0:
            raise ConfigError(f"--kv-recent-window must be 0 (off) or positive (got {self.recent_window})")


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
    weight_dtype: str = "f32"
    threads: int | None = None  # None: torch's default
    cache: CacheConfig = field(default_factory=CacheConfig)
    compile: bool = False  # decode one token per step through torch.compile (models/compiled.py)

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"unknown weight dtype {self.weight_dtype!r}; choose from {WEIGHT_DTYPES}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 (got {self.threads})")


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

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("--served-model-name is empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (got {self.port})")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key is empty (leave it out to serve without a key)")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1 (got {self.max_queue})")
        if not 0 <= self.speculative_draft_tokens <= 8:
            raise ConfigError(f"--draft-tokens must be in 1..8 (got {self.speculative_draft_tokens})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2 (got {self.max_model_len})")


def env_api_key() -> str | None:
    """LATENTKV_API_KEY, an alias of --api-key (keeps the key out of the process list)."""
    return os.environ.get("LATENTKV_API_KEY") or None


def env_threads() -> int | None:
    """LATENTKV_THREADS, an alias of --threads."""
    value = os.environ.get("LATENTKV_THREADS")
    return int(value) if value else None


def cache_root() -> Path:
    """The user's cache directory for latentkv: $LATENTKV_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    if explicit := os.environ.get("LATENTKV_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "latentkv"


def sessions_dir() -> Path:
    """Where `--session NAME` keeps its KV files when --kv-dir is not given: cache_root()/sessions."""
    return cache_root() / "sessions"
