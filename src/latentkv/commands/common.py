"""Arguments shared by the commands that run a model, and the configs they become.

The KV tier is chosen here, once: `--kv-cache-dtype` (or the seed system's environment
aliases, read by `config.kv_cache_dtype_from_env`) plus `--kv-group-size`, `--kv-seed` and
`--kv-recent-window` become a `CacheConfig` that the command passes down. Loading the model is
`latentkv.runtime.load`, shared with the server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from latentkv.errors import UserError

ENV_ALIASES = "KV8 / KV_TQ / KV_TQ_POLAR"


MODEL_HELP = (
    "model directory (config.json + safetensors), builtin:NAME, or a Hugging Face repo id in the "
    "local cache, org/name[@revision] (docs/models.md)"
)


def add_model_arguments(p: argparse.ArgumentParser, positional: bool = True, compile: bool = True) -> None:
    if positional:
        p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_weight_arguments(p)
    add_device_argument(p)
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)"
    )
    add_cache_arguments(p)
    add_streaming_arguments(p)
    add_vram_argument(p)
    if compile:
        add_compile_argument(p)


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """--device: where the weights, the KV cache and the activations live."""
    from latentkv.config import DEVICES

    p.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="where the weights, the KV cache and the activations live: cpu (default), cuda, or auto "
        "(cuda when torch sees a CUDA device, else cpu); cuda is refused where torch has no CUDA and "
        "with a cluster; with --ram-gb it needs --vram-gb (docs/gpu.md: never run on a GPU yet)",
    )


def add_vram_argument(p: argparse.ArgumentParser) -> None:
    """--vram-gb: plan one GPU's memory and place the routed experts as `latentkv plan` says."""
    p.add_argument(
        "--vram-gb",
        type=float,
        default=None,
        metavar="V",
        help="with --device cuda: the GPU's memory budget in GiB, split as `latentkv plan MODEL --vram-gb V` "
        "shows: the routed experts resident in VRAM when they fit, else in host RAM (pinned; streamed "
        "from disk when --ram-gb is too small for them) with a cache of them in VRAM (docs/gpu.md: "
        "never run on a GPU yet)",
    )


def add_streaming_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ram-gb",
        type=float,
        default=None,
        metavar="G",
        help="stream the routed experts from disk, keeping the process within G GiB: `latentkv plan` "
        "splits G into dense weights, KV pool, activations and the expert cache (the experts are "
        "converted into an expert store on first use; see docs/experts.md)",
    )
    p.add_argument(
        "--expert-cache-policy",
        default="lru",
        choices=["lru", "lfu", "least-stale"],
        help="eviction policy of the expert cache with --ram-gb (and of the VRAM cache with --vram-gb) "
        "(default: lru)",
    )


class DeviceDefault(str):
    """A --weight-dtype nobody typed: "f32" everywhere, until `settle_weight_default` sees the
    run is on a GPU, where the default is bf16 (the tensor cores' format, as `latentkv plan
    --vram-gb` assumes)."""


def settle_weight_default(args: argparse.Namespace) -> None:
    """An untyped --weight-dtype becomes bf16 when --device resolves to cuda (f32 stays on the
    CPU). Resolving the device here refuses cuda where torch has none, in the same one line."""
    if type(getattr(args, "weight_dtype", None)) is not DeviceDefault:
        return
    device = getattr(args, "device", "cpu")
    if device != "cpu":
        from latentkv.runtime import resolve_device
        from latentkv.streaming.gpu_plan import GPU_WEIGHT_DTYPE

        if resolve_device(device).type == "cuda":
            args.weight_dtype = GPU_WEIGHT_DTYPE


def add_weight_arguments(p: argparse.ArgumentParser, multiple: bool = False) -> None:
    """--weight-dtype (one format, or a comma list when `multiple`) and --expert-dtype."""
    from latentkv.weights import format_names

    formats = format_names()

    names = ", ".join(formats)
    what = "comma-separated weight formats" if multiple else "format of the weight matrices in memory"
    p.add_argument(
        "--weight-dtype",
        default="f32" if multiple else DeviceDefault("f32"),
        choices=None if multiple else formats,
        metavar="LIST" if multiple else "DTYPE",
        help=f"{what}: {names} (default: f32{'' if multiple else ', bf16 with --device cuda'}; "
        "int8 per-channel, int4 group-wise; norms and the router stay f32)",
    )
    p.add_argument(
        "--expert-dtype",
        default=None,
        choices=formats,
        metavar="DTYPE",
        help=f"format of the routed experts: {names} (default: the --weight-dtype)",
    )


def weight_dtypes(value: str) -> list[str]:
    """A --weight-dtype list, checked: each name a known format, one clear error otherwise."""
    from latentkv.weights import format_names

    formats = format_names()

    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in formats]
    if bad or not names:
        raise UserError(
            f"unknown weight dtype {', '.join(bad) or repr(value)}; choose from {', '.join(formats)}"
        )
    return names


