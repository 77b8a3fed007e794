"""Batched prefill: B prompts in one `Model.prefill_batch` pass against B `Model.forward` calls.

What the server's scheduler does with requests admitted in the same step (docs/server.md):

    .venv/bin/python benchmarks/prefill_batch.py builtin:tiny --batch 1,2,4,8,16 --prompt-len 32 \\
        --threads 1 --out benchmarks/results/prefill-batch-tiny.json

Each round times both ways for every batch size in turn (fresh f32 caches, made inside the
timing, random prompts of --prompt-len tokens, a different seed per prompt; which way goes first
alternates), so load that comes and goes hits both alike; rows report medians. Run on an otherwise idle machine (check `uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from latentkv.config import EngineConfig
from latentkv.eval.bench.workload import random_prompt
from latentkv.runtime import load


def _fresh(model, b: int) -> list:
    return [model.make_cache() for _ in range(b)]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory or builtin:NAME")
    p.add_argument("--batch", default="1,2,4,8,16", help="comma-separated batch sizes (default: 1,2,4,8,16)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (default: 32)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (default: 20)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch.split(",") if b.strip()]
    if not sizes or min(sizes) < 1 or args.prompt_len < 1 or args.rounds < 1:
        p.error("--batch sizes, --prompt-len and --rounds must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load(args.model, EngineConfig(), quiet=True).model
    if args.prompt_len > model.cfg.max_position_embeddings:
        p.error(f"--prompt-len exceeds the model's context of {model.cfg.max_position_embeddings}")
    prompts = {
        b: [torch.tensor(random_prompt(model.cfg.vocab_size, args.prompt_len, seed=i)) for i in range(b)]
        for b in sizes
    }
    times: dict[tuple[int, str], list[float]] = {(b, way): [] for b in sizes for way in ("one", "each")}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # the first round warms up and is not counted
            for b in sizes:
                ways = {
                    "one": lambda b=b: model.prefill_batch(prompts[b], _fresh(model, b)),
                    "each": lambda b=b: [
                        model.forward(x, c) for x, c in zip(prompts[b], _fresh(model, b), strict=True)
                    ],
                }
                order = ("one", "each") if r % 2 else ("each", "one")  # neither always goes first
                seconds = {way: _timed(ways[way]) for way in order}
                one, each = seconds["one"], seconds["each"]
                if r:
                    times[(b, "one")].append(one)
                    times[(b, "each")].append(each)
            print(f"round {r}/{args.rounds}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    rows = []
    for b in sizes:
        one, each = (statistics.median(times[(b, w)]) for w in ("one", "each"))
        rows.append(
            {
                "batch": b,
                "prompt_len": args.prompt_len,
                "one_pass_ms": round(one * 1e3, 2),
                "one_by_one_ms": round(each * 1e3, 2),
                "speedup": round(each / one, 2),
                "prompt_tok_s": round(b * args.prompt_len / one, 1),
            }
        )
    print("| batch | prompt tokens | one pass ms | one by one ms | speedup | prompt tok/s (one pass) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['batch'] * r['prompt_len']} | {r['one_pass_ms']:.2f} | "
            f"{r['one_by_one_ms']:.2f} | {r['speedup']:.2f}x | {r['prompt_tok_s']:,.1f} |"
        )
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        settings["threads"] = torch.get_num_threads()
        args.out.write_text(
            json.dumps({"settings": settings, "load_average": load_average, "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
