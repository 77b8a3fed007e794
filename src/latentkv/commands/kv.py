"""`latentkv kv stats`: bytes per token, distortion and the longest context per KV tier."""

from __future__ import annotations

import argparse
import json
import sys

from latentkv.cli import UserError
from latentkv.commands.common import add_cache_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="kv", metavar="KV", required=True)
    s = sub.add_parser(
        "stats",
        help="bytes per token, rel-L2 error and the longest context in a RAM budget, per tier",
        description="Per KV tier: bytes per token (per layer and over all layers), compression vs "
        "f32 and bf16, mean relative L2 error of the codec on N(0,1) rows and (with --model) on the "
        "latent rows of a real forward pass, and the longest context that fits in --ram-gb. "
        "Without --model, GLM-5's dims.",
    )
    s.add_argument(
        "--model", default=None, help="model directory or builtin:NAME (default: GLM-5's dims, no weights)"
    )
    add_cache_arguments(s, multiple=True, default="all")
    s.add_argument("--ram-gb", type=float, default=16.0, help="RAM budget for the cache in GiB (default: 16)")
    s.add_argument(
        "--rows", type=int, default=4096, help="N(0,1) rows for the Gaussian error (default: 4096)"
    )
    s.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="with --model: prompt tokens of the forward pass whose rows are measured (default: 256)",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from latentkv.commands.common import cache_configs
    from latentkv.eval import kvstats

    if args.ram_gb <= 0:
        raise UserError(f"--ram-gb must be positive, got {args.ram_gb:g}")
    if args.rows < 1 or args.tokens < 1:
        raise UserError("--rows and --tokens must be at least 1")
    caches = cache_configs(args, default="all")
    real = None
    if args.model is None:
        cfg, name, assumptions = kvstats.glm5_config(), "GLM-5 (default dims)", [kvstats.GLM5_ASSUMPTIONS]
    else:
        cfg, real = _real_rows(args)
        name, assumptions = args.model, []
    payload = {"model": name, "assumptions": assumptions, "tokens": args.tokens if real is not None else None}
    payload.update(kvstats.report(cfg, caches, args.ram_gb, args.rows, real))
    if args.json:
        print(json.dumps(payload, indent=1))
        return 0
    d = payload["dims"]
    print(
        f"KV tiers for {name}: {d['num_layers']} layers, kv_lora {d['kv_lora_rank']} + rope "
        f"{d['qk_rope_head_dim']}; indexer keys {d['index_head_dim']} x f32 on {d['index_layers']} layers; "
        f"context limit {d['max_position_embeddings']:,} tokens"
    )
    print(kvstats.table(payload))
    rows = f"{payload['gaussian_rows']} N(0,1) rows (seed {payload['gaussian_seed']})"
    if real is not None:
        rows += f"; real rows: {payload['real_rows']} ({args.tokens} tokens x {d['num_layers']} layers)"
    print(f"\nrel-L2: mean ||x - x_hat|| / ||x|| over {rows}", file=sys.stderr)
    for note in assumptions:
        print(f"assumed: {note}", file=sys.stderr)
    return 0


def _real_rows(args: argparse.Namespace):
    """Load MODEL (f32) and capture its latent rows over a prompt of --tokens tokens."""
    from latentkv.commands.common import load
    from latentkv.config import EngineConfig
    from latentkv.eval import kvstats

    loaded = load(args.model, EngineConfig(), quiet=args.json)
    model = loaded.model
    tokens = kvstats.prompt_tokens(model.cfg, loaded.tokenizer, args.tokens)
    return model.cfg, kvstats.real_rows(model, tokens)
