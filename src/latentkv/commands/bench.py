"""`latentkv bench decode|attention|resume`: decode tok/s per KV tier (optionally beside
transformers), the attention read alone per tier, and resuming a saved conversation against
prefilling it again. Tables print as markdown; --json / --out give JSON."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from functools import partial
from pathlib import Path

from latentkv.cli import UserError

RANDOM_FILL_NOTE = (
    "fill random: the context is random rows appended straight to every layer's cache (no prompt "
    "pass, so no prefill tok/s); decode speed does not depend on the rows' values"
)
ATTENTION_TIERS = "f32,bf16,fp8,tq4,tq3,polar4"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _add_decode(sub)
    _add_attention(sub)
    _add_resume(sub)


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")


def _add_decode(sub) -> None:
    d = sub.add_parser(
        "decode",
        help="prefill and decode speed per KV tier at given context lengths",
        description="Prefill and decode tok/s for every (weight dtype, KV tier, context), all in one "
        "run, with each tier's decode speed as a ratio of f32's, and the KV memory measured from the "
        "cache's tensors beside the predicted bytes_per_token_layer x layers x tokens.",
    )
    d.add_argument("model", metavar="MODEL", help="model directory, builtin:tiny or builtin:slice")
    d.add_argument(
        "--context", default="128,1024", help="comma-separated context lengths (default: 128,1024)"
    )
    d.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per context (default: 32)")
    d.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every row this many times and keep the fastest, for both engines alike "
        "(default: 1; use 3+ on a shared machine)",
    )
    d.add_argument("--weight-dtype", default="f32", help="comma-separated: f32, bf16 (default: f32)")
    d.add_argument(
        "--kv-cache-dtype",
        default="f32",
        help="comma-separated KV tiers, or all (default: f32); include f32 for the ratio column",
    )
    d.add_argument(
        "--fill",
        choices=["prefill", "random"],
        default="prefill",
        help="how the context is built: prefill a random prompt (default), or append random rows to "
        "every layer's cache directly (for long contexts; prefill tok/s is then n/a). Decode speed does "
        "not depend on the rows' values. With DSA, once the context exceeds index_topk the indexer "
        "selects index_topk rows per query and the main attention reads only those",
    )
    d.add_argument(
        "--vs-transformers",
        action="store_true",
        help="run transformers' generate() in the same run (not with --fill random)",
    )
    _add_output(d)


def _add_attention(sub) -> None:
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
    _add_output(a)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} needs positive integers, got {text!r}")
    return values


def _tiers(text: str) -> list[str]:
    from latentkv.config import ConfigError, parse_kv_cache_dtypes

    try:
        return list(dict.fromkeys(parse_kv_cache_dtypes(text)))
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def _set_threads(threads: int | None) -> None:
    import torch

    from latentkv.config import env_threads

    threads = threads if threads is not None else env_threads()
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1 (got {threads})")
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    runners = {"decode": _run_decode, "attention": _run_attention, "resume": _run_resume}
    payload = runners[args.bench](args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        table = {"decode": decode_table, "attention": attention_table, "resume": resume_table}[args.bench]
        print(table(payload["rows"]))
        if payload["notes"]:
            print("\n" + "\n".join(f"- {note}" for note in payload["notes"]))
    return 0


def _progress(text: str, quiet: bool) -> None:
    if not quiet:
        print(f"  {text}", file=sys.stderr)


# --- decode ---------------------------------------------------------------------------------


def _run_decode(args: argparse.Namespace) -> dict:
    from latentkv.commands.common import load
    from latentkv.config import ConfigError, EngineConfig
    from latentkv.eval import bench

    contexts = _ints(args.context, "--context")
    weight_dtypes = [d.strip() for d in args.weight_dtype.split(",") if d.strip()]
    tiers = _tiers(args.kv_cache_dtype)
    if args.decode_tokens < 2:
        raise UserError("--decode-tokens must be at least 2")
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    if args.vs_transformers and args.fill == "random":
        raise UserError(
            "--vs-transformers cannot be combined with --fill random: transformers' generate() only "
            "builds its cache by prefilling a prompt; use --fill prefill"
        )
    if args.vs_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UserError("--vs-transformers needs transformers: pip install 'latentkv[dev]'") from None
    _set_threads(args.threads)
    rows: list[bench.BenchRow] = []
    notes: list[str] = [RANDOM_FILL_NOTE] if args.fill == "random" else []
    for dtype in weight_dtypes:
        try:
            engine = EngineConfig(weight_dtype=dtype)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        loaded = load(args.model, engine, quiet=args.json)
        model = loaded.model
        cache_configs = _cache_configs(model, tiers)
        if max(contexts) + args.decode_tokens > model.cfg.max_position_embeddings:
            raise UserError(
                f"context {max(contexts)} + {args.decode_tokens} decode tokens exceeds the model's "
                f"maximum of {model.cfg.max_position_embeddings}"
            )
        dsa = model.cfg.dsa
        if dsa is not None and max(contexts) > dsa.index_topk and (note := _dsa_note(model)) not in notes:
            notes.append(note)
        for ctx in contexts:  # tiers innermost: a drift in machine load hits every tier alike
            for cache_config in cache_configs:
                row = _fastest(
                    args.repeats,
                    partial(
                        bench.bench_latentkv,
                        model,
                        args.model,
                        dtype,
                        ctx,
                        args.decode_tokens,
                        cache_config,
                        args.fill,
                    ),
                )
                rows.append(row)
                _progress(
                    f"latentkv {dtype} {row.kv_cache_dtype} ctx {ctx}: decode {row.decode_tps:.1f} tok/s",
                    args.json,
                )
        directory = loaded.directory
        del loaded, model
        gc.collect()
        if args.vs_transformers:
            hf = bench.load_transformers(directory, dtype)
            for ctx in contexts:
                rows.append(
                    _fastest(
                        args.repeats,
                        partial(bench.bench_transformers, hf, args.model, dtype, ctx, args.decode_tokens),
                    )
                )
                _progress(
                    f"transformers {dtype} ctx {ctx}: decode {rows[-1].decode_tps:.1f} tok/s", args.json
                )
            del hf
            gc.collect()
    bench.add_ratios(rows)
    return {
        "bench": "decode",
        "model": args.model,
        "fill": args.fill,
        "contexts": contexts,
        "decode_tokens": args.decode_tokens,
        "weight_dtypes": weight_dtypes,
        "kv_cache_dtypes": tiers,
        "notes": notes,
        "rows": [r.as_dict() for r in rows],
    }


def _cache_configs(model, tiers: list[str]) -> list:
    """One CacheConfig per tier, each checked against the model's widths before any timing."""
    from latentkv.config import CacheConfig

    configs = [CacheConfig(t) for t in tiers]
    for config in configs:
        try:
            model.make_cache(config)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return configs


