"""How well the expert cache and the prefetch do on real routing (no timings: these numbers do not
depend on machine load). Teacher-forced decode over held-out text, one token per pass, through
a streamed model at several cache budgets and policies: hit rate, prefetch recall (the next
layer's router run early) against "the same experts as the last token", and bytes read per token.

    .venv/bin/python benchmarks/experts_locality.py builtin:fixture --budgets 1,2,3,4 \\
        --policies lru,lfu,least-stale --tokens 512 --out benchmarks/results/experts-locality-fixture.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from latentkv.experts.attach import load_streamed
from latentkv.experts.convert import convert_experts
from latentkv.experts.store_file import read_manifest
from latentkv.experts.streamed import StreamConfig
from latentkv.models.registry import resolve
from latentkv.tokenizer import Tokenizer


def heldout_tokens(directory: Path, n: int) -> list[int]:
    text = (directory / "heldout.txt").read_text(errors="replace")
    return Tokenizer.of_model(directory).encode(text)[:n]


def run(directory: Path, store: Path, per_layer: int, policy: str, tokens: list[int]) -> dict:
    m = read_manifest(store)
    stride = max(e.layout.stride for e in m.layers.values())
    config = StreamConfig(budget=per_layer * len(m.layers) * stride, policy=policy, history=False)
    model, streamer = load_streamed(directory, store, config)
    trace: dict[int, list[set[int]]] = {layer: [] for layer in m.layers}
    real_get = streamer.get

    def traced(layer: int, ids):
        trace[layer].append(set(ids))
        return real_get(layer, ids)

    streamer.get = traced
    cache = model.make_cache()
    with torch.inference_mode():
        for t in tokens:
            model.forward(torch.tensor([t]), cache)
    t = streamer.snapshot()
    streamer.close()
    same, total = 0, 0
    for sets in trace.values():
        for prev, cur in zip(sets, sets[1:], strict=False):
            same += len(prev & cur)
            total += len(cur)
    return {
        "experts_per_layer": per_layer,
        "policy": policy,
        "hit_rate": t["hit_rate"],
        "recall": t["recall"],
        "last_token_recall": same / total if total else 0.0,
        "bytes_per_token": t["bytes_read"] / len(tokens),
        "cold_bytes_per_token": sum(len(s[0]) for s in trace.values() if s) * stride,
        "asked": t["asked"],
        "wasted_prefetch": t["wasted_prefetch"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", default="builtin:fixture", nargs="?")
    p.add_argument("--budgets", default="1,2,3,4", help="cache budgets in experts per MoE layer")
    p.add_argument("--policies", default="lru,lfu,least-stale")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    directory = resolve(args.model)
    tokens = heldout_tokens(directory, args.tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "experts"
        convert_experts(directory, store, "f32")
        for b in (int(x) for x in args.budgets.split(",")):
            for policy in args.policies.split(","):
                rows.append(run(directory, store, b, policy, tokens))
                r = rows[-1]
                print(
                    f"| {b} | {policy} | {r['hit_rate']:.1%} | {r['recall']:.1%} | {r['last_token_recall']:.1%} | "
                    f"{r['bytes_per_token'] / 2**10:.0f} |",
                    file=sys.stderr,
                )
    head = "| experts/layer | policy | hit rate | prefetch recall | last-token recall | KiB read/token |"
    print(head + "\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['experts_per_layer']} | {r['policy']} | {r['hit_rate']:.1%} | {r['recall']:.1%} | "
            f"{r['last_token_recall']:.1%} | {r['bytes_per_token'] / 2**10:.0f} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"model": args.model, "tokens": len(tokens), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
