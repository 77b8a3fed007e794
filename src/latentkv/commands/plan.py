"""`latentkv plan MODEL`: how a RAM budget splits between dense weights, the KV pool,
activations and the expert cache, and what that means for reads per token (and, with
`--disk-gbps`, for tokens per second). MODEL may be a config.json, or a folder holding only one:
a model is planned before it is downloaded. With `--vram-gb V`: the same for one GPU
(streaming/gpu_plan.py), VRAM and host RAM each with their share. With `--nodes N`: the same for
a cluster of N ranks (docs/distributed.md), each rank's share of the experts, and the placement
(`--placement-out FILE`) that `experts convert --rank` and the cluster's ranks use."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from latentkv.commands.common import (
    MODEL_HELP,
    add_cache_arguments,
    add_speculative_arguments,
    cache_config,
    speculative_config,
)
from latentkv.errors import UserError

MAX_NODES = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    from latentkv.weights import format_names

    formats = format_names()

    p.add_argument("model", metavar="MODEL", help=MODEL_HELP + "; or a config.json alone")
    p.add_argument(
        "--ram-gb",
        default=None,
        metavar="G",
        help="RAM budget in GiB (default: 80%% of available memory, or of the cgroup limit when lower); "
        "with --nodes one budget for every rank or one per rank (G0,G1,...; rank 0 is the head)",
    )
    p.add_argument(
        "--vram-gb",
        type=float,
        default=None,
        metavar="V",
        help="plan for one GPU with V GiB of memory: dense weights, KV pool and activations in VRAM, "
        "the routed experts in VRAM when they fit, else pinned in host RAM (--ram-gb) or streamed from "
        "disk, with the hottest cached in VRAM (what generate, chat, serve and bench decode load with "
        "--device cuda --vram-gb V)",
    )
    p.add_argument(
        "--weight-dtype",
        default=None,
        choices=formats,
        help="weight format of the dense weights (and of the experts unless --expert-dtype; default: "
        "f32; bf16 with --vram-gb)",
    )
    p.add_argument(
        "--expert-dtype", default=None, choices=formats, help="weight format of the routed experts"
    )
    add_cache_arguments(p)
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences decoded together (default: 1)")
    add_speculative_arguments(p)
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="plan a cluster of N ranks (expert parallelism over torch.distributed): each rank's share "
        "of the experts, its cache and reads per token, the whole's disk-bound tok/s",
    )
    p.add_argument(
        "--disk-gbps",
        default=None,
        metavar="S",
        help="the disk's read speed in GB/s: bound decode tok/s by the expert reads per token (a model "
        "not yet downloaded has no store to measure; `latentkv experts disk` measures one); with "
        "--nodes one for every rank or one per rank (default there: 1)",
    )
    p.add_argument(
        "--no-head-experts",
        action="store_true",
        help="with --nodes: the head (rank 0) owns no experts; the workers hold them all",
    )
    p.add_argument(
        "--placement-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --nodes: write the placement (which rank owns which expert) to FILE, for "
        "`latentkv experts convert --placement FILE --rank R` and the ranks' --placement FILE",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from latentkv.config import MAX_SEQS, ConfigError, ModelConfig, check_number, check_tokens
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve

    check_tokens("--max-model-len", args.max_model_len)
    check_number("--max-num-seqs", args.max_num_seqs, 1, MAX_SEQS, integer=True)
    cluster = args.nodes is not None
    if args.vram_gb is not None and (cluster or not args.vram_gb > 0):
        raise UserError(
            "--vram-gb plans one GPU: drop --nodes"
            if cluster
            else f"--vram-gb must be positive (got {args.vram_gb:g})"
        )
    if args.weight_dtype is None:
        from latentkv.streaming.gpu_plan import GPU_WEIGHT_DTYPE

        args.weight_dtype = GPU_WEIGHT_DTYPE if args.vram_gb is not None else "f32"
    if not cluster and (args.no_head_experts or args.placement_out):
        raise UserError("--no-head-experts and --placement-out plan a cluster: add --nodes N")
    if cluster and not 1 <= args.nodes <= MAX_NODES:
        raise UserError(f"--nodes must be in 1..{MAX_NODES} (got {args.nodes})")
    rams = per_rank(args.ram_gb, "--ram-gb", args.nodes if cluster else 1)
    speeds = per_rank(args.disk_gbps, "--disk-gbps", args.nodes if cluster else 1)
    spec = speculative_config(args, args.model)
    draft_tokens = spec.draft_tokens if spec is not None else 0
    try:
        config_only = Path(args.model).suffix == ".json" and Path(args.model).is_file()
        model_dir = None if config_only else resolve(args.model)
        cfg = ModelConfig.from_hf(Path(args.model) if config_only else model_dir)
        cache = cache_config(args)
        if cluster:
            if model_dir is None:
                raise UserError("--nodes plans a model folder: put the config.json in a folder of its own")
            return _cluster(args, cfg, model_dir, rams, cache, draft_tokens)
        if args.vram_gb is not None:
            if model_dir is None:
                raise UserError("--vram-gb plans a model folder: put the config.json in a folder of its own")
            return _gpu(args, cfg, model_dir, rams, cache, draft_tokens)
        from latentkv.streaming.planner import format_plan, make_plan

        ram = None if rams is None else int(rams[0] * (1 << 30))
        plan = make_plan(
            cfg,
            model_dir,
            ram,
            args.weight_dtype,
            cache,
            args.max_model_len,
            args.max_num_seqs,
            draft_tokens=draft_tokens,
            expert_dtype=args.expert_dtype,
            disk_gbps=speeds[0] if speeds else None,
        )
    except (ModelNotFound, ConfigError, CheckpointError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def _gpu(args, cfg, model_dir: Path, rams, cache, draft_tokens: int) -> int:
    from latentkv.streaming.gpu_plan import format_gpu_plan, make_gpu_plan

    plan = make_gpu_plan(
        cfg,
        model_dir,
        int(args.vram_gb * (1 << 30)),
        None if rams is None else int(rams[0] * (1 << 30)),
        args.weight_dtype,
        cache,
        args.max_model_len,
        args.max_num_seqs,
        draft_tokens=draft_tokens,
        expert_dtype=args.expert_dtype,
    )
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_gpu_plan(plan))
    return 0 if plan.fits else 1


def per_rank(text: str | None, flag: str, nodes: int) -> list[float] | None:
    """A flag's value for each of `nodes` ranks: one positive number for all, or one per rank."""
    from latentkv.config import MAX_GIB, check_number

    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise UserError(
            f"{flag} must be a number or a comma-separated list of numbers (got {text!r})"
        ) from None
    for v in values:  # a budget (GiB) or a disk speed (GB/s): positive, finite, within reason
        check_number(flag, v, 0, MAX_GIB, above=True)
    if len(values) == 1:
        return values * nodes
    if len(values) != nodes:
        if nodes == 1:
            raise UserError(f"{flag} has {len(values)} values: a list (one per rank) needs --nodes N")
        raise UserError(
            f"{flag} has {len(values)} values for {nodes} ranks: give one for all or one per rank"
        )
    return values


