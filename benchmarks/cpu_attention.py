"""Decode speed with latentkv's CPU attention kernel on and off (LATENTKV_CPU_ATTENTION=0), the
two interleaved round by round, each round one `latentkv bench decode` process per mode.

    python benchmarks/cpu_attention.py ~/.cache/latentkv/slice --weight-dtype int4 \\
        --kv-cache-dtype bf16,q8s,q4s --context 4096 --rounds 3 \\
        --out benchmarks/results/cpu-attention-slice-4096.json

Prints a table (per KV tier: the median decode tok/s of the rounds with min-max, kernel on and
off, and their ratio) and writes every round's rows, the machine and the commit as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

MODES = {"on": None, "off": "0"}  # LATENTKV_CPU_ATTENTION per mode (None: unset, the default)


def one_run(args: argparse.Namespace, mode: str) -> list[dict]:
    """One `latentkv bench decode` process in `mode`; its rows."""
    env = dict(os.environ)
    env.pop("LATENTKV_CPU_ATTENTION", None)
    if MODES[mode] is not None:
        env["LATENTKV_CPU_ATTENTION"] = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            sys.executable, "-m", "latentkv", "bench", "decode", args.model,
            "--weight-dtype", args.weight_dtype, "--kv-cache-dtype", args.kv_cache_dtype,
            "--context", str(args.context), "--decode-tokens", str(args.decode_tokens),
            "--fill", "random", "--threads", str(args.threads), "--json", "--out", str(out),
        ] + (["--compile"] if args.compile else [])  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench decode failed ({mode}): {done.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())["rows"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model directory (e.g. ~/.cache/latentkv/slice) or builtin:NAME")
    p.add_argument("--weight-dtype", default="int4", help="one weight format (default: int4)")
    p.add_argument("--kv-cache-dtype", default="bf16,q8s,q4s", help="KV tiers (default: bf16,q8s,q4s)")
    p.add_argument("--context", type=int, default=4096, help="tokens of context, random rows (default: 4096)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per row (default: 32)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument("--compile", action="store_true", help="also the compiled step's rows (small models)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, on then off (default: 3)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for mode in MODES:
            rows = one_run(args, mode)
            runs.append({"round": round_ + 1, "mode": mode, "rows": rows})
            speeds = ", ".join(f"{r['kv_cache_dtype']} {r['decode_tps']:.2f}" for r in rows)
            print(f"round {round_ + 1} kernel {mode}: {speeds} tok/s", file=sys.stderr, flush=True)
    keys = [(r["engine"], r["kv_cache_dtype"]) for r in runs[0]["rows"]]
    summary = []
    for engine, tier in keys:
        cell = {}
        for mode in MODES:
            samples = [
                r["decode_tps"]
                for run in runs
                if run["mode"] == mode
                for r in run["rows"]
                if (r["engine"], r["kv_cache_dtype"]) == (engine, tier)
            ]
            cell[mode] = {
                "median": statistics.median(samples),
                "min": min(samples),
                "max": max(samples),
                "samples": samples,
            }
        summary.append(
            {
                "engine": engine,
                "kv_cache_dtype": tier,
                **cell,
                "on_vs_off": cell["on"]["median"] / cell["off"]["median"],
            }
        )
    print("| engine | KV tier | kernel on tok/s | kernel off (reference) tok/s | on / off |")
    print("|---|---|---:|---:|---:|")
    for s in summary:
        on, off = s["on"], s["off"]
        print(
            f"| {s['engine']} | {s['kv_cache_dtype']} | {on['median']:.2f} ({on['min']:.2f}-{on['max']:.2f}) "
            f"| {off['median']:.2f} ({off['min']:.2f}-{off['max']:.2f}) | {s['on_vs_off']:.3f}x |"
        )
    if args.out:
        meta = {
            "command": " ".join(sys.argv),
            "statistic": "median of the rounds' decode tok/s (each a run's mean over its decode steps), min-max",
            "cpu": machine.cpu_model(),
            "cpu_flags": machine.cpu_flags(),
            "commit": machine.commit(),
            "args": vars(args) | {"out": str(args.out)},
        }
        args.out.write_text(json.dumps({**meta, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
