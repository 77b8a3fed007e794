"""`latentkv bench decode`: decode tok/s per KV tier, optionally beside transformers' generate()."""

from __future__ import annotations

import argparse
import gc
from functools import partial

from latentkv.commands.bench import common
from latentkv.commands.common import add_streaming_arguments, add_weight_arguments
from latentkv.commands.common import weight_dtypes as weight_list
from latentkv.errors import UserError

RANDOM_FILL_NOTE = (
    "fill random: the context is random rows appended straight to every layer's cache (no prompt "
    "pass, so no prefill tok/s); decode speed does not depend on the rows' values"
)


def add(sub) -> None:
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
    add_weight_arguments(d, multiple=True)
    add_streaming_arguments(d)
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
    d.add_argument(
        "--compile",
        action="store_true",
        help="also time decode through torch.compile (rows 'latentkv+compile', beside the eager "
        "ones; tiers f32, bf16, fp8); compiling takes tens of seconds per tier before timing",
    )
    from latentkv.commands.common import add_cluster_arguments, add_speculative_arguments

    add_speculative_arguments(d)
    common.add_output(d)
    add_cluster_arguments(d)


def run(args: argparse.Namespace) -> dict:
    from latentkv.commands.common import cluster_config, run_as_worker
    from latentkv.config import ConfigError, EngineConfig
    from latentkv.eval import bench
    from latentkv.runtime import load

    if (status := run_as_worker(args)) is not None:
        raise SystemExit(status)
    cluster = cluster_config(args)
    contexts = common.ints(args.context, "--context")
    weight_dtypes = weight_list(args.weight_dtype)
    tiers = common.tiers(args.kv_cache_dtype)
    if args.decode_tokens < 2:
        raise UserError("--decode-tokens must be at least 2")
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    if args.vs_transformers and args.fill == "random":
        raise UserError(
            "--vs-transformers cannot be combined with --fill random: transformers' generate() only "
            "builds its cache by prefilling a prompt; use --fill prefill"
        )
    if cluster is not None and (len(weight_dtypes) > 1 or args.vs_transformers or args.compile):
        raise UserError(
            "a cluster runs one --weight-dtype, without --vs-transformers and --compile: the workers serve "
            "one model until the head ends"
        )
    if args.vs_transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UserError("--vs-transformers needs transformers: pip install 'latentkv[dev]'") from None
    spec = _speculative(args)
    common.set_threads(args.threads)
    rows: list[bench.BenchRow] = []
    cluster_report: list[dict] = []
    notes: list[str] = [RANDOM_FILL_NOTE] if args.fill == "random" else []
    for dtype in weight_dtypes:
        try:
            engine = EngineConfig(
                weight_dtype=dtype,
                expert_dtype=args.expert_dtype,
                ram_gb=args.ram_gb,
                expert_policy=args.expert_cache_policy,
                cluster=cluster,
            )
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        loaded = load(
            args.model,
            engine,
            quiet=args.json,
            max_model_len=max(contexts) + args.decode_tokens + (spec.draft_tokens if spec else 0),
            draft_tokens=spec.draft_tokens if spec else 0,
        )
        model = loaded.model
        if spec is not None:
            from latentkv.commands.common import check_speculative

            check_speculative(model, spec)
            notes.append(_SPEC_NOTE)
        cache_configs = common.cache_configs(model, tiers)
        if max(contexts) + args.decode_tokens > model.cfg.max_position_embeddings:
            raise UserError(
                f"context {max(contexts)} + {args.decode_tokens} decode tokens exceeds the model's "
                f"maximum of {model.cfg.max_position_embeddings}"
            )
        dsa = model.cfg.dsa
        if dsa is not None and max(contexts) > dsa.index_topk and (note := _dsa_note(model)) not in notes:
            notes.append(note)
        step, compiled_tiers = (
            _compile(model, cache_configs, notes, args.json) if args.compile else (None, ())
        )
        for ctx in contexts:  # tiers innermost: a drift in machine load hits every tier alike
            for cache_config in cache_configs:
                steps = [None, step] if cache_config.kv_cache_dtype in compiled_tiers else [None]
                for compiled in steps:  # eager, then compiled where the tier compiles
                    model.compiled = compiled
                    rows.append(_row(args, model, dtype, ctx, cache_config, fill=args.fill))
                model.compiled = None
                if spec is not None:
                    rows.append(_row(args, model, dtype, ctx, cache_config, speculative=spec))
        directory = loaded.directory
        if loaded.cluster is not None:
            from latentkv.cluster.head import describe

            cluster_report = loaded.cluster.report(loaded.streamer)
            notes.extend(describe(cluster_report))
            loaded.close()  # the workers end with the head
        del loaded, model
        gc.collect()
        if args.vs_transformers and dtype not in ("f32", "bf16"):
            notes.append(f"transformers runs f32 and bf16 weights only: no transformers row for {dtype}")
        elif args.vs_transformers:
            hf = bench.load_transformers(directory, dtype)
            for ctx in contexts:
                rows.append(
                    common.fastest(
                        args.repeats,
                        partial(bench.bench_transformers, hf, args.model, dtype, ctx, args.decode_tokens),
                    )
                )
                common.progress(
                    f"transformers {dtype} ctx {ctx}: decode {rows[-1].decode_tps:.1f} tok/s", args.json
                )
            del hf
            gc.collect()
    bench.add_ratios(rows)
    extra = {"cluster": cluster_report} if cluster is not None else {}
    return {
        **extra,
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


_SPEC_NOTE = (
    "latentkv+mtpN rows: the MTP layer drafts N tokens on every step (the pause rule off) over the "
    "same random prompt; random text is hard to predict, so their acceptance is lower than on real "
    "text (`latentkv bench speculative` measures that)"
)


def _speculative(args: argparse.Namespace):
    """The SpeculativeConfig of --speculative/--draft-tokens, the pause rule off, or None."""
    import dataclasses

    from latentkv.commands.common import speculative_config

    spec = speculative_config(args, args.model)
    if spec is not None and args.fill == "random":
        raise UserError("--speculative needs --fill prefill: drafting reads the prompt's hidden states")
    return None if spec is None else dataclasses.replace(spec, adaptive=False)


def _compile(model, cache_configs, notes: list[str], quiet: bool):
    """Compile the decode step for every tier that can be; -> (the compiled step, those tiers).
    The model is left eager: rows switch `model.compiled` on and off."""
    from latentkv.models.compiled import CompileUnavailable, check_compilable

    try:
        check_compilable()  # is there a C++ compiler at all
    except CompileUnavailable as exc:
        raise UserError(str(exc)) from None
    tiers = set()
    for cache_config in cache_configs:
        try:
            seconds = model.compile_decode(cache_config, progress=not quiet)
        except CompileUnavailable as exc:
            notes.append(f"{cache_config.kv_cache_dtype}: no compiled row ({exc})")
            continue
        tiers.add(cache_config.kv_cache_dtype)
        notes.append(f"{cache_config.kv_cache_dtype}: compiled in {seconds:.1f} s before timing")
    step, model.compiled = model.compiled, None
    return step, tiers


def _dsa_note(model) -> str:
    topk = model.cfg.dsa.index_topk
    return (
        f"DSA: at contexts above index_topk={topk} the indexer scores every cached key but selects "
        f"{topk} rows per query, and the main attention reads only those {topk} rows"
    )


def table(rows: list[dict]) -> str:
    """Markdown; ratios compare decode tok/s with f32 KV and with transformers at the same
    weight dtype and context."""
    lines = [
        "| engine | weights | KV | context | fill | prefill tok/s | decode tok/s | vs f32 KV | "
        "vs transformers | KV B/token/layer | KV bytes measured | KV bytes predicted | equal |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    spec_rows = [r for r in rows if r.get("speculative")]
    for r in rows:
        equal = {True: "yes", False: "**no**", None: ""}[r["kv_bytes_match"]]
        lines.append(
            f"| {r['engine']} | {r['weight_dtype']} | {r['kv_cache_dtype']} | {r['context']} | {r['fill']} | "
            f"{common.num(r['prefill_tps'])} | {r['decode_tps']:,.1f} | {common.ratio(r['decode_vs_f32'])} | "
            f"{common.ratio(r['decode_vs_transformers'])} | {r['kv_bytes_per_token_layer']:,.0f} | "
            f"{r['kv_bytes_measured']:,} | {common.num(r['kv_bytes_predicted'], ',', '')} | {equal} |"
        )
    if spec_rows:
        lines += [
            "",
            "| engine | KV | context | acceptance per draft position | tokens/verify |",
            "|---|---|---:|---|---:|",
        ]
        for r in spec_rows:
            spec = r["speculative"]
            acc = " / ".join(f"{a:.2f}" for a in spec["acceptance_per_position"])
            lines.append(
                f"| {r['engine']} | {r['kv_cache_dtype']} | {r['context']} | {acc} | {spec['tokens_per_verify']:.2f} |"
            )
    return "\n".join(lines)


def _row(args: argparse.Namespace, model, dtype: str, ctx: int, cache_config, **how):
    """The fastest of --repeats runs of one latentkv row (`how`: the fill, or MTP drafting)."""
    from latentkv.eval import bench

    row = common.fastest(
        args.repeats,
        partial(bench.bench_latentkv, model, args.model, dtype, ctx, args.decode_tokens, cache_config, **how),
    )
    drafting = f", {row.speculative['tokens_per_verify']:.2f} tokens/verify" if row.speculative else ""
    common.progress(
        f"{row.engine} {dtype} {row.kv_cache_dtype} ctx {ctx}: decode {row.decode_tps:.1f} tok/s{drafting}",
        args.json,
    )
    return row
