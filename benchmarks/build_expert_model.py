"""Build the expert-streaming benchmark model (issue 16): GLM-5 widths, 1 dense + 3 MoE layers,
64 experts top-8 by default, random weights; the routed experts go straight into OUT/experts/
(an expert store), one expert in memory at a time, and never into a float checkpoint.

    .venv/bin/python benchmarks/build_expert_model.py ~/.cache/latentkv/experts-bench \\
        --experts 64 --moe-layers 3 --format int4

Needs the disk: about 5 GB of dense f32 weights plus the experts (int4: about 4 GB; f32: 29 GB).
`--format` is any streamable weight format (`latentkv.experts.extent.CODECS`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from latentkv.streaming.bench_model import bench_config, build_bench_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (config.json, safetensors, experts/)")
    p.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer (default: 64)")
    p.add_argument(
        "--moe-layers", type=int, default=3, help="MoE layers after the one dense layer (default: 3)"
    )
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default: 8)")
    p.add_argument("--format", default="int4", help="expert weight format (default: int4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config", default=None, help="JSON object of config.json overrides (tests: small widths)"
    )
    args = p.parse_args(argv)
    overrides = json.loads(args.config) if args.config else {}
    cfg = bench_config(args.experts, args.moe_layers, args.top_k, **overrides)
    t0 = time.perf_counter()
    try:
        m = build_bench_model(args.out, cfg, args.format, args.seed)
    except ValueError as exc:
        print(f"build_expert_model: error: {exc}", file=sys.stderr)
        return 2
    one = max(e.layout.stride for e in m.layers.values())
    cold = args.top_k * len(m.layers) * one
    print(
        f"wrote {args.out}: {len(m.layers)} MoE layers x {args.experts} experts, {m.expert_bytes / 1e9:.2f} GB "
        f"of experts ({one / 1e6:.1f} MB each, {cold / 1e6:.0f} MB read per cold token) in "
        f"{time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