def add_compile_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile: faster steps where per-op overhead dominates (1.3-1.9x on "
        "builtin:tiny, 1.0-1.2x on builtin:fixture), after compiling for tens of seconds at start; "
        "needs a C++ compiler; KV tiers f32, bf16, fp8",
    )


def add_cache_arguments(
    p: argparse.ArgumentParser, multiple: bool = False, default: str = "f32", note: str = ""
) -> None:
    """--kv-cache-dtype (one tier, or a comma list / `all` when `multiple`), --kv-group-size, --kv-seed,
    --kv-recent-window."""
    from latentkv.config import KV_CACHE_DTYPES

    names = ", ".join(KV_CACHE_DTYPES)
    if multiple:
        what = f"comma-separated KV tiers or 'all' (default: {default}); tiers: {names}"
    else:
        what = f"storage of the latent KV cache (default: {default}); one of: {names}"
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        metavar="LIST" if multiple else "DTYPE",
        help=f"{what}. Without the flag, the environment aliases {ENV_ALIASES} apply{note}",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        metavar="N",
        help="fp8, tq*, polar*: one scale per N values instead of one per row (N must divide "
        "kv_lora_rank; the rope key is grouped too when N divides its width; tq*/polar* group the "
        "rotated coordinates)",
    )
    p.add_argument(
        "--kv-seed",
        type=_seed,
        default=None,
        metavar="S",
        help="rotation seed of the tq*/polar* tiers (default: 0x9E3779B9; decimal or 0x hex)",
    )
    p.add_argument(
        "--kv-recent-window",
        type=int,
        default=None,
        metavar="N",
        help="read the N most recent tokens' rows in full precision (float32), older ones in the "
        "tier (default: 0, off; the KV file still stores every row in the tier)",
    )


def _seed(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"the seed must be in 0 .. 2^64 - 1, got {value}")
    return value


def kv_cache_dtype_text(flag: str | None, default: str, environ: dict[str, str] | None = None) -> str:
    """The --kv-cache-dtype text to use: the flag, else the environment's alias, else `default`.

    Notices go to stderr: the alias's own (KV_TQ=1 lands on tq4, ...), that the environment
    chose the tier, or that the flag overrides the environment.
    """
    from latentkv.config import ConfigError, kv_cache_dtype_from_env

    try:
        env_tier, notices = kv_cache_dtype_from_env(environ)
    except ConfigError as exc:
        if flag is None:
            raise UserError(str(exc)) from None
        _note(f"{exc}; ignored, --kv-cache-dtype {flag} is given")
        return flag
    if flag is not None:
        if env_tier is not None:
            _note(f"--kv-cache-dtype {flag} overrides the environment's {env_tier} ({ENV_ALIASES})")
        return flag
    for notice in notices:
        _note(notice)
    if env_tier is None:
        return default
    _note(f"KV tier {env_tier}, from the environment ({ENV_ALIASES}); --kv-cache-dtype overrides it")
    return env_tier


def _note(text: str) -> None:
    print(f"latentkv: {text}", file=sys.stderr)


def cache_config(args: argparse.Namespace, default: str = "f32"):
    """One CacheConfig from --kv-cache-dtype / the environment, --kv-group-size and --kv-seed."""
    from latentkv.config import CacheConfig, ConfigError

    name = kv_cache_dtype_text(args.kv_cache_dtype, default)
    try:
        return CacheConfig(name, **_cache_params(args))
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def cache_configs(args: argparse.Namespace, default: str = "all") -> list:
    """A CacheConfig per tier of a comma list (or `all`); --kv-group-size applies to the tiers
    that take groups (fp8, tq*, polar* and the mixed tq*-r*), the other flags to every tier."""
    from latentkv.config import GROUPED_KV_CACHE_DTYPES, CacheConfig, ConfigError, parse_kv_cache_dtypes

    text = kv_cache_dtype_text(args.kv_cache_dtype, default)
    params = _cache_params(args)
    try:
        names = list(dict.fromkeys(parse_kv_cache_dtypes(text)))
        grouped = [n for n in names if n in GROUPED_KV_CACHE_DTYPES]
        if params.get("group_size") is not None and not grouped:
            raise ConfigError(f"--kv-group-size applies to fp8, tq* and polar* tiers, and {text!r} has none")
        return [
            CacheConfig(n, **{k: v for k, v in params.items() if k != "group_size" or n in grouped})
            for n in names
        ]
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def _cache_params(args: argparse.Namespace) -> dict:
    params: dict = {}
    if args.kv_group_size is not None:
        params["group_size"] = args.kv_group_size
    if args.kv_seed is not None:
        params["rotation_seed"] = args.kv_seed
    if args.kv_recent_window is not None:
        params["recent_window"] = args.kv_recent_window
    return params


