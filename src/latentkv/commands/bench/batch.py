"""`latentkv bench batch`: aggregate decode tok/s of B sequences decoding together."""

from __future__ import annotations

import argparse

from latentkv.commands.bench import common
from latentkv.commands.common import add_device_argument, add_weight_arguments
from latentkv.errors import UserError


def add(sub) -> None:
    b = sub.add_parser(
        "batch",
        help="batched decode: aggregate and per-sequence tok/s per batch size",
        description="Per (KV tier, batch size B): B sequences each prefill their own random prompt of "
        "--context tokens, then decode together through Model.decode_batch (one step = one new token "
        "per sequence), in rounds interleaved with a single sequence decoding alone through "
        "Model.forward. Reports the median step, aggregate tok/s (all sequences), per-sequence tok/s, "
        "and the speedup over batch 1 and over the single sequence.",
    )
    b.add_argument("model", metavar="MODEL", help="model directory, builtin:tiny or builtin:slice")
    b.add_argument("--batch", default="1,2,4,8,16", help="comma-separated batch sizes (default: 1,2,4,8,16)")
    b.add_argument("--context", type=int, default=128, help="tokens in every sequence's cache (default: 128)")
    b.add_argument(
        "--steps", type=int, default=64, help="timed rounds: decode steps per batch size (default: 64)"
    )
    b.add_argument("--kv-cache-dtype", default="f32", help="comma-separated KV tiers, or all (default: f32)")
    add_weight_arguments(b)
    add_device_argument(b)
    common.add_output(b)


def run(args: argparse.Namespace) -> dict:
    import os

    from latentkv.config import EngineConfig
    from latentkv.eval.bench import measure_batch as bench
    from latentkv.runtime import load

    sizes = common.ints(args.batch, "--batch")
    tiers = common.tiers(args.kv_cache_dtype)
    if args.context < 1 or args.steps < 1:
        raise UserError("--context and --steps must be at least 1")
    common.set_threads(args.threads)
    loaded = load(
        args.model,
        EngineConfig(weight_dtype=args.weight_dtype, expert_dtype=args.expert_dtype, device=args.device),
        quiet=args.json,
    )
    model = loaded.model
    if args.context + args.steps + 1 > model.cfg.max_position_embeddings:
        raise UserError(
            f"--context {args.context} + --steps {args.steps} exceeds the model's context of "
            f"{model.cfg.max_position_embeddings}"
        )
    rows, single = [], {}
    for config in common.checked_cache_configs(model, tiers):
        key = (config.kv_cache_dtype, args.context)
        single[key], tier_rows = bench.bench_batches(
            model, args.model, sizes, args.context, args.steps, config
        )
        common.progress(f"{config.kv_cache_dtype}: single sequence {single[key]:.1f} tok/s", args.json)
        for row in tier_rows:
            common.progress(
                f"{config.kv_cache_dtype} B={row.batch}: {row.aggregate_tps:.1f} tok/s aggregate, "
                f"{row.per_sequence_tps:.1f} per sequence",
                args.json,
            )
        rows += tier_rows
    bench.add_speedups(rows, single)
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "bench": "batch",
        "model": args.model,
        "context": args.context,
        "steps": args.steps,
        "weight_dtype": args.weight_dtype,
        "kv_cache_dtypes": tiers,
        "single_sequence_tps": {tier: tps for (tier, _), tps in single.items()},
        "load_average": load_average,
        "notes": [
            f"every sequence starts from {args.context} tokens of its own random prompt; {args.steps} "
            "rounds, each one greedy step of the single sequence and of every batch size in turn (load "
            "that comes and goes hits all rows alike); median step time per row; aggregate = batch / step",
            "single: one sequence through Model.forward, the non-batched decode, same context and tier",
            "f32 batches decode from a slot pool (latentkv.kv.slots), as the server's running sequences do",
        ]
        + ([f"1-minute load average at the end: {load_average:.2f}"] if load_average is not None else []),
        "rows": [r.as_dict() for r in rows],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | KV | context | batch | step ms | aggregate tok/s | per-sequence tok/s | vs batch 1 | "
        "vs single |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['kv_cache_dtype']} | {r['context']:,} | {r['batch']} | "
            f"{r['step_seconds'] * 1e3:.2f} | {r['aggregate_tps']:,.1f} | {r['per_sequence_tps']:,.1f} | "
            f"{common.ratio(r['speedup'])} | {common.ratio(r['speedup_vs_single'])} |"
        )
    return "\n".join(lines)
