"""The oracle: tiny random models built by transformers, and our engine checked against them.

Each spec is a transformers config and a seed. `build` makes the checkpoint deterministically;
`reference` runs transformers on it (a fixed prompt, teacher-forced argmax at every position,
greedy tokens, a digest of the logits); `check` runs our engine on the same checkpoint and
compares. References are committed under `eval/references/` so a change in either side shows.

Teacher forcing uses the sequence prompt + transformers' greedy continuation, so with a
12-token prompt and 20 greedy tokens it scores 32 positions ("32/32").

`check_tiers` runs transformers once per model and our engine once per KV tier (and per weight
format: f32 weights, then each of `more_weights`, e.g. int8 and int4). f32 is the gate (exact
agreement, logits within LOGIT_TOLERANCE); the lossy tiers (bf16, fp8, tq*, polar*) and the
quantized weight formats report their agreement and logit error and never fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from latentkv.config import CacheConfig

CPU = torch.device("cpu")  # the oracle compares with transformers on the CPU

if TYPE_CHECKING:
    from latentkv.models.model import Model

REFERENCE_DIR = Path(__file__).parent / "references"
PROMPT_LEN = 12
GREEDY_TOKENS = 20
LOGIT_TOLERANCE = 1e-4
GATED_TIER = "f32"  # the only tier that must match exactly; the others report their agreement

# The seed system's shape (vocab 256, hidden 128, 5 layers with 3 dense, 4 heads, 8 experts
# top-2 + 1 shared, q_lora 64, kv_lora 32, qk_nope 24, qk_rope 8, v_head 32).
_SEED_SHAPE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=5,
    first_k_dense_replace=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=32,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
)


@dataclass(frozen=True)
class OracleSpec:
    name: str
    model_type: str
    config: dict[str, Any]
    seed: int
    description: str
    extra: dict[str, Any] = field(default_factory=dict)

    def hf_config(self):
        import transformers

        cls = {
            "glm_moe_dsa": transformers.GlmMoeDsaConfig,
            "deepseek_v3": transformers.DeepseekV3Config,
            "deepseek_v32": transformers.DeepseekV32Config,
        }
        return cls[self.model_type](**self.config)


SPECS: dict[str, OracleSpec] = {
    spec.name: spec
    for spec in [
        OracleSpec(
            "glm5-tiny",
            "glm_moe_dsa",
            {**_SEED_SHAPE, "index_topk": 64, "index_head_dim": 32, "index_n_heads": 16},
            seed=0,
            description="GLM-5 tiny, the seed system's shape; index_topk 64 > context, so DSA is inactive",
        ),
        OracleSpec(
            "glm5-tiny-dsa",
            "glm_moe_dsa",
            {
                **_SEED_SHAPE,
                "index_topk": 8,
                "index_head_dim": 32,
                "index_n_heads": 16,
                "indexer_types": ["full", "shared", "full", "shared", "shared"],
            },
            seed=1,
            description="GLM-5 tiny with index_topk 8 < context: DSA selects, full and shared indexer layers",
        ),
        OracleSpec(
            "dsv3-tiny",
            "deepseek_v3",
            {
                **_SEED_SHAPE,
                "n_group": 4,
                "topk_group": 2,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
            },
            seed=2,
            description="DeepSeek-V3 tiny: grouped top-k routing (4 groups, 2 kept) and YaRN RoPE",
        ),
        OracleSpec(
            "dsv3-tiny-noqlora",
            "deepseek_v3",
            {**_SEED_SHAPE, "q_lora_rank": None, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
            seed=3,
            description="DeepSeek-V3 tiny without q-LoRA (a plain q_proj, as in DeepSeek-V2-Lite)",
        ),
        OracleSpec(
            "dsv32-tiny-dsa",
            "deepseek_v32",
            {
                **_SEED_SHAPE,
                "index_topk": 8,
                "index_head_dim": 32,
                "index_n_heads": 16,
                "n_group": 1,
                "topk_group": 1,
            },
            seed=4,
            description="DeepSeek-V3.2 tiny with index_topk 8: the indexer's half-split RoPE, DSA selecting",
        ),
    ]
}


def build(spec: OracleSpec, directory: Path) -> Path:
    """Build the tiny random model with transformers from the spec's seed and save it."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32).eval()
    model.save_pretrained(directory)
    from latentkv.tokenizer import byte_level_tokenizer_json

    (directory / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return directory


def prompt_ids(spec: OracleSpec) -> list[int]:
    g = torch.Generator().manual_seed(1000 + spec.seed)
    return torch.randint(2, spec.config["vocab_size"], (PROMPT_LEN,), generator=g).tolist()


def logits_digest(logits: torch.Tensor) -> dict[str, Any]:
    """A compact fingerprint of a [N, vocab] float32 logits tensor."""
    rounded = torch.round(logits.double() * 1e3).to(torch.int64)  # 1e-3 grid: stable across BLAS
    return {
        "sha256_1e-3": hashlib.sha256(rounded.numpy().tobytes()).hexdigest()[:16],
        "sum": round(float(logits.double().sum()), 3),
        "abs_sum": round(float(logits.double().abs().sum()), 3),
    }


def hf_reference(spec: OracleSpec, directory: Path) -> tuple[dict[str, Any], torch.Tensor]:
    """Run transformers on the checkpoint: greedy tokens, TF argmax, digest; plus its logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = prompt_ids(spec)
    with torch.no_grad():
        # A plain greedy loop over transformers' own cache (generate() would stop at or
        # suppress the EOS token; the oracle wants the raw argmax chain).
        out = model(torch.tensor([prompt]), use_cache=True)
        greedy = [int(out.logits[0, -1].argmax())]
        while len(greedy) < GREEDY_TOKENS:
            out = model(torch.tensor([greedy[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            greedy.append(int(out.logits[0, -1].argmax()))
        logits = model(torch.tensor([prompt + greedy])).logits[0].float()  # [32, vocab]
    ref = {
        "name": spec.name,
        "model_type": spec.model_type,
        "description": spec.description,
        "seed": spec.seed,
        "transformers": transformers.__version__,
        "prompt_ids": prompt,
        "greedy": greedy,
        "tf_argmax": logits.argmax(-1).tolist(),
        "logits_digest": logits_digest(logits),
    }
    return ref, logits


def ours(
    model: Model, prompt: list[int], sequence: list[int], cache: CacheConfig | None = None
) -> tuple[list[int], torch.Tensor]:
    """Our engine over a cache of the given tier (f32 by default): greedy tokens from the prompt,
    and teacher-forced logits over the sequence in one pass."""
    from latentkv.engine.generate import generate
    from latentkv.engine.sampling import SamplingParams

    tier = model.tier(cache)
    result = generate(
        model, prompt, GREEDY_TOKENS, SamplingParams(), cache=model.make_cache(tier), stop_ids=()
    )
    tf_logits = model.forward(torch.tensor(sequence), model.make_cache(tier), all_logits=True)
    return result.tokens, tf_logits


@dataclass
class OracleRow:
    """One model under one KV tier. `ok` is the gate, and only f32 is gated (it must be exact);
    the lossy tiers report their agreement with `ok` None."""

    name: str
    tf: str
    greedy: str
    max_abs_logit_diff: float | None
    reference_matches: bool
    seconds: float
    ok: bool | None
    kv_cache_dtype: str = "f32"
    greedy_prefix: int = 0  # leading greedy tokens equal to transformers' (where a lossy tier drifts)
    weight_dtype: str = "f32"

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def check(
    spec: OracleSpec, directory: Path, reference: dict[str, Any] | None = None, weight_dtype: str = "f32"
) -> OracleRow:
    """Compare our engine (f32 cache) with transformers (live) on one tiny model."""
    return check_tiers(spec, directory, reference, [CacheConfig()], weight_dtype)[0]


def check_tiers(
    spec: OracleSpec,
    directory: Path,
    reference: dict[str, Any] | None,
    caches: list[CacheConfig],
    weight_dtype: str = "f32",
    more_weights: tuple[str, ...] = (),
) -> list[OracleRow]:
    """Transformers once on this model, then our engine once per (weight format, KV tier); one
    row each. Only `weight_dtype` with the f32 cache can gate; `more_weights` report."""
    from latentkv.models.weights import load_model

    live, hf_logits = hf_reference(spec, directory)
    prompt = live["prompt_ids"]
    sequence = prompt + live["greedy"]
    ref_ok = reference is None or all(reference[k] == live[k] for k in ("prompt_ids", "greedy", "tf_argmax"))
    rows = []
    for weights in dict.fromkeys([weight_dtype, *more_weights]):
        model = load_model(directory, weights, device=CPU)
        for cache in caches:
            t0 = time.perf_counter()
            greedy, tf_logits = ours(model, prompt, sequence, cache)
            seconds = time.perf_counter() - t0
            theirs, mine = (live["greedy"], hf_logits), (greedy, tf_logits)
            row = _row(
                spec.name, cache.kv_cache_dtype, theirs, mine, ref_ok, seconds, weights != weight_dtype
            )
            rows.append(dataclasses.replace(row, weight_dtype=weights))
    return rows


def _row(
    name: str, tier: str, theirs: tuple, mine: tuple, ref_ok: bool, seconds: float, report_only: bool = False
) -> OracleRow:
    """Compare (greedy tokens, teacher-forced logits [N, vocab]) of both engines."""
    (hf_greedy, hf_logits), (greedy, tf_logits) = theirs, mine
    n = hf_logits.shape[0]
    tf_hits = int((tf_logits.argmax(-1) == hf_logits.argmax(-1)).sum())
    same = [int(a == b) for a, b in zip(greedy, hf_greedy, strict=True)]
    prefix = same.index(0) if 0 in same else len(same)
    diff = float((tf_logits - hf_logits).abs().max())
    ok = None
    if tier == GATED_TIER and not report_only:
        ok = tf_hits == n and sum(same) == GREEDY_TOKENS and diff <= LOGIT_TOLERANCE and ref_ok
    return OracleRow(
        name, f"{tf_hits}/{n}", f"{sum(same)}/{GREEDY_TOKENS}", diff, ref_ok, seconds, ok, tier, prefix
    )


def reference_path(name: str) -> Path:
    return REFERENCE_DIR / f"{name}.json"


def load_reference(name: str) -> dict[str, Any] | None:
    path = reference_path(name)
    return json.loads(path.read_text()) if path.exists() else None


def model_dir(name: str, root: Path | None = None) -> Path:
    """Where the tiny checkpoint lives: the bundled one for glm5-tiny, else a built cache."""
    if name == "glm5-tiny":
        from latentkv.models.registry import builtin_path

        return builtin_path("tiny")
    from latentkv.models.registry import cache_root

    spec = SPECS[name]
    tag = hashlib.sha256(json.dumps([spec.model_type, spec.config, spec.seed], sort_keys=True).encode())
    return (root or cache_root() / "oracle") / f"{name}-{tag.hexdigest()[:10]}"


def ensure_built(name: str, root: Path | None = None) -> Path:
    directory = model_dir(name, root)
    if not (directory / "model.safetensors").exists():
        build(SPECS[name], directory)
    return directory