def engine_config(args: argparse.Namespace):
    from latentkv.config import ConfigError, EngineConfig, env_threads

    cache = cache_config(args)
    try:
        return EngineConfig(
            weight_dtype=args.weight_dtype,
            expert_dtype=getattr(args, "expert_dtype", None),
            threads=args.threads if args.threads is not None else env_threads(),
            cache=cache,
            compile=getattr(args, "compile", False),
            ram_gb=getattr(args, "ram_gb", None),
            vram_gb=getattr(args, "vram_gb", None),
            expert_policy=getattr(args, "expert_cache_policy", "lru"),
            cluster=cluster_config(args) if hasattr(args, "cluster_timeout") else None,
            device=getattr(args, "device", "cpu"),
        )
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    p.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=["mtp"],
        default=None,
        help="draft tokens with the model's own MTP layer and verify them in one pass (lossless; default: "
        "off). With --ram-gb leave it off unless `latentkv bench speculative --ram-gb` measures it faster "
        "on your disk and budget (docs/speculative.md)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        help="tokens the MTP layer drafts per verify step, 1..8 (default: 1; needs --speculative mtp)",
    )


def speculative_config(args: argparse.Namespace, model_arg: str | None = None):
    """The SpeculativeConfig of `add_speculative_arguments`'s flags, or None; with `model_arg`,
    refuses a model whose config.json declares no MTP layer (before any weights load)."""
    from latentkv.engine.speculative import SpeculativeConfig

    if args.speculative is None:
        if args.draft_tokens is not None:
            raise UserError("--draft-tokens needs --speculative mtp")
        return None
    try:
        spec = SpeculativeConfig(args.speculative, 1 if args.draft_tokens is None else args.draft_tokens)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if model_arg is not None:
        from latentkv.config import ConfigError, ModelConfig
        from latentkv.models.registry import ModelNotFound, resolve

        try:
            directory = resolve(model_arg)
            mtp_layers = ModelConfig.from_hf(directory).num_mtp_layers
        except (ConfigError, ModelNotFound, OSError):
            return spec  # `load` reports the model's problem
        if not mtp_layers:
            raise UserError(_NO_MTP)
        if getattr(args, "ram_gb", None) is not None:
            _check_streamed_mtp(args, directory)
    return spec


def _check_streamed_mtp(args: argparse.Namespace, directory) -> None:
    """--speculative mtp with --ram-gb: the expert store the run would use (if it exists yet)
    must hold the MTP layer's experts (stores converted before they were written do not)."""
    from latentkv.streaming.attach import default_store_dir, mtp_store_problem

    weight_dtypes = str(getattr(args, "weight_dtype", "f32") or "f32").split(",")
    for dtype in weight_dtypes:
        fmt = getattr(args, "expert_dtype", None) or dtype.strip()
        try:
            problem = mtp_store_problem(directory, default_store_dir(directory, fmt))
        except (ValueError, OSError):
            return  # `load` reports the checkpoint's problem
        if problem is not None:
            raise UserError(problem)


_NO_MTP = (
    "--speculative mtp needs a model with an MTP (multi-token prediction) layer; this one has none "
    "(config.json: num_nextn_predict_layers is 0)"
)


def draft_tokens(spec) -> int:
    """Tokens drafted per step under `spec` (a SpeculativeConfig or None): 0 when not drafting."""
    return 0 if spec is None else spec.draft_tokens


def check_speculative(model, spec) -> None:
    """Refuse drafting on a loaded model without MTP weights."""
    from latentkv.engine.speculative import check_model

    if spec is not None:
        try:
            check_model(model)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def sampling_params(args: argparse.Namespace):
    """The validated SamplingParams of `add_sampling_arguments`'s flags."""
    from latentkv.engine.sampling import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as exc:  # the shared check (engine.sampling.check_sampling), named as a flag
        flag = "--" + getattr(exc, "param", "sampling").replace("_", "-")
        raise UserError(f"{flag}: {exc}") from None


def check_text(text: str, flag: str) -> str:
    """`text` unchanged, or UserError naming the flag when it is not valid Unicode (an argument
    with bytes that are not UTF-8 reaches Python as surrogates)."""
    from latentkv.tokenizer import is_valid_text, unicode_problem

    if not is_valid_text(text):
        raise UserError(f"{flag} is not valid UTF-8 text: {unicode_problem(text)}")
    return text


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UserError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def describe_tier(tier) -> str:
    """One line for humans: what a row of a cache of this `KVTier` holds, e.g. 'fp8: c 512+4 B, r 64+4 B'."""
    if tier.exact:
        return "f32: c and r as float32"
    params = tier.params()
    parts = []
    for part, codec in (("c", tier.codec_c), ("r", tier.codec_r)):
        parts.append(f"{part} {codec.code_bytes}+{4 * codec.scale_count} B")
    extra = {k: v for k, v in params["c"].items() if k in ("group_size", "rotation_seed") and v is not None}
    tail = "".join(f", {k} {hex(v) if k == 'rotation_seed' else v}" for k, v in extra.items())
    if tier.recent_window:
        tail += f", the last {tier.recent_window} tokens read in f32"
    return f"{tier.name}: {', '.join(parts)}{tail}"


