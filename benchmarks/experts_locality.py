"""How well the expert cache and the prefetch do on real routing (no timings: these numbers do not
depend on machine load).

One teacher-forced decode over held-out text (one token per pass) records, per MoE layer and
pass, the experts the router picked and the experts the prefetch predicted (the next layer's
router run early on the hidden state after this layer's attention). What is computed never
depends on the cache (the streamed model is exactly the resident one), so each cache policy and
budget is then replayed on that trace with the real `ExpertCache`:

    hit rate            experts found cached / experts asked for
    prefetch recall     experts asked for that the prediction named
    last-token recall   the same, predicting "the experts this layer used for the last token"

    .venv/bin/python benchmarks/experts_locality.py builtin:fixture --budgets 1,2,3,4,6 \\
        --tokens 512 --out benchmarks/results/experts-locality-fixture.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from latentkv.experts.base import LocalStore
from latentkv.experts.cache import POLICIES, ExpertCache
from latentkv.models.registry import resolve
from latentkv.models.weights import load_model
from latentkv.streaming.attach import moe_layers
from latentkv.tokenizer import Tokenizer

Trace = list[dict[int, tuple[set[int], set[int] | None]]]  # per pass: layer -> (asked, predicted)


class _Recorder(LocalStore):
    """A resident store that records what each pass asks for (served one expert at a time, the
    per-expert path, as when streaming)."""

    def __init__(self, layer: int, first: int, inner, trace: Trace):
        self.layer, self.first, self.inner, self.trace = layer, first, inner, trace
        self.num_experts = inner.num_experts
        self.predicted: set[int] | None = None

    def get(self, ids, first=True):
        if self.layer == self.first:
            self.trace.append({})
        self.trace[-1][self.layer] = (set(ids), self.predicted)
        self.predicted = None
        return self.inner.get(ids)

    def prefetch(self, ids) -> None:
        if self.layer != self.first:  # the next MoE layer's router only (not the dense layer's)
            self.predicted = set(ids)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class _Recording:
    """The `ExpertSource` of the recording model: each MoE layer's resident experts behind a
    `_Recorder`; each layer predicts the next (the model is built with the lookaheads)."""

    predicts = True

    def __init__(self, resident, trace: Trace):
        self.layers = moe_layers(resident)
        self.resident, self.trace = resident, trace

    def store(self, layer: int) -> _Recorder:
        return _Recorder(layer, self.layers[0], self.resident.blocks[layer].mlp.experts, self.trace)


def record(directory: Path, tokens: list[int]) -> tuple[Trace, int]:
    trace: Trace = []
    model = load_model(
        directory,
        experts=_Recording(load_model(directory, device="cpu"), trace),
        load_mtp=False,
        device="cpu",
    )
    cache = model.make_cache()
    with torch.inference_mode():
        for t in tokens:
            model.forward(torch.tensor([t]), cache)
    return trace, model.cfg.n_routed_experts


def replay(trace: Trace, per_layer: int, policy: str) -> float:
    """Hit rate of `policy` with room for `per_layer` experts per MoE layer (one shared cache)."""
    layers = len(trace[0])
    cache = ExpertCache(per_layer * layers, policy)
    for step in trace:
        cache.next_step()
        for layer, (asked, _pred) in step.items():
            keys = [(layer, e) for e in sorted(asked)]
            cache.protect(keys)
            for key in keys:
                if cache.get(key) is None:
                    cache.put(key, True, 1)
            cache.release()
    return cache.stats.hit_rate


def recalls(trace: Trace) -> tuple[float, float]:
    """(prefetch recall, last-token recall) over the trace."""
    hit = total = same = same_total = 0
    last: dict[int, set[int]] = {}
    for step in trace:
        for layer, (asked, pred) in step.items():
            if pred is not None:
                hit += len(asked & pred)
                total += len(asked)
            if layer in last:
                same += len(asked & last[layer])
                same_total += len(asked)
            last[layer] = asked
    return hit / max(1, total), same / max(1, same_total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", default="builtin:fixture", nargs="?")
    p.add_argument("--budgets", default="1,2,3,4,6", help="cache budgets in experts per MoE layer")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    directory = resolve(args.model)
    text = (directory / "heldout.txt").read_text(errors="replace")
    tokens = Tokenizer.of_model(directory).encode(text)[: args.tokens]
    trace, n_experts = record(directory, tokens)
    recall, last_recall = recalls(trace)
    rows = [
        {"experts_per_layer": b, "policy": pol, "hit_rate": replay(trace, b, pol)}
        for b in (int(x) for x in args.budgets.split(","))
        for pol in args.policies.split(",")
    ]
    print(f"{args.model}: {len(tokens)} held-out tokens, {len(trace[0])} MoE layers x {n_experts} experts")
    print(
        f"prefetch recall (next layer's router run early): {recall:.1%}; same experts as the last token: {last_recall:.1%}"
    )
    print("\n| experts/layer cached | " + " | ".join(args.policies.split(",")) + " |")
    print("|---|" + "---|" * len(args.policies.split(",")))
    for b in sorted({r["experts_per_layer"] for r in rows}):
        cells = [f"{r['hit_rate']:.1%}" for r in rows if r["experts_per_layer"] == b]
        print(f"| {b} of {n_experts} | " + " | ".join(cells) + " |")
    if args.out:
        out = {
            "model": args.model,
            "tokens": len(tokens),
            "recall": recall,
            "last_token_recall": last_recall,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
