"""`latentkv plan MODEL`: how a RAM budget splits between dense weights, the KV pool,
activations and the expert cache, and what that means for reads per token."""

from __future__ import annotations

import argparse
import json

from latentkv.commands.common import (
    add_cache_arguments,
    add_speculative_arguments,
    cache_config,
    speculative_config,
)
from latentkv.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", metavar="MODEL", help="model directory (config.json + safetensors) or builtin:NAME"
    )
    p.add_argument(
        "--ram-gb",
        type=float,
        default=None,
        help="RAM budget in GiB (default: 80%% of available memory, or of the cgroup limit when lower)",
    )
    p.add_argument(
        "--weight-dtype", default="f32", help="weight format of the dense weights and experts (default: f32)"
    )
    add_cache_arguments(p)
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences decoded together (default: 1)")
    add_speculative_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from latentkv.config import MAX_SEQS, ConfigError, ModelConfig, check_gib, check_number, check_tokens
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve
    from latentkv.streaming.planner import format_plan, make_plan

    if args.ram_gb is not None:
        check_gib("--ram-gb", args.ram_gb)
    check_tokens("--max-model-len", args.max_model_len)
    check_number("--max-num-seqs", args.max_num_seqs, 1, MAX_SEQS, integer=True)
    spec = speculative_config(args, args.model)
    draft_tokens = spec.draft_tokens if spec is not None else 0
    try:
        model_dir = resolve(args.model)
        cfg = ModelConfig.from_hf(model_dir)
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
        )
    except (ModelNotFound, ConfigError, CheckpointError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_plan(plan))
    return 0 if plan.fits else 1
