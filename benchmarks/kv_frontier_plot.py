"""Draw the KV bytes-vs-KLD frontier (docs/kv-frontier.png) from measured JSON.

    .venv/bin/python benchmarks/kv_frontier_plot.py --eval RESULT.json [...] \\
        [--llamacpp benchmarks/results/vs-llamacpp-kv.json] --context 256 --out docs/kv-frontier.png

--eval takes `latentkv eval ppl --json` outputs (every tier row of the chosen context is a point);
--llamacpp takes benchmarks/vs_llamacpp_kv.py's JSON (its llama.cpp rows become the second series).
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


def llama_points(path: Path | None) -> dict[str, tuple[int, float]]:
    if path is None:
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {
        r["tier"]: (r["bytes"], r["kld"]) for r in rows if r["engine"] == "llama.cpp" and r.get("kld", 0) > 0
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval", type=Path, nargs="+", required=True)
    p.add_argument("--llamacpp", type=Path, default=None)
    p.add_argument(
        "--llama-point",
        nargs="*",
        default=[],
        metavar="NAME:BYTES:KLD",
        help="llama.cpp points measured elsewhere (e.g. issue 18's llama-perplexity run: q4_0:90:0.00139)",
    )
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--title", default="builtin:fixture, KV bytes vs KL divergence from full precision")
    p.add_argument("--out", type=Path, default=Path("docs/kv-frontier.png"))
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    series = [("latentkv eval ppl", points(args.eval, args.context), "o", "tab:blue")]
    series.append(("llama.cpp llama-perplexity", llama_points(args.llamacpp), "s", "tab:red"))
    given = {n: (int(b), float(k)) for n, b, k in (t.split(":") for t in args.llama_point)}
    series.append(("llama.cpp llama-perplexity (b11434, 300 chunks, issue 18)", given, "^", "tab:orange"))
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
    ax.set_title(f"{args.title}\ncontext {args.context}, second half of each window scored", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
