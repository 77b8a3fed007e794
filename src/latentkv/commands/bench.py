"""`latentkv bench decode`: prefill/decode tok/s and KV bytes, optionally beside transformers."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from latentkv.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    d = sub.add_parser("decode", help="prefill and decode speed at given context lengths")
    d.add_argument("model", metavar="MODEL", help="model directory, builtin:tiny or builtin:slice")
    d.add_argument("--context", default="128,1024", help="comma-separated prompt lengths (default: 128,1024)")
    d.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per context (default: 32)")
    d.add_argument("--weight-dtype", default="f32", help="comma-separated: f32, bf16 (default: f32)")
    d.add_argument("--kv-cache-dtype", default="f32", help="latent cache storage (default: f32)")
    d.add_argument(
        "--vs-transformers", action="store_true", help="run transformers' generate() in the same run"
    )
    d.add_argument("--threads", type=int, default=None, help="CPU threads for both engines")
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} needs positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    import torch

    from latentkv.commands.common import load
    from latentkv.config import CacheConfig, ConfigError, EngineConfig
    from latentkv.eval import bench

    contexts = _ints(args.context, "--context")
    dtypes = [d.strip() for d in args.weight_dtype.split(",") if d.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode_tokens < 2:
        raise UserError("--decode-tokens must be at least 2")
    if args.vs_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UserError("--vs-transformers needs transformers: pip install 'latentkv[dev]'") from None
    rows: list[bench.BenchRow] = []
    for dtype in dtypes:
        try:
            engine = EngineConfig(
                weight_dtype=dtype, threads=args.threads, cache=CacheConfig(args.kv_cache_dtype)
            )
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        loaded = load(args.model, engine, quiet=args.json)
        if max(contexts) + args.decode_tokens > loaded.model.cfg.max_position_embeddings:
            raise UserError(f"context {max(contexts)} + {args.decode_tokens} exceeds the model's maximum")
        for ctx in contexts:
            rows.append(bench.bench_latentkv(loaded.model, args.model, dtype, ctx, args.decode_tokens))
            _progress(rows[-1], args.json)
        directory = loaded.directory
        del loaded
        gc.collect()
        if args.vs_transformers:
            hf = bench.load_transformers(directory, dtype)
            for ctx in contexts:
                rows.append(bench.bench_transformers(hf, args.model, dtype, ctx, args.decode_tokens))
                _progress(rows[-1], args.json)
            del hf
            gc.collect()
    payload = {"bench": "decode", "model": args.model, "rows": [r.as_dict() for r in rows]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        print(table(rows))
    return 0


def _progress(row, quiet: bool) -> None:
    if not quiet:
        print(
            f"  {row.engine} {row.weight_dtype} ctx {row.context}: decode {row.decode_tps:.1f} tok/s",
            file=sys.stderr,
        )


def table(rows) -> str:
    """Markdown table; the ratio column compares latentkv with transformers at the same dtype/context."""
    base = {(r.weight_dtype, r.context): r for r in rows if r.engine == "transformers"}
    lines = [
        "| engine | weights | KV | context | prefill tok/s | decode tok/s | KV B/token/layer | decode vs transformers |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = base.get((r.weight_dtype, r.context))
        ratio = f"{r.decode_tps / ref.decode_tps:.2f}x" if ref and r.engine != "transformers" else ""
        lines.append(
            f"| {r.engine} | {r.weight_dtype} | {r.kv_cache_dtype} | {r.context} | {r.prefill_tps:,.1f} | "
            f"{r.decode_tps:,.1f} | {r.kv_bytes_per_token_layer:,.0f} | {ratio} |"
        )
    return "\n".join(lines)