def _dsa_note(model) -> str:
    topk = model.cfg.dsa.index_topk
    return (
        f"DSA: at contexts above index_topk={topk} the indexer scores every cached key but selects "
        f"{topk} rows per query, and the main attention reads only those {topk} rows"
    )


def _num(value: float | None, fmt: str = ",.1f", missing: str = "n/a") -> str:
    return missing if value is None else format(value, fmt)


def _fastest(repeats: int, measure):
    """The best of `repeats` measurements (by decode tok/s): noise on a shared box only slows."""
    return max((measure() for _ in range(repeats)), key=lambda row: row.decode_tps)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def decode_table(rows: list[dict]) -> str:
    """Markdown; ratios compare decode tok/s with f32 KV and with transformers at the same
    weight dtype and context."""
    lines = [
        "| engine | weights | KV | context | fill | prefill tok/s | decode tok/s | vs f32 KV | "
        "vs transformers | KV B/token/layer | KV bytes measured | KV bytes predicted | equal |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        equal = {True: "yes", False: "**no**", None: ""}[r["kv_bytes_match"]]
        lines.append(
            f"| {r['engine']} | {r['weight_dtype']} | {r['kv_cache_dtype']} | {r['context']} | {r['fill']} | "
            f"{_num(r['prefill_tps'])} | {r['decode_tps']:,.1f} | {_ratio(r['decode_vs_f32'])} | "
            f"{_ratio(r['decode_vs_transformers'])} | {r['kv_bytes_per_token_layer']:,.0f} | "
            f"{r['kv_bytes_measured']:,} | {_num(r['kv_bytes_predicted'], ',', '')} | {equal} |"
        )
    return "\n".join(lines)


# --- attention ------------------------------------------------------------------------------


def _run_attention(args: argparse.Namespace) -> dict:
    from latentkv.config import CacheConfig
    from latentkv.eval import bench
    from latentkv.kv.cache import make_cache

    contexts = _ints(args.context, "--context")
    tiers = _tiers(args.kv_cache_dtype)
    for value, flag in ((args.heads, "--heads"), (args.kv_lora, "--kv-lora"), (args.rope, "--rope")):
        if value < 1:
            raise UserError(f"{flag} must be positive (got {value})")
    if args.repeats < 1:
        raise UserError(f"--repeats must be positive (got {args.repeats})")
    _set_threads(args.threads)
    layout = bench.attention_layout(args.kv_lora, args.rope)
    for tier in tiers:  # refuse a tier that cannot store these widths before timing anything
        try:
            make_cache(layout, CacheConfig(tier))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    rows, outputs = [], []
    for ctx in contexts:
        for tier in tiers:
            row, out = bench.bench_attention(tier, ctx, args.heads, args.kv_lora, args.rope, args.repeats)
            rows.append(row)
            outputs.append(out)
            _progress(f"{tier} ctx {ctx}: {row.attend_ms:.2f} ms (fused attend)", args.json)
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


def attention_table(rows: list[dict]) -> str:
    lines = [
        "| KV | context | heads | scores ms | softmax + context ms | three calls ms | fused attend ms | "
        "speed vs f32 | bytes/token stored | bytes read/token | cache bytes | equal | rel err vs f32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        err = "" if r["rel_err_vs_f32"] is None else f"{r['rel_err_vs_f32']:.4f}"
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['context']} | {r['heads']} | {r['scores_ms']:.2f} | "
            f"{r['context_ms']:.2f} | {r['total_ms']:.2f} | {r['attend_ms']:.2f} | {_ratio(r['speed_vs_f32'])} | "
            f"{r['bytes_per_token']:,} | {r['bytes_read_per_token']:,} | {r['cache_bytes']:,} | "
            f"{'yes' if r['cache_bytes_match'] else '**no**'} | {err} |"
        )
    return "\n".join(lines)


