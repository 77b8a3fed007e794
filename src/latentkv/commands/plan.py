"""`latentkv plan MODEL`: how a RAM budget splits between dense weights, the KV pool,
activations and the expert cache, and what that means for reads per token (and, with
`--disk-gbps`, for tokens per second). MODEL may be a config.json, or a folder holding only one:
a model is planned before it is downloaded."""

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    from latentkv.config import WEIGHT_DTYPES

    p.add_argument("model", metavar="MODEL", help=MODEL_HELP + "; or a config.json alone")
    p.add_argument(
        "--ram-gb",
        type=float,
        default=None,
        help="RAM budget in GiB (default: 80%% of available memory, or of the cgroup limit when lower)",
    )
    p.add_argument(
        "--weight-dtype",
        default="f32",
        choices=WEIGHT_DTYPES,
        help="weight format of the dense weights (and of the experts unless --expert-dtype; default: f32)",
    )
    p.add_argument(
        "--expert-dtype", default=None, choices=WEIGHT_DTYPES, help="weight format of the routed experts"
    )
    p.add_argument(
        "--disk-gbps",
        type=float,
        default=None,
        help="the disk's read speed in GB/s: bound decode tok/s by the expert reads per token",
    )
    add_cache_arguments(p)
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences decoded together (default: 1)")
    add_speculative_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from latentkv.config import ConfigError, ModelConfig
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve
    from latentkv.streaming.planner import format_plan, make_plan

    if args.ram_gb is not None and not args.ram_gb > 0:
        raise UserError(f"--ram-gb must be positive, got {args.ram_gb}")
    if args.max_model_len < 1 or args.max_num_seqs < 1:
        raise UserError("--max-model-len and --max-num-seqs must be at least 1")
    if args.disk_gbps is not None and not 0 < args.disk_gbps < 1e4:
        raise UserError(f"--disk-gbps must be a speed in GB/s above 0, got {args.disk_gbps}")
    spec = speculative_config(args, args.model)
    draft_tokens = spec.draft_tokens if spec is not None else 0
    try:
        config_only = Path(args.model).suffix == ".json" and Path(args.model).is_file()
        model_dir = None if config_only else resolve(args.model)
        cfg = ModelConfig.from_hf(Path(args.model) if config_only else model_dir)
        cache = cache_config(args)
        ram = None if args.ram_gb is None else int(args.ram_gb * (1 << 30))
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
            disk_gbps=args.disk_gbps,
        )
    except (ModelNotFound, ConfigError, CheckpointError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_plan(plan))
    return 0 if plan.fits else 1