def _cluster(args, cfg, model_dir: Path, rams, cache, draft_tokens: int) -> int:
    from latentkv.models.loader import CheckpointError
    from latentkv.streaming.attach import default_store_dir
    from latentkv.streaming.cluster_plan import format_cluster_plan, make_cluster_plan, usage_load

    if rams is None:
        raise UserError("--nodes needs --ram-gb: one budget for every rank, or one per rank (G0,G1,...)")
    speeds = per_rank(args.disk_gbps, "--disk-gbps", args.nodes) or [1.0] * args.nodes
    try:
        store = default_store_dir(model_dir, args.weight_dtype)
    except CheckpointError:  # config.json alone: no store, no usage history yet
        store = None
    plan = make_cluster_plan(
        cfg,
        model_dir,
        [int(g * (1 << 30)) for g in rams],
        speeds,
        args.weight_dtype,
        cache,
        args.max_model_len,
        args.max_num_seqs,
        store_dir=store,
        load=usage_load(store),
        head_experts=not args.no_head_experts,
        draft_tokens=draft_tokens,
    )
    if args.placement_out is not None:
        try:
            plan.placement.save(args.placement_out)
        except OSError as exc:
            raise UserError(f"--placement-out {args.placement_out}: {exc.strerror or exc}") from None
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_cluster_plan(plan))
    return 0 if plan.fits else 1