# --- resume ---------------------------------------------------------------------------------


def _add_resume(sub) -> None:
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
    r.add_argument(
        "--weight-dtype", default="f32", choices=["f32", "bf16"], help="weights in memory (default: f32)"
    )
    r.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="prefills timed per tier, fastest kept (default: 1); resume keeps the fastest of max(3, N)",
    )
    r.add_argument(
        "--kv-dir", type=Path, default=None, help="folder for the KV files (default: a temporary one)"
    )
    _add_output(r)


def _run_resume(args: argparse.Namespace) -> dict:
    import tempfile

    from latentkv.commands.common import load
    from latentkv.config import EngineConfig
    from latentkv.eval import bench

    tiers = _tiers(args.kv_cache_dtype)
    if args.tokens < 1 or args.repeats < 1:
        raise UserError("--tokens and --repeats must be at least 1")
    _set_threads(args.threads)
    loaded = load(args.model, EngineConfig(weight_dtype=args.weight_dtype), quiet=args.json)
    model = loaded.model
    if args.tokens + 1 > model.cfg.max_position_embeddings:
        raise UserError(
            f"--tokens {args.tokens} exceeds the model's context of {model.cfg.max_position_embeddings}"
        )
    configs = _cache_configs(model, tiers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="latentkv-resume-") as tmp:
        folder = args.kv_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for config in configs:
            row = bench.bench_resume(
                model, args.model, loaded.directory, args.tokens, config, folder, args.repeats
            )
            rows.append(row)
            _progress(
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


def resume_table(rows: list[dict]) -> str:
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
