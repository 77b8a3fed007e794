"""`latentkv bench resume`: resuming a saved conversation against prefilling it again."""

from __future__ import annotations

import argparse
from pathlib import Path

from latentkv.commands.bench import common
from latentkv.commands.common import add_device_argument, add_weight_arguments
from latentkv.errors import UserError


def add(sub) -> None:
    r = sub.add_parser(
        "resume",
        help="resume a saved N-token conversation vs prefill it again, per KV tier",
        description="Per KV tier: prefill N random tokens and save them as a KV file; then time what "
        "a restarted process does to get that cache back (weights fingerprint, open, verify every "
        "record, load: Session.resume) against the prefill. Reports both times, the speedup, the file "
        "size beside the size the format predicts, and whether the resumed cache is byte-identical.",
    )
    r.add_argument("model", metavar="MODEL", help="model directory, builtin:tiny or builtin:slice")
    r.add_argument("--tokens", type=int, default=2000, help="conversation length (default: 2000)")
    r.add_argument(
        "--kv-cache-dtype", default="f32,tq4", help="comma-separated KV tiers, or all (default: f32,tq4)"
    )
    add_weight_arguments(r)
    add_device_argument(r)
    r.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="prefills timed per tier, fastest kept (default: 1); resume keeps the fastest of max(3, N)",
    )
    r.add_argument(
        "--kv-dir", type=Path, default=None, help="folder for the KV files (default: a temporary one)"
    )
    common.add_output(r)


def run(args: argparse.Namespace) -> dict:
    import tempfile

    from latentkv.config import EngineConfig
    from latentkv.eval import bench
    from latentkv.runtime import load

    tiers = common.tiers(args.kv_cache_dtype)
    if args.tokens < 1 or args.repeats < 1:
        raise UserError("--tokens and --repeats must be at least 1")
    common.set_threads(args.threads)
    loaded = load(
        args.model,
        EngineConfig(weight_dtype=args.weight_dtype, expert_dtype=args.expert_dtype, device=args.device),
        quiet=args.json,
    )
    model = loaded.model
    if args.tokens + 1 > model.cfg.max_position_embeddings:
        raise UserError(
            f"--tokens {args.tokens} exceeds the model's context of {model.cfg.max_position_embeddings}"
        )
    configs = common.checked_cache_configs(model, tiers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="latentkv-resume-") as tmp:
        folder = args.kv_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for config in configs:
            row = bench.bench_resume(
                model, args.model, loaded.directory, args.tokens, config, folder, args.repeats
            )
            rows.append(row)
            common.progress(
                f"{row.kv_cache_dtype}: prefill {row.prefill_seconds:.3f} s, resume {row.resume_seconds * 1e3:.1f} ms "
                f"({row.speedup:,.0f}x)",
                args.json,
            )
    return {
        "bench": "resume",
        "model": args.model,
        "tokens": args.tokens,
        "weight_dtype": args.weight_dtype,
        "kv_cache_dtypes": tiers,
        "notes": [
            f"{args.tokens} random tokens; prefill: one batched pass (fastest of {args.repeats}); resume: "
            "weights fingerprint + open + verify every record + load into a cache of the tier "
            f"(Session.resume, fastest of {max(args.repeats, 3)}), in the process that wrote the file "
            "(page cache warm, codec tables built)",
            "file bytes predicted: header area + tokens x (4 + layers x bytes_per_token_layer + indexer "
            "key bytes + 16)",
        ],
        "rows": [r.as_dict() for r in rows],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | KV | tokens | prefill s | resume ms | speedup | save ms | file bytes | predicted | equal | "
        "rows identical | next logits identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    yes = {True: "yes", False: "**no**"}
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['kv_cache_dtype']} | {r['tokens']:,} | {r['prefill_seconds']:.3f} | "
            f"{r['resume_seconds'] * 1e3:.1f} | {r['speedup']:,.0f}x | {r['save_seconds'] * 1e3:.1f} | "
            f"{r['file_bytes']:,} | {r['file_bytes_predicted']:,} | {yes[r['file_bytes_match']]} | "
            f"{yes[r['rows_identical']]} | {yes[r['next_logits_identical']]} |"
        )
    return "\n".join(lines)
