"""Draw the KV bytes-vs-KLD frontier (docs/kv-frontier.png) from measured JSON.

    # docs/kv-frontier.png: both engines from one run on the same chunks
    .venv/bin/python benchmarks/kv_frontier_plot.py --llamacpp benchmarks/results/vs-llamacpp-kv.json \\
        --out docs/kv-frontier.png
    # or latentkv's points from `latentkv eval ppl --json` outputs instead
    .venv/bin/python benchmarks/kv_frontier_plot.py --eval RESULT.json [...] --context 256 --out F.png

--llamacpp takes benchmarks/vs_llamacpp_kv.py's JSON: its llama.cpp rows are one series and, without
--eval, its latentkv rows the other. --eval takes `latentkv eval ppl --json` outputs (every tier row
of the chosen context is a point). Every point comes from a results file; the caption names them.
KLD is drawn on a log axis; the f32 reference (KLD 0) is left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(paths: list[Path], context: int) -> dict[str, tuple[int, float]]:
    """tier -> (bytes per token per layer, KLD), the last file winning on repeats."""
    out: dict[str, tuple[int, float]] = {}
    for path in paths:
        for ctx in json.loads(path.read_text())["contexts"]:
            if ctx["context"] != context:
                continue
            for row in ctx["tiers"]:
                if row["kld"] > 0:
                    out[row["tier"]] = (row["bytes_per_token_layer"], row["kld"])
    return out


def engine_points(path: Path | None, engine: str) -> dict[str, tuple[int, float]]:
    """tier -> (bytes, KLD) of one engine's rows in a vs_llamacpp_kv.py result."""
    if path is None:
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {r["tier"]: (r["bytes"], r["kld"]) for r in rows if r["engine"] == engine and r.get("kld", 0) > 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval", type=Path, nargs="+", default=None, help="latentkv eval ppl --json results")
    p.add_argument("--llamacpp", type=Path, default=None, help="a benchmarks/vs_llamacpp_kv.py result")
    p.add_argument("--context", type=int, default=None, help="the context of --eval's rows (default: 256)")
    p.add_argument("--title", default="builtin:fixture, KV bytes vs KL divergence from full precision")
    p.add_argument("--out", type=Path, default=Path("docs/kv-frontier.png"))
    args = p.parse_args(argv)
    if args.eval is None and args.llamacpp is None:
        p.error("give --llamacpp FILE (both engines) and/or --eval FILE...")
    run = json.loads(args.llamacpp.read_text()) if args.llamacpp else None
    if args.eval is None:
        context = run["context"]
        ours = engine_points(args.llamacpp, "latentkv")
        ours_label = f"latentkv ({args.llamacpp.name})"
    else:
        context = args.context or 256
        ours = points(args.eval, context)
        ours_label = "latentkv eval ppl (" + ", ".join(e.name for e in args.eval) + ")"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    series = [(ours_label, ours, "o", "tab:blue")]
    if run is not None:
        label = f"llama.cpp {run.get('llama_cpp_version', '')} llama-perplexity ({args.llamacpp.name})"
        series.append((label, engine_points(args.llamacpp, "llama.cpp"), "s", "tab:red"))
    for label, pts, marker, color in series:
        if not pts:
            continue
        ax.scatter(
            [b for b, _ in pts.values()],
            [k for _, k in pts.values()],
            marker=marker,
            color=color,
            label=label,
        )
        for name, (b, k) in pts.items():
            ax.annotate(name, (b, k), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token per layer (c 128 + r 32 values)")
    ax.set_ylabel("mean KL(full precision || tier) per token, nats")
    chunks = f", {run['chunks']} chunks" if run is not None and args.eval is None else ""
    ax.set_title(f"{args.title}\ncontext {context}{chunks}, second half of each window scored", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
