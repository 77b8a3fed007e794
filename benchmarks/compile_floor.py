"""What a torch.compile'd step costs per call before it computes anything, by how many tensors
it reads from the model's objects (issue 28: a small model's compiled decode step).

    PYTHONPATH=src python benchmarks/compile_floor.py [--inputs 10,60,130] [--rounds 3] [--out FILE]

A compiled step takes every weight it reads as a graph input: the code torch.compile generates
gathers each one from the model's objects on every call, and the graph's entry receives and
checks them. builtin:fixture's step reads ~130 tensors. Each case here compiles a step that adds
N small tensors (16 floats) to its input, so what it times is that per-call cost and nothing
else, the way latentkv compiles its step (`fullgraph`, its guard filter `step_guards`):

    objects, C++ wrapper     the tensors are attributes of plain objects, as latentkv's weights
                             are; inductor's C++ wrapper (what `--compile` uses)
    objects, Python wrapper  the same, inductor's Python wrapper
    module + freezing        the tensors are buffers of the compiled nn.Module and inductor
                             freezes them into the graph as constants (not latentkv's layout:
                             what that layout would save)

Each case runs in its own process (torch.compile's settings are process-wide), the cases
interleaved for --rounds rounds; per process the best of 5 passes of 5,000 calls, the table
the median over rounds with min-max. Timings are wall time on whatever else the machine does:
run it idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import machine

CASES = ("objects-cpp", "objects-py", "module-freezing")


def measure(case: str, n: int, calls: int = 5000) -> float:
    """Seconds per call of the compiled N-tensor step in `case` (this process)."""
    import torch

    from latentkv.models.compiled import step_guards

    torch.set_num_threads(2)
    if case == "module-freezing":
        torch._inductor.config.freezing = True

        class Step(torch.nn.Module):
            def __init__(self):
                super().__init__()
                for i in range(n):
                    self.register_buffer(f"w{i}", torch.randn(16))

            def forward(self, x):
                for i in range(n):
                    x = x + getattr(self, f"w{i}")
                return x

        fn = Step()
    else:

        class Holder:
            def __init__(self):
                self.t = torch.randn(16)

        class Step:  # noqa: F811  (the plain-object layout)
            def __init__(self):
                self.parts = [Holder() for _ in range(n)]

            def forward(self, x):
                for p in self.parts:
                    x = x + p.t
                return x

        fn = Step().forward
    options = {"cpp_wrapper": case != "objects-py", "guard_filter_fn": step_guards}
    step = torch.compile(fn, fullgraph=True, options=options)
    x = torch.randn(16)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            step(x)
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                step(x)
            best = min(best, (time.perf_counter() - t0) / calls)
    return best


def run_case(case: str, n: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--case", case, "--n", str(n)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--inputs", default="10,60,130", help="tensor counts to compile steps for (default: 10,60,130)"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compile-floor.json"))
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one measurement (a child process)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.counts = [int(v) for v in args.inputs.split(",")]
    except ValueError:
        p.error(f"--inputs takes comma-separated counts, got {args.inputs!r}")
    if args.rounds < 1 or any(c < 1 for c in args.counts):
        p.error("--rounds and every --inputs count must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case is not None:
        print(measure(args.case, args.n))
        return 0
    samples: dict[str, dict[int, list[float]]] = {c: {n: [] for n in args.counts} for c in CASES}
    for r in range(args.rounds):
        for n in args.counts:
            for case in CASES:
                us = run_case(case, n) * 1e6
                samples[case][n].append(us)
                print(f"round {r + 1}: {case} N={n}: {us:.1f} us", file=sys.stderr, flush=True)
    print("| tensors read | " + " | ".join(CASES) + " |")
    print("|---:|" + "---:|" * len(CASES))
    rows = []
    for n in args.counts:
        cells = []
        for case in CASES:
            s = samples[case][n]
            cells.append(f"{statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f})")
            rows.append({"case": case, "tensors": n, "us_per_call": s, "median": statistics.median(s)})
        print(f"| {n} | " + " | ".join(cells) + " |")
    import torch

    result = {
        "what": "per-call cost of a torch.compile'd step adding N tensors, microseconds",
        "statistic": f"median over {args.rounds} interleaved rounds of the best of 5 x 5,000 calls",
        "rows": rows,
        "machine": {
            "cpu": machine.cpu_model(),
            "cpu_flags": machine.cpu_flags(),
            "threads": 2,
            "torch": torch.__version__,
            "latentkv_commit": machine.commit(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
