"""Routing traces: which experts a trained model's routers pick per token and MoE layer, and which
ones the expert prefetch would have predicted; their statistics; and their replay on another model.

    # record (teacher-forced decode of held-out text, one token per pass; no timings)
    .venv/bin/python benchmarks/routing_trace.py record builtin:stdlib-moe --start 0 --tokens 1024 \\
        --out benchmarks/results/routing-trace-a.json
    # recall, last-token recall and usage skew per layer, and what a cache would hit
    .venv/bin/python benchmarks/routing_trace.py stats benchmarks/results/routing-trace-a.json
    # replayed on the experts benchmark model: benchmarks/experts.py --routing-trace FILE

Recording builds the model with the lookahead streaming builds (`latentkv.models.moe.Lookahead`): each MoE
layer is predicted early, by its router run on the residual stream after the previous block's
attention, and again late, on the previous block's output (the first MoE layer only late, from
the dense block before it). The trace keeps, per MoE layer and token, the k experts chosen with
their weights and the two predictions.

Replay (`attach`) makes a streamed model route by the trace instead of its own routers: bench
MoE layer j takes trace layer `first + j`, token by token (a pass of N tokens takes the next N
rows), expert ids used as they are (the model needs as many experts as the trace, and the same
top-k), and the prefetch names the trace's predictions instead of running the next router. What
the bench model computes is then meaningless, but what it reads, caches, prefetches and waits
for is what the trained model's routing asks for.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

FORMAT = "latentkv-routing-trace/1"


# --- recording ---------------------------------------------------------------------------------


class _Noting:
    """A resident layer's experts as an `ExpertStore` that notes the predictions made for it."""

    def __init__(self, inner, calls: list[list[int]]):
        self.inner, self.calls = inner, calls
        self.num_experts = inner.num_experts
        self.stacked, self.packed = inner.stacked, inner.packed

    def run(self, x: torch.Tensor, jobs):
        return self.inner.run(x, jobs)

    def prefetch(self, ids) -> None:
        self.calls.append(sorted(int(i) for i in ids))

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class _Source:
    """An `ExpertSource` over a resident model's experts that predicts, as streaming does."""

    predicts = True

    def __init__(self, resident, calls: dict[int, list[list[int]]]):
        self.resident, self.calls = resident, calls

    def store(self, layer: int) -> _Noting:
        return _Noting(self.resident.blocks[layer].mlp.experts, self.calls.setdefault(layer, []))


class _Chosen:
    """A router that remembers its last choice (the lookahead keeps its own reference)."""

    def __init__(self, router) -> None:
        self.router = router
        self.last: tuple[list[int], list[float]] | None = None

    def __call__(self, x: torch.Tensor):
        idx, w = self.router(x)
        self.last = idx[0].tolist(), [round(v, 5) for v in w[0].tolist()]
        return idx, w


def record(model_dir: Path, tokens: list[int]) -> dict:
    """Teacher-forced decode of `tokens`; the trace dict (see the module docstring)."""
    from latentkv.models.weights import load_model
    from latentkv.streaming.attach import moe_layers

    calls: dict[int, list[list[int]]] = {}
    model = load_model(
        model_dir,
        experts=_Source(load_model(model_dir, load_mtp=False, device="cpu"), calls),
        load_mtp=False,
        device="cpu",
    )
    layers = moe_layers(model)
    chosen = {}
    for i in layers:
        chosen[i] = model.blocks[i].mlp.router = _Chosen(model.blocks[i].mlp.router)
    per_layer = {i: {"experts": [], "weights": [], "early": [], "late": []} for i in layers}
    cache = model.make_cache()
    with torch.inference_mode():
        for t in tokens:
            for c in calls.values():
                c.clear()
            model.forward(torch.tensor([t]), cache)
            for i in layers:
                experts, weights = chosen[i].last
                made = calls.get(i, [])
                row = per_layer[i]
                row["experts"].append(experts)
                row["weights"].append(weights)
                row["early"].append(made[0] if len(made) == 2 else None)
                row["late"].append(made[-1] if made else None)
    cfg = model.cfg
    return {
        "format": FORMAT,
        "n_experts": cfg.n_routed_experts,
        "top_k": cfg.num_experts_per_tok,
        "moe_layers": layers,
        "tokens": tokens,
        "layers": {str(i): per_layer[i] for i in layers},
    }


# --- statistics ----------------------------------------------------------------------------------


