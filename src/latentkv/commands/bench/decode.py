"""`latentkv bench decode`: decode tok/s per KV tier, optionally beside transformers' generate()."""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from latentkv.commands.bench import common
from latentkv.commands.common import (
    add_device_argument,
    add_streaming_arguments,
    add_vram_argument,
    add_weight_arguments,
)
from latentkv.commands.common import weight_dtypes as weight_list
from latentkv.errors import UserError

if TYPE_CHECKING:
    from latentkv.config import ClusterConfig
    from latentkv.engine.speculative import SpeculativeConfig
    from latentkv.models.compiled import DecodeStep

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
        help="measure every row this many times, for both engines alike, and keep one by "
        "--statistic (default: 1; use 3+ on a shared machine)",
    )
    d.add_argument(
        "--statistic",
        choices=common.STATISTICS,
        default="fastest",
        help="which of the --repeats runs a row reports: the fastest (default; noise on a shared "
        "machine only slows) or the median (what a comparison with another engine should quote); "
        "every run's decode tok/s is kept in the JSON row's decode_tps_runs",
    )
    add_weight_arguments(d, multiple=True)
    add_device_argument(d)
    add_streaming_arguments(d)
    add_vram_argument(d)
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


@dataclass(frozen=True)
class _Plan:
    """What the flags ask for, checked before any model loads."""

    contexts: list[int]
    weight_dtypes: list[str]
    tiers: list[str]
    spec: SpeculativeConfig | None
    cluster: ClusterConfig | None


def run(args: argparse.Namespace) -> dict:
    from latentkv.commands.common import run_as_worker
    from latentkv.eval import bench
    from latentkv.weights import dense_dtype

    if (status := run_as_worker(args)) is not None:
        raise SystemExit(status)
    plan = _plan(args)
    common.set_threads(args.threads)
    rows: list[bench.BenchRow] = []
    notes: list[str] = [RANDOM_FILL_NOTE] if args.fill == "random" else []
    cluster_report: list[dict] = []
    for dtype in plan.weight_dtypes:  # a cluster runs one
        directory, cluster_report = _latentkv_rows(args, plan, dtype, rows, notes)
        if args.vs_transformers and dense_dtype(dtype) is None:
            notes.append(
                f"transformers runs plain-tensor weights only (f32, bf16): no transformers row for {dtype}"
            )
        elif args.vs_transformers:
            rows.extend(_transformers_rows(args, directory, dtype, plan.contexts))
    bench.add_ratios(rows)
    extra = {"cluster": cluster_report} if plan.cluster is not None else {}
    return {
        **extra,
        "bench": "decode",
        "model": args.model,
        "fill": args.fill,
        "contexts": plan.contexts,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "statistic": args.statistic,
        "weight_dtypes": plan.weight_dtypes,
        "kv_cache_dtypes": plan.tiers,
        "notes": notes,
        "rows": [r.as_dict() for r in rows],
    }


def _plan(args: argparse.Namespace) -> _Plan:
    """The flags checked together: one line and exit 2 for a combination that cannot run."""
    from latentkv.commands.common import cluster_config

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
    return _Plan(contexts, weight_dtypes, tiers, _speculative(args), cluster)


def _load(args: argparse.Namespace, plan: _Plan, dtype: str):
    """The model in weight format `dtype`, sized for the longest context (and its drafts)."""
    from latentkv.config import ConfigError, EngineConfig
    from latentkv.runtime import load

    draft_tokens = plan.spec.draft_tokens if plan.spec else 0
    try:
        engine = EngineConfig(
            weight_dtype=dtype,
            expert_dtype=args.expert_dtype,
            ram_gb=args.ram_gb,
            vram_gb=args.vram_gb,
            expert_policy=args.expert_cache_policy,
            cluster=plan.cluster,
            device=args.device,
        )
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    return load(
        args.model,
        engine,
        quiet=args.json,
        max_model_len=max(plan.contexts) + args.decode_tokens + draft_tokens,
        draft_tokens=draft_tokens,
    )


