"""What each KV tier costs and how much it distorts: the numbers behind `latentkv kv stats`.

Per tier, for one model's cache layout (GLM-5's by default):

    bytes        c and r each cost their codec's bytes_per_row; per token = that x layers
    compression  f32 / tier and bf16 / tier, both from the codecs' own byte counts
    rel-L2       mean over rows of ||x - x_hat|| / ||x||, for the whole row [c | r] and for c
                 and r alone; x_hat = decode(encode(x)) with the tier's codec pair. On N(0, 1)
                 rows, and (given a model) on the latent rows of a real forward pass
    max context  the most tokens whose cache fits in a RAM budget, with and without the DSA
                 indexer keys (float32, index_head_dim per token on every full indexer layer)

Nothing here is hard-coded per tier: every byte count comes from the resolved tier (`kv.cache.KVTier`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv.cache import SHAPES_ONLY, CacheLayout, resolve_tier
from latentkv.kv.codecs import Codec

GIB = 1 << 30
GAUSSIAN_SEED = 0  # the N(0, 1) rows are drawn from a fixed seed so the report reproduces

# The parts of zai-org/GLM-5's published config.json that shape the cache (plus the fields our
# config reader requires). It names no `indexer_types` or `index_topk_freq`, so the schedule
# transformers derives (and `ModelConfig.from_hf` with it) makes every layer a full indexer layer.
GLM5_CONFIG: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 202752,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
}
GLM5_ASSUMPTIONS = (
    "GLM-5 dims from zai-org/GLM-5's config.json: 78 layers, kv_lora_rank 512, qk_rope_head_dim 64, "
    "index_head_dim 128. The config names no indexer_types / index_topk_freq, so (as transformers "
    "derives it) all 78 layers are full indexer layers, each caching float32 indexer keys"
)

# A paragraph to tokenize when a model brings a tokenizer (real rows from real text).
SAMPLE_TEXT = (
    "The attention cache of a multi-head latent attention model holds one compressed row per token "
    "per layer. Quantizing that row trades a little accuracy for a much longer context: the same "
    "memory holds four to eight times more tokens. def fib(n):\n    return n if n < 2 else "
    "fib(n - 1) + fib(n - 2)\n"
)


def glm5_config() -> ModelConfig:
    return ModelConfig.from_hf(GLM5_CONFIG)


@dataclass(frozen=True)
class RelL2:
    """Mean relative L2 error over rows: the whole row [c | r], and c and r alone."""

    row: float
    c: float
    r: float


@dataclass
class TierStats:
    kv_cache_dtype: str
    codec: dict[str, Any]  # {"c": params, "r": params}
    bytes_c: int
    bytes_r: int
    bytes_per_token_per_layer: int
    bytes_per_token: int  # latent rows over every layer
    index_bytes_per_token: int
    vs_f32: float
    vs_bf16: float
    max_context: int  # latent rows + indexer keys in the budget
    max_context_latent_only: int
    gaussian: RelL2 | None = None
    real: RelL2 | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bytes_stats(layout: CacheLayout, cache: CacheConfig, ram_bytes: int) -> TierStats:
    """Bytes, compression and the context that fits in `ram_bytes`, for one tier; ValueError if
    the tier cannot store these widths."""
    tier = resolve_tier(layout, cache)
    per_layer = tier.bytes_per_token_layer
    f32, bf16 = (resolve_tier(layout, CacheConfig(name)).bytes_per_token_layer for name in ("f32", "bf16"))
    per_token = per_layer * layout.num_layers
    index = layout.index_bytes_per_token
    return TierStats(
        kv_cache_dtype=tier.name,
        codec=tier.params(),
        bytes_c=tier.codec_c.bytes_per_row,
        bytes_r=tier.codec_r.bytes_per_row,
        bytes_per_token_per_layer=per_layer,
        bytes_per_token=per_token,
        index_bytes_per_token=index,
        vs_f32=round(f32 / per_layer, 3),
        vs_bf16=round(bf16 / per_layer, 3),
        max_context=ram_bytes // (per_token + index),
        max_context_latent_only=ram_bytes // per_token,
    )


def roundtrip_error(codec_c: Codec, codec_r: Codec, rows: torch.Tensor) -> RelL2:
    """rows [N, Lkv+R] float32 -> mean relative L2 of decode(encode(.)), whole row and per part."""
    n = codec_c.width
    c, r = rows[:, :n].contiguous(), rows[:, n:].contiguous()
    c_hat, r_hat = codec_c.decode(codec_c.encode(c)), codec_r.decode(codec_r.encode(r))
    return RelL2(
        row=_mean_rel(rows, torch.cat([c_hat, r_hat], dim=-1)),
        c=_mean_rel(c, c_hat),
        r=_mean_rel(r, r_hat),
    )


def _mean_rel(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    norm = x.double().norm(dim=-1)  # [N]
    keep = norm > 0  # an all-zero row has no relative error to speak of
    err = (x.double() - x_hat.double()).norm(dim=-1)[keep] / norm[keep]
    return round(float(err.mean()), 5)


def gaussian_rows(layout: CacheLayout, n: int, seed: int = GAUSSIAN_SEED) -> torch.Tensor:
    """n rows [n, Lkv+R] of N(0, 1) values."""
    return torch.randn(n, layout.row_width, generator=torch.Generator().manual_seed(seed))


def prompt_tokens(cfg: ModelConfig, tokenizer, n: int, seed: int = 0) -> list[int]:
    """n prompt tokens: the sample text (repeated) through the tokenizer, else seeded random ids."""
    n = min(n, cfg.max_position_embeddings)
    if tokenizer is not None:
        ids = tokenizer.encode(SAMPLE_TEXT)
        if ids:
            return (ids * (n // len(ids) + 1))[:n]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()


def real_rows(model, tokens: list[int]) -> torch.Tensor:
    """One f32 forward pass over `tokens`; every layer's cached rows, stacked [layers * T, Lkv+R]."""
    cache = model.make_cache()
    with torch.no_grad():
        model.forward(torch.tensor(tokens, dtype=torch.long, device=model.device), cache)
    return torch.cat([cache.view(layer) for layer in range(model.cfg.num_layers)])


