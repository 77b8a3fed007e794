"""The bytes-vs-quality frontier of the KV tier variants (issue 5), behind docs/kv-tiers.md.

`latentkv eval ppl` applies one --kv-group-size / --kv-recent-window to every tier of its list;
this script scores any mix of variants in one run, so f32 (the reference) runs once per window:

    .venv/bin/python benchmarks/kv_frontier.py builtin:fixture --context 256,1024 \\
        --out benchmarks/results/kv-frontier.json > benchmarks/results/kv-frontier.md

A variant is TIER[:gG][:wW]: the tier, grouped radii of G values, a recent window of W tokens
(tq4-r8:g32:w64). Scoring, intervals and statistics are `latentkv.eval.ppl`'s: one forward pass
per window through the variant's real cache, a paired bootstrap over windows.
Run on an otherwise idle machine (check `uptime`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from latentkv.config import CacheConfig
from latentkv.eval import ppl
from latentkv.models.registry import resolve
from latentkv.models.weights import load_model
from latentkv.tokenizer import Tokenizer

DEFAULT_VARIANTS = (
    "fp8,tq6,tq5,"
    "tq4,tq4:g32,tq4:g16,tq4:w16,tq4:w64,tq4-r8,tq4-r16,tq4-r8:g32,tq4-r8:w64,tq4-r16:w64,tq4-r8:g32:w64,"
    "polar4,polar4:g16,tq3,tq3-r8,tq3-r16,tq3:g32,tq3-r8:w64,tq3-r8:g32:w64"
)


def parse_variant(text: str) -> tuple[str, CacheConfig]:
    """'tq4-r8:g32:w64' -> (the label, CacheConfig)."""
    tier, *opts = text.strip().split(":")
    kw: dict[str, int] = {}
    for opt in opts:
        key = {"g": "group_size", "w": "recent_window"}.get(opt[:1])
        if key is None or not opt[1:].isdigit():
            raise SystemExit(f"bad variant option {opt!r} in {text!r}: use gG (group size) or wW (window)")
        kw[key] = int(opt[1:])
    return text.strip(), CacheConfig(tier, **kw)


def window_bytes(model, cfg: CacheConfig) -> int:
    """The window's fixed cost per layer: W float32 rows of Lkv + R values."""
    return cfg.recent_window * 4 * model.cfg.kv_row_width


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    directory = resolve(args.model)
    model = load_model(directory, device="cpu")
    text_path = args.text or directory / "heldout.txt"
    ids = Tokenizer(directory).encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False)
    variants = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
    labels = ["f32"] + [label for label, _ in variants]
    results = []
    for context in args.context:
        windows = ppl.make_windows(ids, context, args.max_windows or None)
        print(f"context {context}: {windows.shape[0]} windows x {len(labels)} variants", file=sys.stderr)
        t0 = time.perf_counter()
        scores = ppl.score_context(
            model, windows, [cfg for _, cfg in variants], progress=lambda s: print(f"  {s}", file=sys.stderr)
        )
        summary = ppl.summarize(scores, model.layout, args.bootstrap, args.seed)
        configs = [CacheConfig("f32")] + [c for _, c in variants]
        for row, label, cfg in zip(summary["tiers"], labels, configs, strict=True):
            row["variant"] = label
            row["window_bytes_per_layer"] = window_bytes(model, cfg)
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(summary)
    return {
        "model": args.model,
        "text": str(text_path),
        "text_tokens": len(ids),
        "threads": args.threads,
        "bootstrap": {"unit": "window", "resamples": args.bootstrap, "seed": args.seed, "level": 0.95},
        "contexts": results,
    }


def effective_bytes(row: dict, context: int) -> float:
    """Bytes per token per layer with the window's fixed W float32 rows spread over the context."""
    return row["bytes_per_token_layer"] + row["window_bytes_per_layer"] / context


def _ci(ci, fmt: str) -> str:
    return "" if ci is None else f" [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def table(payload: dict) -> str:
    lines = []
    for ctx in payload["contexts"]:
        lines += [
            f"\ncontext {ctx['context']}: {ctx['windows']} windows, {ctx['tokens_scored']:,} tokens scored",
            "",
            "| variant | B/token/layer | with the window, per token at this context | ppl "
            "| delta ppl % [95% CI] | KLD [95% CI] | top-1 [95% CI] |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(
            ctx["tiers"], key=lambda r: (r["variant"] != "f32", effective_bytes(r, ctx["context"]))
        ):
            lines.append(
                f"| {r['variant']} | {r['bytes_per_token_layer']} | {effective_bytes(r, ctx['context']):.0f} "
                f"| {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f}{_ci(r['delta_ppl_pct_ci'], '+.2f')} "
                f"| {r['kld']:.4f}{_ci(r['kld_ci'], '.4f')} | {r['top1']:.3f}{_ci(r['top1_ci'], '.3f')} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory or builtin:NAME (with heldout.txt, or --text)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list of TIER[:gG][:wW]")
    p.add_argument("--context", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024])
    p.add_argument("--max-windows", type=int, default=0, help="at most N evenly spaced windows (0: all)")
    p.add_argument("--text", type=Path, default=None)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args()
    payload = run(args)
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(table(payload))


if __name__ == "__main__":
    main()