def _latentkv_rows(args: argparse.Namespace, plan: _Plan, dtype: str, rows: list, notes: list[str]):
    """Load the model in `dtype` and append its rows (every context x tier: eager, compiled where
    the tier compiles, MTP drafting with --speculative); -> (its folder, the cluster's report).
    The model is released before returning, so transformers' model has the memory."""
    loaded = _load(args, plan, dtype)
    model = loaded.model
    if plan.spec is not None:
        from latentkv.commands.common import check_speculative

        check_speculative(model, plan.spec)
        notes.append(_SPEC_NOTE)
    configs = common.checked_cache_configs(model, plan.tiers)
    longest = max(plan.contexts)
    if longest + args.decode_tokens > model.cfg.max_position_embeddings:
        raise UserError(
            f"context {longest} + {args.decode_tokens} decode tokens exceeds the model's "
            f"maximum of {model.cfg.max_position_embeddings}"
        )
    dsa = model.cfg.dsa
    if dsa is not None and longest > dsa.index_topk and (note := _dsa_note(model)) not in notes:
        notes.append(note)
    compiled, compiled_tiers = _compile(model, configs, notes, args.json) if args.compile else (None, ())
    for ctx in plan.contexts:  # tiers innermost: a drift in machine load hits every tier alike
        for config in configs:
            rows.append(_row(args, model, dtype, ctx, config, fill=args.fill))
            if config.kv_cache_dtype in compiled_tiers:
                rows.append(_row(args, model, dtype, ctx, config, fill=args.fill, compiled=compiled))
            if plan.spec is not None:
                rows.append(_row(args, model, dtype, ctx, config, speculative=plan.spec))
    report: list[dict] = []
    if loaded.cluster is not None:
        from latentkv.cluster.head import describe

        report = loaded.cluster.report(loaded.streamer)
        notes.extend(describe(report))
        loaded.close()  # the workers end with the head
    directory = loaded.directory
    del loaded, model, compiled
    gc.collect()
    return directory, report


def _transformers_rows(args: argparse.Namespace, directory, dtype: str, contexts: list[int]) -> list:
    """transformers' generate() on the same checkpoint, one row per context."""
    from latentkv.eval import bench

    hf = bench.load_transformers(directory, dtype)
    rows = []
    for ctx in contexts:
        measure = partial(bench.bench_transformers, hf, args.model, dtype, ctx, args.decode_tokens)
        rows.append(common.pick(args.repeats, measure, args.statistic))
        common.progress(f"transformers {dtype} ctx {ctx}: decode {rows[-1].decode_tps:.1f} tok/s", args.json)
    del hf
    gc.collect()
    return rows


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


def _compile(model, configs, notes: list[str], quiet: bool) -> tuple[DecodeStep | None, set[str]]:
    """Compile the decode step and warm it up for every tier that can be; -> (the compiled step,
    those tiers). The model itself stays eager: the rows that want the compiled step are handed it."""
    from latentkv.models.compiled import CompileUnavailable, check_compilable, warm_step

    try:
        check_compilable()  # is there a C++ compiler at all
    except CompileUnavailable as exc:
        raise UserError(str(exc)) from None
    step: DecodeStep | None = None
    tiers = set()
    for config in configs:
        try:
            check_compilable(config.kv_cache_dtype, config.recent_window)
        except CompileUnavailable as exc:
            notes.append(f"{config.kv_cache_dtype}: no compiled row ({exc})")
            continue
        step, seconds = warm_step(model, model.tier(config), step, progress=not quiet)
        tiers.add(config.kv_cache_dtype)
        notes.append(f"{config.kv_cache_dtype}: compiled in {seconds:.1f} s before timing")
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
    """One latentkv row, the --statistic of --repeats runs (`how`: the fill and the compiled step,
    or MTP drafting)."""
    from latentkv.eval import bench

    row = common.pick(
        args.repeats,
        partial(bench.bench_latentkv, model, args.model, dtype, ctx, args.decode_tokens, cache_config, **how),
        args.statistic,
    )
    drafting = f", {row.speculative['tokens_per_verify']:.2f} tokens/verify" if row.speculative else ""
    common.progress(
        f"{row.engine} {dtype} {row.kv_cache_dtype} ctx {ctx}: decode {row.decode_tps:.1f} tok/s{drafting}",
        args.json,
    )
    return row