def tier_stats(
    layout: CacheLayout,
    cache: CacheConfig,
    ram_bytes: int,
    gaussian: torch.Tensor,
    real: torch.Tensor | None = None,
) -> TierStats:
    """Everything `kv stats` reports for one tier; ValueError if the tier can't store these widths."""
    stats = bytes_stats(layout, cache, ram_bytes)
    tier = resolve_tier(layout, cache)
    stats.gaussian = roundtrip_error(tier.codec_c, tier.codec_r, gaussian)
    if real is not None:
        stats.real = roundtrip_error(tier.codec_c, tier.codec_r, real)
    return stats


def report(
    cfg: ModelConfig,
    caches: list[CacheConfig],
    ram_gib: float,
    gaussian_n: int,
    real: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The whole `kv stats` report as plain data; a tier the widths refuse gets an `error`."""
    layout = CacheLayout.for_model(cfg, SHAPES_ONLY)  # sizes and codecs only
    ram_bytes = int(ram_gib * GIB)
    gaussian = gaussian_rows(layout, gaussian_n)
    tiers: list[dict[str, Any]] = []
    for cache in caches:
        try:
            tiers.append(tier_stats(layout, cache, ram_bytes, gaussian, real).as_dict())
        except ValueError as exc:
            tiers.append({"kv_cache_dtype": cache.kv_cache_dtype, "error": str(exc)})
    return {
        "dims": {
            "model_type": cfg.model_type,
            "num_layers": layout.num_layers,
            "kv_lora_rank": layout.kv_lora_rank,
            "qk_rope_head_dim": layout.row_width - layout.kv_lora_rank,
            "index_head_dim": layout.index_head_dim,
            "index_layers": len(layout.index_layers),
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        "ram_gib": ram_gib,
        "gaussian_rows": gaussian_n,
        "gaussian_seed": GAUSSIAN_SEED,
        "real_rows": None if real is None else real.shape[0],
        "tiers": tiers,
    }


def table(payload: dict[str, Any]) -> str:
    """The report as a markdown table."""
    ram = f"{payload['ram_gib']:g} GiB"
    lines = [
        "| tier | B/token/layer (c + r) | B/token | vs f32 | vs bf16 | rel-L2 gaussian row (c, r) "
        f"| rel-L2 real row (c, r) | max context in {ram}: with indexer keys | latent only |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in payload["tiers"]:
        if "error" in t:
            lines.append(f"| {t['kv_cache_dtype']} | refused: {t['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {t['kv_cache_dtype']} | {t['bytes_per_token_per_layer']:,} ({t['bytes_c']} + {t['bytes_r']}) "
            f"| {t['bytes_per_token']:,} | {t['vs_f32']:.2f}x | {t['vs_bf16']:.2f}x "
            f"| {_rel(t['gaussian'])} | {_rel(t['real'])} "
            f"| {t['max_context']:,} | {t['max_context_latent_only']:,} |"
        )
    return "\n".join(lines)


def _rel(e: dict[str, float] | None) -> str:
    if e is None:
        return "-"
    return f"{e['row']:.4f} ({e['c']:.4f}, {e['r']:.4f})"
