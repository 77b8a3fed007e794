"""What the Triton decode kernel costs once compiled for a GPU, measured on a machine without one.

    python benchmarks/triton_compile.py [--arch 90] [--out benchmarks/results/triton-compile-sm90.json]

Compiles `attention/triton/kernels.py`'s split kernel for sm_ARCH (triton's compiler and ptxas run
on the CPU) at GLM-5's widths (512 + 64) for every tier the kernel serves, at the launcher's
defaults (BLOCK_T rows a tile, 16 heads a program, NUM_WARPS warps), with bfloat16 operands (f32:
float32 products, its default), and prints per tier: registers and spill stack per thread, shared
memory per program, and the kernel's global loads as PTX counts them (static instructions; cp.async
ones are the pipelined tile loads). No timing: that needs the GPU (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

SERVED = [
    "f32",
    "bf16",
    "fp8",
    "q8_0",
    "q5_0",
    "q4_0",
    "q4_1",
    "q8s",
    "q5s",
    "q4s",
    "wq4",
    "hq4_0",
    "tq4",
    "tq3",
    "tq4-r8",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200, 120: RTX 5090)"
    )
    parser.add_argument("--tiers", default=",".join(SERVED))
    parser.add_argument("--widths", default="512,64", help="kv_lora_rank,qk_rope_head_dim (default: GLM-5's)")
    parser.add_argument(
        "--precision", default=None, help="ieee or bf16 for every tier (default: f32 ieee, others bf16)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import triton

    from latentkv.attention.triton.ahead import compile_decode
    from latentkv.attention.triton.decode import BLOCK_H, BLOCK_T, NUM_WARPS
    from latentkv.kv.codecs import TIERS, get_codec

    n_c, n_r = (int(w) for w in args.widths.split(","))
    rows = []
    print(f"{'tier':8} {'precision':9} {'regs':>5} {'stack B':>8} {'shared B':>9}  loads")
    for tier in args.tiers.split(","):
        t = TIERS[tier]
        precision = args.precision or ("ieee" if tier == "f32" else "bf16")
        c = compile_decode(get_codec(t.c, n_c), get_codec(t.r, n_r), arch=args.arch, precision=precision)
        rows.append({"tier": tier, **c.as_dict()})
        loads = ", ".join(f"{k} {v}" for k, v in sorted(c.loads.items()))
        print(
            f"{tier:8} {precision:9} {c.registers:5} {c.stack_bytes:8} {c.shared_bytes:9}  {loads}",
            flush=True,
        )
    if args.out:
        meta = {
            "arch": args.arch,
            "block_t": BLOCK_T,
            "block_h": BLOCK_H,
            "num_warps": NUM_WARPS,
            "widths": [n_c, n_r],
            "triton": triton.__version__,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "command": "python benchmarks/triton_compile.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
