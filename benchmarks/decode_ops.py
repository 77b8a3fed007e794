"""Operator calls per decode step: what a small model's decode is bound by, counted, not timed.

On a model of a few MB (builtin:fixture, builtin:tiny) a decode step costs its operator calls,
~2 us each, far more than its weight bytes (docs/weights.md, "Side by side with llama.cpp").
Counts are deterministic, so this is a number to improve on a busy machine. Per model and weight
format, one process loads the model, prefills a random prompt, runs warm-up decode steps, then
counts STEPS greedy decode steps two ways:

    python calls   torch functions and tensor methods called from Python (a TorchFunctionMode):
                   what costs Python and argument parsing; attributed to the latentkv function
                   that made the call (the innermost frame under src/latentkv)
    aten ops       operators dispatched to kernels (a TorchDispatchMode): what costs dispatch,
                   including the ops a composite call (F.linear, chunk, ...) decomposes into
    profiler       every operator event torch.profiler records, nested ones included (what
                   docs/weights.md counted earlier); the only count for --compile, whose graph
                   the two modes above would re-trace

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode_ops.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode_ops.py --models builtin:fixture \
        --weight-dtype f32 --top 30

Prints one table (and with --top the top sources per row) and writes JSON (default
benchmarks/results/decode-ops.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SRC = ""  # the imported latentkv's folder (main sets it): calls are attributed to files under it


class PythonCalls(TorchFunctionMode):
    """Counts torch calls made from Python, keyed by the latentkv function that made them."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":  # attribute reads (.shape, .dtype, ...) are not calls
            self.calls[_caller()] += 1
        return func(*args, **(kwargs or {}))


class AtenOps(TorchDispatchMode):
    """Counts operators reaching the kernels, keyed by operator name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if SRC and path.startswith(SRC):
            module = path[len(SRC) + 1 :].removesuffix(".py").replace("/", ".")
            return f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "(outside latentkv)"


def count_steps(
    model, tier_name: str, steps: int, prompt: int = 32, warm: int = 4, compiled: bool = False
) -> dict:
    """Python calls, aten ops and profiler events per decode step, averaged over `steps` greedy
    steps (profiler events only for a compiled step)."""
    cache = model.make_cache(model.tier(tier_name))
    g = torch.Generator().manual_seed(0)
    logits = model.forward(torch.randint(2, model.cfg.vocab_size, (prompt,), generator=g), cache)
    token = logits[-1].argmax().view(1)
    for _ in range(warm):
        token = model.forward(token, cache)[-1].argmax().view(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            token = model.forward(token, cache)[-1].argmax().view(1)
    events = Counter(e.name for e in prof.events())
    counted = {"profiler_events": sum(events.values()) / steps}
    if compiled:
        return {**counted, "profiler_events_by_name": {k: v / steps for k, v in events.most_common()}}
    calls, ops = PythonCalls(), AtenOps()
    with calls, ops:
        for _ in range(steps):
            token = model.forward(token, cache)[-1].argmax().view(1)
    return {
        "python_calls": sum(calls.calls.values()) / steps,
        "aten_ops": sum(ops.ops.values()) / steps,
        **counted,
        "python_calls_by_source": {k: v / steps for k, v in calls.calls.most_common()},
        "aten_ops_by_name": {k: v / steps for k, v in ops.ops.most_common()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="builtin:fixture,builtin:tiny")
    p.add_argument("--weight-dtype", default="f32,bf16,int8,int4")
    p.add_argument("--kv-cache-dtype", default="f32", help="one KV tier (default: f32, the default)")
    p.add_argument("--steps", type=int, default=8, help="decode steps counted (default: 8)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens prefilled first (default: 32)")
    p.add_argument("--compile", action="store_true", help="count the compiled decode step instead")
    p.add_argument("--top", type=int, default=0, help="also print the top N sources of Python calls")
    p.add_argument("--out", default="benchmarks/results/decode-ops.json")
    args = p.parse_args(argv)

    import latentkv
    from latentkv import version
    from latentkv.config import EngineConfig
    from latentkv.runtime import load

    global SRC
    SRC = str(Path(latentkv.__file__).resolve().parent)
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        for fmt in args.weight_dtype.split(","):
            engine = EngineConfig(weight_dtype=fmt, threads=1, compile=args.compile)
            model = load(name, engine, quiet=True).model
            counted = count_steps(model, args.kv_cache_dtype, args.steps, args.prompt, compiled=args.compile)
            rows.append(
                {"model": name, "weight_dtype": fmt, "kv_cache_dtype": args.kv_cache_dtype, **counted}
            )
            print(f"{name} {fmt} done", file=sys.stderr)

    step = "compiled decode step" if args.compile else "eager decode step"
    print(
        f"| model | weights | KV | python calls / step | aten ops / step | profiler events / step ({step}) |"
    )
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        calls, ops = (f"{r[k]:.0f}" if k in r else "n/a" for k in ("python_calls", "aten_ops"))
        print(
            f"| {r['model']} | {r['weight_dtype']} | {r['kv_cache_dtype']} | {calls} | {ops} | "
            f"{r['profiler_events']:.0f} |"
        )
    for r in rows if args.top and not args.compile else []:
        print(f"\n{r['model']} {r['weight_dtype']}: top sources of Python calls per step")
        for source, n in list(r["python_calls_by_source"].items())[: args.top]:
            print(f"  {n:7.1f}  {source}")
        ops = ", ".join(f"{k} {v:.0f}" for k, v in list(r["aten_ops_by_name"].items())[: args.top])
        print(f"  aten: {ops}")
    meta = {
        "version": version(),
        "steps": args.steps,
        "prompt": args.prompt,
        "compile": args.compile,
        "torch": torch.__version__,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