def emit(payload: dict, args: argparse.Namespace, table) -> None:
    """A command's result: JSON to `--out` if given, then JSON (`--json`) or `table(payload)` on stdout."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload, indent=1) if args.json else table(payload))


# --- a cluster (torchrun: WORLD_SIZE > 1; docs/distributed.md) ------------------------------


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a rank of a cluster; they apply when torchrun (or torch's env:// variables,
    WORLD_SIZE > 1) starts the command."""
    g = p.add_argument_group(
        "cluster",
        "started by torchrun (WORLD_SIZE > 1) the command runs expert-parallel: rank 0 runs the model, "
        "every rank streams its share of the experts within its own --ram-gb (docs/distributed.md)",
    )
    g.add_argument(
        "--cluster-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a rank that does not answer within S seconds is lost: the requests in flight fail (default: 60)",
    )
    g.add_argument(
        "--cluster-start-timeout",
        type=float,
        default=None,
        metavar="S",
        help="every rank joins (and writes its share of the experts, on first use) within S seconds (default: 900)",
    )
    g.add_argument(
        "--cluster-secret",
        default=None,
        metavar="TOKEN",
        help="refuse a rank that does not present the same token at start-up (default: "
        "$LATENTKV_CLUSTER_SECRET, else none). It keeps out a stray process, not an attacker: the "
        "traffic is neither authenticated nor encrypted, run it on a trusted LAN only",
    )
    g.add_argument(
        "--placement",
        type=Path,
        default=None,
        metavar="FILE",
        help="which rank owns which expert: FILE from `latentkv plan MODEL --nodes N --placement-out FILE` "
        "(default: the head places them by expected load, each rank's budget and disk speed); every rank "
        "must be given the same FILE",
    )
    g.add_argument(
        "--no-head-experts",
        action="store_true",
        help="the head (rank 0) owns no experts: the workers hold them all",
    )
    g.add_argument(
        "--disk-gbps",
        type=float,
        default=None,
        metavar="S",
        help="this rank's disk read speed for placement (default: measured once on its expert store)",
    )


def cluster_config(args: argparse.Namespace):
    """This process's ClusterConfig when torch's env:// variables say WORLD_SIZE > 1, else None
    (and a cluster flag without them is refused)."""
    from latentkv.config import ClusterConfig, ConfigError, cluster_env, env_cluster_secret

    try:
        env = cluster_env()
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    flags = {
        "timeout_s": getattr(args, "cluster_timeout", None),
        "start_timeout_s": getattr(args, "cluster_start_timeout", None),
        "secret": getattr(args, "cluster_secret", None) or env_cluster_secret(),
        "placement": getattr(args, "placement", None),
        "disk_gbps": getattr(args, "disk_gbps", None),
    }
    no_head = getattr(args, "no_head_experts", False)
    if env is None:
        given = [
            f
            for f in ("cluster_timeout", "cluster_start_timeout", "cluster_secret", "placement", "disk_gbps")
            if getattr(args, f, None) is not None
        ] + (["no_head_experts"] if no_head else [])
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(f"{flag} applies to a cluster: start the command with torchrun (WORLD_SIZE > 1)")
        return None
    try:
        return ClusterConfig(
            **env, **{k: v for k, v in flags.items() if v is not None}, head_experts=not no_head
        )
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def run_as_worker(args: argparse.Namespace) -> int | None:
    """On a worker rank of a cluster: serve the head until it ends and return the exit status.
    None on the head, or without a cluster (the command runs as usual)."""
    cfg = cluster_config(args)
    if cfg is None or cfg.is_head:
        return None
    from latentkv.cluster.worker import run_worker
    from latentkv.config import ConfigError, EngineConfig, env_threads

    try:  # a worker holds experts only: no KV tier, no dense weights
        engine = EngineConfig(
            weight_dtype=str(args.weight_dtype).split(",")[0].strip(),
            expert_dtype=getattr(args, "expert_dtype", None),
            threads=args.threads if args.threads is not None else env_threads(),
            ram_gb=getattr(args, "ram_gb", None),
            expert_policy=getattr(args, "expert_cache_policy", "lru"),
        )
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None
    return run_worker(cfg, args.model, engine)