def load(path: str | Path) -> dict:
    """A trace file; one clear ValueError if it is not one."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read routing trace {path}: {exc}") from None
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise ValueError(f"{path} is not a routing trace ({FORMAT})")
    return trace


def _recall(asked: list[list[int]], predicted: list[list[int] | None]) -> float | None:
    hit = total = 0
    for a, p in zip(asked, predicted, strict=True):
        if p is not None:
            hit += len(set(a) & set(p))
            total += len(a)
    return hit / total if total else None


def layer_stats(row: dict, n_experts: int) -> dict:
    """Recall of each prediction, and usage skew, of one layer's trace."""
    asked = row["experts"]
    union = [
        None if e is None and lt is None else sorted(set(e or []) | set(lt or []))
        for e, lt in zip(row["early"], row["late"], strict=True)
    ]
    counts = torch.bincount(torch.tensor(asked).flatten(), minlength=n_experts).double()
    share = counts / counts.sum()
    top = share.sort(descending=True).values
    entropy = -(share[share > 0] * share[share > 0].log()).sum().item()
    return {
        "recall_early": _recall(asked, row["early"]),
        "recall_late": _recall(asked, row["late"]),
        "recall": _recall(asked, union),
        "last_token_recall": _recall(asked[1:], asked[:-1]),
        "max_over_mean": float(top[0] * n_experts),
        "top_eighth_share": float(top[: max(1, n_experts // 8)].sum()),
        "effective_experts": math.exp(entropy),
        "unused": int((counts == 0).sum()),
    }


def cache_hit_rate(train: dict | None, test: dict, layers: list[str], per_layer: int, pin: float) -> float:
    """Hit rate of an LRU cache of `per_layer` experts per layer (one cache for the layers) over
    `test`, with the hottest experts of `train` pinned up to `pin` of it (no pinning: train None)."""
    from latentkv.experts.cache import ExpertCache

    cache = ExpertCache(per_layer * len(layers), "lru")
    if train is not None:
        counts = [
            (c, layer, e)
            for layer in layers
            for e, c in enumerate(
                torch.bincount(
                    torch.tensor(train["layers"][layer]["experts"]).flatten(), minlength=train["n_experts"]
                ).tolist()
            )
        ]
        for _c, layer, e in sorted(counts, reverse=True)[: int(pin * per_layer * len(layers))]:
            cache.put((layer, e), True, 1, pin=True)
    for t in range(len(test["tokens"])):
        cache.next_step()
        for layer in layers:
            keys = [(layer, e) for e in sorted(test["layers"][layer]["experts"][t])]
            cache.protect(keys)
            for key in keys:
                if cache.get(key) is None:
                    cache.put(key, True, 1)
            cache.release()
    return cache.stats.hit_rate


def stats(trace: dict) -> dict:
    n = trace["n_experts"]
    return {layer: layer_stats(row, n) for layer, row in trace["layers"].items()}


def stats_table(trace: dict) -> str:
    head = "| MoE layer | recall early | recall late | recall (both) | last-token recall | hottest / mean | hottest 1/8 share | effective experts | unused |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    for layer, s in stats(trace).items():
        lines.append(
            f"| {layer} | {fmt(s['recall_early'])} | {fmt(s['recall_late'])} | {fmt(s['recall'])} | "
            f"{fmt(s['last_token_recall'])} | {s['max_over_mean']:.2f} | {s['top_eighth_share']:.1%} | "
            f"{s['effective_experts']:.1f} of {trace['n_experts']} | {s['unused']} |"
        )
    return "\n".join(lines)


# --- replay --------------------------------------------------------------------------------------


class TraceRouter:
    """Routes by a trace layer: each call of N rows returns the next N rows' experts and weights
    (wrapping around at the end of the trace)."""

    def __init__(self, row: dict, top_k: int):
        self.experts = torch.tensor(row["experts"], dtype=torch.long)  # [T, k]
        self.weights = torch.tensor(row["weights"], dtype=torch.float32)
        self.early, self.late = row["early"], row["late"]
        self.top_k = top_k
        self.cursor = 0

    def rows(self, n: int) -> torch.Tensor:
        return (self.cursor + torch.arange(n)) % self.experts.shape[0]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rows(x.shape[0])
        self.cursor += x.shape[0]
        return self.experts[r], self.weights[r]

    def predicted(self, n: int, early: bool) -> list[int]:
        """The trace's prediction for this layer's next pass of n rows (the union over them)."""
        ids: set[int] = set()
        for t in self.rows(n).tolist():
            p = (self.early if early else self.late)[t]
            ids.update(p if p is not None else [])
        return sorted(ids)


class _TraceLookahead:
    """A block's prefetch, from the trace: a MoE block calls it twice per pass (before its experts:
    the early prediction; after: the late one), the dense block before the first MoE layer once."""

    def __init__(self, store, router: TraceRouter, calls_per_pass: int):
        self.store, self.router = store, router
        self.calls_per_pass = calls_per_pass
        self.calls = 0

    def __call__(self, hidden: torch.Tensor) -> None:
        early = self.calls_per_pass == 2 and self.calls % 2 == 0
        self.calls += 1
        ids = self.router.predicted(hidden.shape[0], early)
        if ids:
            self.store.prefetch(ids)


def attach(model, trace: dict, first: int | None = None) -> list[int]:
    """Make a streamed model (`load_streamed`) route and prefetch by `trace`: bench MoE layer j takes
    trace MoE layer first + j (default: the trace's middle layers). Returns the trace layers used."""
    from latentkv.models.moe import PrefetchingMLP
    from latentkv.streaming.attach import moe_layers

    layers = moe_layers(model)
    available = trace["moe_layers"]
    if first is None:
        first = available[(len(available) - len(layers)) // 2]
    if first not in available or available.index(first) + len(layers) > len(available):
        raise ValueError(
            f"the trace has MoE layers {available}: {len(layers)} consecutive ones from layer {first} do not exist"
        )
    chosen = available[available.index(first) : available.index(first) + len(layers)]
    if model.cfg.n_routed_experts < trace["n_experts"] or model.cfg.num_experts_per_tok != trace["top_k"]:
        raise ValueError(
            f"the trace routes top-{trace['top_k']} of {trace['n_experts']} experts; the model has "
            f"top-{model.cfg.num_experts_per_tok} of {model.cfg.n_routed_experts}"
        )
    routers = {}
    for i, t in zip(layers, chosen, strict=True):
        routers[i] = model.blocks[i].mlp.router = TraceRouter(trace["layers"][str(t)], trace["top_k"])
    for here, nxt in zip(layers, layers[1:], strict=False):
        model.blocks[here].mlp.lookahead = _TraceLookahead(model.blocks[nxt].mlp.experts, routers[nxt], 2)
    before = model.blocks[layers[0] - 1].mlp if layers and layers[0] > 0 else None
    if isinstance(before, PrefetchingMLP):
        before.lookahead = _TraceLookahead(model.blocks[layers[0]].mlp.experts, routers[layers[0]], 1)
    return chosen


# --- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a trace on held-out text")
    r.add_argument("model", help="model folder or builtin:NAME (its heldout.txt is the text)")
    r.add_argument("--start", type=int, default=0, help="first token of heldout.txt")
    r.add_argument("--tokens", type=int, default=1024)
    r.add_argument("--out", required=True)
    s = sub.add_parser("stats", help="per-layer recall and skew; with --test, cache hit rates")
    s.add_argument("trace")
    s.add_argument(
        "--test", default=None, help="a second trace: hit rates on it, with and without the first's hot set"
    )
    s.add_argument("--json", default=None, help="write the statistics here")
    args = p.parse_args(argv)
    if args.cmd == "record":
        from latentkv.models.registry import resolve
        from latentkv.tokenizer import Tokenizer

        directory = resolve(args.model)
        text = (directory / "heldout.txt").read_text(errors="replace")
        ids = Tokenizer.of_model(directory).encode(text)[args.start : args.start + args.tokens]
        trace = record(directory, ids)
        trace.update(model=args.model, text="heldout.txt", start=args.start)
        Path(args.out).write_text(json.dumps(trace, separators=(",", ":")))
        print(stats_table(trace))
        return 0
    try:
        trace = load(args.trace)
        test = load(args.test) if args.test else None
    except ValueError as exc:
        print(f"routing_trace.py: {exc}", file=sys.stderr)
        return 2
    print(stats_table(trace))
    out = {"trace": args.trace, "layers": stats(trace)}
    if test is not None:
        layers = list(trace["layers"])
        n = trace["n_experts"]
        rows = []
        for frac in (0.125, 0.25, 0.5):
            per = int(frac * n)
            rows.append(
                {
                    "fraction": frac,
                    "lru": cache_hit_rate(None, test, layers, per, 0.5),
                    "lru_with_history": cache_hit_rate(trace, test, layers, per, 0.5),
                }
            )
        print(
            "\n| cache (share of experts) | LRU hit rate | with the first trace's hot set pinned (half the cache) |"
        )
        print("|---|---|---|")
        for row in rows:
            print(f"| {row['fraction']:g} | {row['lru']:.1%} | {row['lru_with_history']:.1%} |")
        out.update(test=args.test, hit_rates=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
