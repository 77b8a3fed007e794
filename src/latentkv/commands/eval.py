"""`latentkv eval ppl|mc`: what each KV tier costs in quality, measured on held-out text.

`eval ppl` scores held-out text in windows through every tier's real cache (perplexity, delta
vs f32, KL divergence from f32, top-1 agreement, with bootstrap intervals; the unigram baseline
when the model ships its training token counts). `eval mc` scores the next-line
multiple-choice task per tier (accuracy with Wilson intervals). `eval recall` scores
planted-identifier recall by distance per tier (`latentkv.eval.recall`). Tables print as markdown;
--json gives JSON. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from latentkv.commands.common import (
    add_cache_arguments,
    add_device_argument,
    add_weight_arguments,
    emit,
    weight_dtypes,
)
from latentkv.errors import UserError

PPL_TIERS = "f32,bf16,fp8,tq6,tq4,tq3,polar4"
MC_TIERS = "f32,fp8,tq4,tq3"
RECALL_TIERS = "f32,q8s,q4s"
HELDOUT = "heldout.txt"
TOKEN_COUNTS = "train_token_counts.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="eval", metavar="EVAL", required=True)
    _add_ppl(sub)
    _add_mc(sub)
    _add_recall(sub)


def _add_common(p: argparse.ArgumentParser, tiers: str) -> None:
    p.add_argument("model", metavar="MODEL", help="model directory or builtin:NAME (needs a tokenizer)")
    add_cache_arguments(
        p,
        multiple=True,
        default=tiers,
        note="; f32 is always run as the reference (with --weight-dtype other than f32 the default is f32)",
    )
    add_weight_arguments(p, multiple=tiers == PPL_TIERS)
    add_device_argument(p)
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown tables")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")


def _add_ppl(sub) -> None:
    p = sub.add_parser(
        "ppl",
        help="perplexity, KL divergence from f32 and top-1 agreement per KV tier on held-out text",
        description="Cut held-out text into non-overlapping windows and score each through every "
        "tier's real cache (a prefill appends the quantized rows first, then attends through them, as "
        "decode does). Per tier and context: perplexity, delta vs f32, mean KL(f32 || tier) per token "
        "and top-1 agreement with f32, each with a 95% bootstrap interval over windows (paired "
        "across tiers); bytes per token per layer; the add-one unigram baseline when the model "
        f"directory has {TOKEN_COUNTS}.",
    )
    _add_common(p, PPL_TIERS)
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        help=f"text file to score (default: the model directory's {HELDOUT})",
    )
    p.add_argument(
        "--context",
        default=None,
        metavar="N[,N...]",
        help="window lengths in tokens (default: 256 and 1024, capped at the model's maximum)",
    )
    p.add_argument(
        "--max-windows",
        type=int,
        default=200,
        metavar="N",
        help="score at most N windows per context, spread evenly over the text (default: 200; 0: all)",
    )
    p.add_argument(
        "--bootstrap", type=int, default=1000, metavar="N", help="bootstrap resamples (default: 1000)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling (default: 0)")
    p.add_argument(
        "--score-from",
        type=int,
        default=0,
        metavar="N",
        help="score only positions >= N of each window, each seeing the whole window before it "
        "(llama-perplexity scores the second half: N = context / 2; default: 0, every position)",
    )


def _add_mc(sub) -> None:
    p = sub.add_parser(
        "mc",
        help="next-line multiple-choice accuracy per KV tier (Wilson 95%% intervals)",
        description="Score a multiple-choice task by log-likelihood (tokenized as "
        "lm-evaluation-harness does) per KV tier: acc, acc_norm (per character of the choice) and "
        "acc_mutual_info (context vs choice alone) with Wilson 95% intervals, and how often each tier picks the same choice as f32.",
    )
    _add_common(p, MC_TIERS)
    p.add_argument(
        "--task",
        type=Path,
        default=None,
        help="task JSONL (context, choices, answer per line; default: the bundled nextline task)",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="score only the first N items")


def _add_recall(sub) -> None:
    p = sub.add_parser(
        "recall",
        help="planted-identifier recall by distance per KV tier (does the model use far context?)",
        description="Plant a definition `NAME = <int>` of a fresh random name as the first line of "
        "held-out code and a use of NAME about D tokens later; score whether the model, given the "
        "use's first token, completes the name (every later token its argmax), through every tier's "
        "cache. The control (the definition removed) shows what guessing scores.",
    )
    _add_common(p, RECALL_TIERS)
    p.add_argument(
        "--distances",
        default=None,
        metavar="D[,D...]",
        help="tokens from the definition to the use (default: 512,1024,2048,4096 up to the model's maximum)",
    )
    p.add_argument("--cases", type=int, default=32, metavar="N", help="cases per distance (default: 32)")
    p.add_argument("--seed", type=int, default=1, help="seed of the cases (default: 1)")


def run(args: argparse.Namespace) -> int:
    if args.eval == "ppl":
        emit(_run_ppl(args), args, ppl_table)
    elif args.eval == "mc":
        emit(_run_mc(args), args, mc_table)
    else:
        emit(_run_recall(args), args, recall_table)
    return 0


def _load(args: argparse.Namespace, default_tiers: str, multiple_weights: bool = False):
    """(loaded model per weight format, tier CacheConfigs with f32 first) after every check that
    needs no weights. A list of weight formats scores f32 weights too (the reference); it defaults
    the KV tiers to f32 alone."""
    from latentkv.commands.common import cache_configs
    from latentkv.config import ConfigError, EngineConfig, ModelConfig, env_threads
    from latentkv.models.registry import ModelNotFound, resolve
    from latentkv.runtime import check_tier, load

    formats = weight_dtypes(args.weight_dtype)
    if len(formats) > 1 and not multiple_weights:
        raise UserError(f"--weight-dtype takes one format here, got {args.weight_dtype!r}")
    if multiple_weights and formats != ["f32"]:
        default_tiers = "f32"
        formats = list(dict.fromkeys(["f32", *formats]))
    tiers = cache_configs(args, default=default_tiers)
    threads = args.threads if args.threads is not None else env_threads()
    try:
        cfg = ModelConfig.from_hf(resolve(args.model))
        engines = [
            EngineConfig(
                f, threads, expert_dtype=None if f == "f32" else args.expert_dtype, device=args.device
            )
            for f in formats
        ]
    except (ModelNotFound, ConfigError) as exc:
        raise UserError(str(exc)) from None
    for tier in tiers:
        check_tier(cfg, tier)
    loaded = {e.weights_label: load(args.model, e) for e in engines}
    first = next(iter(loaded.values()))
    if first.tokenizer is None:
        raise UserError(f"{first.directory} has no tokenizer.json; eval needs text")
    tiers.sort(key=lambda t: t.kv_cache_dtype != "f32")
    return (loaded if multiple_weights else first), tiers


def _variants(loaded: dict, tiers: list) -> list:
    """Every (weights, KV tier) pair, the f32/f32 reference first and once."""
    from latentkv.config import CacheConfig
    from latentkv.eval.ppl import Variant

    reference = Variant(loaded["f32"].model, CacheConfig("f32"), "f32")
    rest = [
        Variant(one.model, tier, label)
        for label, one in loaded.items()
        for tier in tiers
        if (label, tier.kv_cache_dtype) != ("f32", "f32")
    ]
    return [reference, *rest]


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


# --- eval ppl ------------------------------------------------------------------------------


def _run_ppl(args: argparse.Namespace) -> dict:
    from latentkv.eval import ppl

    if args.bootstrap < 0 or args.max_windows < 0:
        raise UserError("--bootstrap and --max-windows cannot be negative")

    all_loaded, tiers = _load(args, PPL_TIERS, multiple_weights=True)
    loaded = all_loaded["f32"]
    variants = _variants(all_loaded, tiers)
    model, directory = loaded.model, loaded.directory
    text_path = args.text if args.text is not None else directory / HELDOUT
    if not text_path.is_file():
        if args.text is not None:
            raise UserError(f"--text {args.text}: no such file")
        raise UserError(
            f"{args.model} ships no {HELDOUT} ({directory}); give a text to score with --text FILE"
        )
    text = text_path.read_text(encoding="utf-8", errors="replace")
    contexts = _contexts(args.context, model.cfg.max_position_embeddings)
    if not 0 <= args.score_from <= min(contexts) - 2:
        raise UserError(
            f"--score-from {args.score_from}: must be 0 .. {min(contexts) - 2} (the shortest context - 2)"
        )
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    counts_path = directory / TOKEN_COUNTS
    counts = None
    if counts_path.is_file():
        try:
            counts = ppl.load_token_counts(counts_path, model.cfg.vocab_size)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    results = []
    for context in contexts:
        try:
            windows = ppl.make_windows(ids, context, args.max_windows or None)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        _progress(f"context {context}: {windows.shape[0]} windows x {len(variants)} weights/tiers")
        scores = ppl.score_variants(windows, variants, progress=_progress, score_from=args.score_from)
        summary = ppl.summarize(scores, model.layout, args.bootstrap, args.seed)
        summary["unigram_ppl"] = ppl.unigram_ppl(counts, scores.targets) if counts is not None else None
        results.append(summary)
    return {
        "model": args.model,
        "text": str(text_path),
        "text_tokens": len(ids),
        "weight_dtype": list(all_loaded),
        "bootstrap": {"unit": "window", "resamples": args.bootstrap, "seed": args.seed, "level": 0.95},
        "contexts": results,
    }


def _contexts(text: str | None, max_positions: int) -> list[int]:
    from latentkv.eval import ppl

    if text is None:
        return ppl.default_contexts(max_positions)
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--context must be comma-separated integers, got {text!r}") from None
    if not values:
        raise UserError("--context is empty")
    for n in values:
        if not 2 <= n <= max_positions:
            raise UserError(
                f"--context {n}: a window must be 2 .. {max_positions} tokens (the model's maximum)"
            )
    return list(dict.fromkeys(values))


def _ci(ci, fmt: str) -> str:
    return "" if ci is None else f" [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def ppl_table(payload: dict) -> str:
    out = []
    for ctx in payload["contexts"]:
        head = f"context {ctx['context']}: {ctx['windows']} windows, {ctx['tokens_scored']:,} tokens scored"
        if ctx.get("score_from"):
            head += f" (positions >= {ctx['score_from']})"
        if ctx["unigram_ppl"] is not None:
            head += f"; unigram baseline ppl {ctx['unigram_ppl']:.2f}"
        out += [
            head,
            "",
            "| weights | KV | B/token/layer | ppl [95% CI] | Δppl vs f32 % [95% CI] | KLD [95% CI] | "
            "top-1 vs f32 [95% CI] |",
            "|---|---|---:|---|---|---|---|",
        ]
        for r in ctx["tiers"]:
            out.append(
                f"| {r.get('weights', 'f32')} | {r['tier']} | {r['bytes_per_token_layer']} | {r['ppl']:.3f}{_ci(r['ppl_ci'], '.3f')} | "
                f"{r['delta_ppl_pct']:+.2f}{_ci(r['delta_ppl_pct_ci'], '+.2f')} | "
                f"{r['kld']:.5f}{_ci(r['kld_ci'], '.5f')} | {r['top1']:.2%}{_ci(r['top1_ci'], '.2%')} |"
            )
        out.append("")
    b = payload["bootstrap"]
    out.append(
        f"intervals: {b['level']:.0%} percentile bootstrap over whole windows, {b['resamples']} resamples "
        f"(seed {b['seed']}), the same resamples for every tier"
    )
    return "\n".join(out)


# --- eval mc -------------------------------------------------------------------------------


def _run_mc(args: argparse.Namespace) -> dict:
    from latentkv.eval import mc

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be positive (got {args.limit})")
    task = args.task if args.task is not None else mc.TASK_FILE
    if not task.is_file():
        raise UserError(
            f"no task file at {task}; build it with tools/make_mc_task.py or pass --task FILE.jsonl"
        )
    try:
        items = mc.load_items(task, args.limit)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    loaded, tiers = _load(args, MC_TIERS)
    rows, reference = [], None
    for tier in tiers:
        name = tier.kv_cache_dtype
        t0 = last = time.perf_counter()

        def report(done: int, name=name, t0=t0) -> None:
            nonlocal last
            now = time.perf_counter()
            if now - last > 2.0 or done == len(items):
                last = now
                _progress(f"{name}: {done}/{len(items)} items, {now - t0:.0f} s")

        results = mc.score_items(loaded.model, loaded.tokenizer, items, tier, progress=report)
        reference = results if name == "f32" else reference
        row = mc.summarize(items, results, reference if name != "f32" else None)
        kv_tier = loaded.model.tier(tier)
        rows.append({"tier": name, "bytes_per_token_layer": kv_tier.bytes_per_token_layer, **row})
    return {"model": args.model, "task": str(task), "items": len(items), "tiers": rows}


def mc_table(payload: dict) -> str:
    out = [
        f"task {payload['task']}: {payload['items']} items",
        "",
        "| KV | B/token/layer | acc [Wilson 95%] | acc_norm [Wilson 95%] | acc_mutual_info [Wilson 95%] "
        "| same choice as f32 |",
        "|---|---:|---|---|---|---:|",
    ]
    for r in payload["tiers"]:
        same = r.get("same_pred_as_f32")
        accs = " | ".join(
            f"{r[m]:.3f}{_ci(r[m + '_ci'], '.3f')}" for m in ("acc", "acc_norm", "acc_mutual_info")
        )
        out.append(
            f"| {r['tier']} | {r['bytes_per_token_layer']} | {accs} | {'' if same is None else f'{same:.1%}'} |"
        )
    return "\n".join(out)


# --- eval recall ---------------------------------------------------------------------------


def _run_recall(args: argparse.Namespace) -> dict:
    import torch

    from latentkv.eval import recall
    from latentkv.eval.stats import wilson_interval

    if args.cases < 1:
        raise UserError(f"--cases must be positive (got {args.cases})")
    asked = None
    if args.distances is not None:
        try:
            asked = list(dict.fromkeys(int(x) for x in args.distances.split(",") if x.strip()))
        except ValueError:
            raise UserError(f"--distances must be comma-separated integers, got {args.distances!r}") from None
    loaded, tiers = _load(args, RECALL_TIERS)
    if all(t.kv_cache_dtype != "f32" for t in tiers):  # the reference and the control run in f32
        from latentkv.config import CacheConfig

        tiers.insert(0, CacheConfig("f32"))
    model, directory = loaded.model, loaded.directory
    if not (directory / HELDOUT).is_file():
        raise UserError(f"{args.model} ships no {HELDOUT} ({directory}); eval recall plants names in it")
    limit = model.cfg.max_position_embeddings
    distances = [d for d in recall.DISTANCES if d <= limit] if asked is None else asked
    for d in distances or [0]:
        if not 64 <= d <= limit:
            raise UserError(f"--distances {d}: must be 64 .. {limit} tokens (the model's maximum)")
    text = (directory / HELDOUT).read_text(encoding="utf-8", errors="replace")
    cases = recall.planted_cases(text, loaded.tokenizer.encode_with_offsets, distances, args.cases, args.seed)
    rows = []
    for tier in tiers:
        t0 = time.perf_counter()
        kv_tier = model.tier(tier)

        def logits_of(ids: list[int], kv_tier=kv_tier) -> torch.Tensor:
            with torch.inference_mode():
                return model.forward(torch.tensor(ids), model.make_cache(kv_tier), all_logits=True)

        runs = [("planted", recall.score(logits_of, cases))]
        if tier.kv_cache_dtype == "f32":
            runs.append(("control", recall.score(logits_of, cases, control=True)))
        for kind, by_distance in runs:
            cells = {
                str(d): {"hits": h, "cases": n, "recall": h / n, "ci": wilson_interval(h, n)}
                for d, (h, n) in by_distance.items()
            }
            rows.append({"tier": tier.kv_cache_dtype, "kind": kind, "distances": cells})
        _progress(f"{tier.kv_cache_dtype}: {time.perf_counter() - t0:.0f} s")
    return {
        "model": args.model,
        "text": str(directory / HELDOUT),
        "cases_per_distance": args.cases,
        "seed": args.seed,
        "rows": rows,
    }


def recall_table(payload: dict) -> str:
    distances = list(payload["rows"][0]["distances"])
    out = [
        f"planted-identifier recall, {payload['cases_per_distance']} cases per distance (Wilson 95%); "
        "control: the definition removed",
        "",
        "| KV | cases | " + " | ".join(f"{d} tokens" for d in distances) + " |",
        "|---|---|" + "---|" * len(distances),
    ]
    for r in payload["rows"]:
        cells = " | ".join(
            f"{c['recall']:.0%}{_ci(c['ci'], '.0%')}" for c in (r["distances"][d] for d in distances)
        )
        out.append(f"| {r['tier']} | {r['kind']} | {cells} |")
    return "\n".join(out)
