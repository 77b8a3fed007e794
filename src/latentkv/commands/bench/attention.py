"""`latentkv bench attention`: the attention read alone, per KV tier, at GLM-5 widths."""

from __future__ import annotations

import argparse

from latentkv.commands.bench import common
from latentkv.errors import UserError

ATTENTION_TIERS = "f32,bf16,fp8,tq4,tq3,polar4"


def add(sub) -> None:
    a = sub.add_parser(
        "attention",
        help="attention-only: scores + softmax + context of one decode query per KV tier",
        description="T random latent rows encoded into each tier; one decode query per head; "
        "scores + softmax + context through the cache readers MLA uses. Median of --repeats. "
        "This is a full read of T rows: with DSA at contexts above index_topk a layer reads only "
        "index_topk of them.",
    )
    a.add_argument("--context", default="32768", help="comma-separated cached tokens (default: 32768)")
    a.add_argument("--heads", type=int, default=64, help="query heads (default: 64, GLM-5)")
    a.add_argument("--kv-lora", type=int, default=512, help="latent width kv_lora_rank (default: 512)")
    a.add_argument("--rope", type=int, default=64, help="rope key width qk_rope_head_dim (default: 64)")
    a.add_argument(
        "--kv-cache-dtype",
        default=ATTENTION_TIERS,
        help=f"comma-separated KV tiers, or all (default: {ATTENTION_TIERS})",
    )
    a.add_argument("--repeats", type=int, default=5, help="timed repeats per tier (default: 5)")
    common.add_output(a)


def run(args: argparse.Namespace) -> dict:
    import torch

    from latentkv.config import CacheConfig
    from latentkv.eval import bench
    from latentkv.kv.cache import resolve_tier

    contexts = common.ints(args.context, "--context")
    tiers = common.tiers(args.kv_cache_dtype)
    for value, flag in ((args.heads, "--heads"), (args.kv_lora, "--kv-lora"), (args.rope, "--rope")):
        if value < 1:
            raise UserError(f"{flag} must be positive (got {value})")
    if args.repeats < 1:
        raise UserError(f"--repeats must be positive (got {args.repeats})")
    common.set_threads(args.threads)
    layout = bench.attention_layout(args.kv_lora, args.rope, torch.device("cpu"))
    for tier in tiers:  # refuse a tier that cannot store these widths before timing anything
        try:
            resolve_tier(layout, CacheConfig(tier))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    rows, outputs = [], []
    for ctx in contexts:
        for tier in tiers:
            row, out = bench.bench_attention(tier, ctx, args.heads, args.kv_lora, args.rope, args.repeats)
            rows.append(row)
            outputs.append(out)
            common.progress(f"{tier} ctx {ctx}: {row.attend_ms:.2f} ms (fused attend)", args.json)
    bench.compare_attention(rows, outputs)
    return {
        "bench": "attention",
        "contexts": contexts,
        "heads": args.heads,
        "kv_lora_rank": args.kv_lora,
        "rope_dim": args.rope,
        "kv_cache_dtypes": tiers,
        "repeats": args.repeats,
        "notes": [
            "one decode query per head; scores + softmax + context over every cached row, read in "
            "the stored format; times are medians of the repeats; 'fused attend' is the one-pass form decode runs (each packed tile unpacked once); speed vs f32 = f32 fused time / tier fused time",
            "bytes read/token: scores read c + r, context reads c again",
        ],
        "rows": [r.as_dict() for r in rows],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| KV | context | heads | scores ms | softmax + context ms | three calls ms | fused attend ms | "
        "speed vs f32 | bytes/token stored | bytes read/token | cache bytes | equal | rel err vs f32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        err = "" if r["rel_err_vs_f32"] is None else f"{r['rel_err_vs_f32']:.4f}"
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['context']} | {r['heads']} | {r['scores_ms']:.2f} | "
            f"{r['context_ms']:.2f} | {r['total_ms']:.2f} | {r['attend_ms']:.2f} | {common.ratio(r['speed_vs_f32'])} | "
            f"{r['bytes_per_token']:,} | {r['bytes_read_per_token']:,} | {r['cache_bytes']:,} | "
            f"{'yes' if r['cache_bytes_match'] else '**no**'} | {err} |"
        )
    return "\n".join(lines)
