"""bf16 weights at one row (decode of one sequence): the candidate kernels side by side (issue 15).

    PYTHONPATH=src python benchmarks/bf16_gemv.py [--threads 2] [--shapes 6144x6144,...] [--out FILE]

For each matrix shape [out x in] (default: the GLM-5-width slice's decode matrices) it times
one row x through each candidate, interleaved in one process, median of --repeats. Each timed
pass runs over enough distinct copies of the matrix (--mib MiB in all, above this machine's
300 MiB L3) that the weights come from memory, as in a real decode step; the time is per call.
GB/s is the weight bytes a call reads (2 per weight for bf16, 4 for f32, 1 for int8) over its
time. Candidates:

    F.linear          what Bf16Linear ran before: oneDNN's bf16 GEMM with M = 1
    torch.mv          torch's bf16 GEMV (float32 accumulation): what Bf16Linear runs at one row
    mkldnn prepacked  `mkldnn._reorder_linear_weight` once, `mkldnn._linear_pointwise` per call
                      (what inductor's CPU freezing emits)
    latentkv bf16_mm  latentkv's own kernel (latentkv/native/bf16.cpp, float32 x): what
                      Bf16Linear runs at one row for matrices up to NATIVE_MAX_BYTES
    f32 F.linear      the same matrix in float32 (twice the bytes): the f32 format
    int8 op           `_weight_int8pack_mm` (half the bytes): the int8 format's decode kernel
    sum bf16 / f32    reading the same bytes and nothing else: the memory bound

and the per-head products of MLA's absorbed attention (64 heads, W_UK^T [512 x 192], W_UV
[256 x 512]): one F.linear per head (HeadLinears' path for small row counts) vs one batched
matmul. A table per shape on stdout, every number in JSON (--out, default
benchmarks/results/bf16-gemv.json). Timings on a busy machine: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from latentkv import native

# The slice's decode matrices [out x in] (hidden 6144, 64 heads, q_lora 2048, experts 2048 wide)
SLICE = {
    "2752x6144": "q_a | kv_a | indexer wk, fused",
    "16384x2048": "q_b",
    "4096x2048": "indexer wq_b",
    "6144x16384": "o_proj",
    "24576x6144": "dense MLP gate | up",
    "6144x12288": "dense MLP down",
    "4096x6144": "expert gate | up",
    "6144x2048": "expert down",
    "16384x6144": "lm_head",
    "6144x6144": "square, for reference",
}
# builtin:fixture's one-row matrices (hidden 256): time them with a small --mib (its whole model
# is ~15 MB, so a decode step reads them from the cache, not from memory)
FIXTURE = {
    "4096x256": "lm_head",
    "3456x256": "a layer's experts' gate | up, fused",
    "256x1728": "a layer's experts' down, fused",
    "352x256": "q_a | kv_a, fused",
    "256x768": "dense MLP down",
}
HEADS = ((64, 512, 192), (64, 256, 512))  # (H, out, in): W_UK^T and W_UV of the slice


def timed(runs: dict[str, object], copies: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each run(i) over copies i = 0..copies-1, interleaved, `repeats` passes."""
    for run in runs.values():
        run(0)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            for i in range(copies):
                run(i)
            times[name].append((time.perf_counter() - start) / copies)
    return times


def matrix_runs(out_f: int, in_f: int, copies: int) -> tuple[dict, dict[str, int]]:
    """The candidates for one row through [out_f, in_f], and the bytes each reads per call."""
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(out_f, in_f, generator=g).to(torch.bfloat16) for _ in range(copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(m, 1) for m in w]
    wf = [m.float() for m in w]
    q = [torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=g) for _ in range(copies)]
    scale = torch.rand(out_f, generator=g).to(torch.bfloat16)
    x = torch.randn(1, in_f, generator=g)
    xb = x.to(torch.bfloat16)
    n = out_f * in_f
    own = native.kernels()
    runs = {
        "F.linear": lambda i: F.linear(xb, w[i]).float(),
        "torch.mv": lambda i: torch.mv(w[i], xb[0]).float(),
        **({"latentkv bf16_mm": lambda i: own.bf16_mm(x, w[i])} if own is not None else {}),
        "mkldnn prepacked": lambda i: torch.ops.mkldnn._linear_pointwise(xb, packed[i], None, "none", [], ""),
        "f32 F.linear": lambda i: F.linear(x, wf[i]),
        "int8 op": lambda i: torch.ops.aten._weight_int8pack_mm(xb, q[i], scale).float(),
        "sum bf16": lambda i: w[i].sum(),
        "sum f32": lambda i: wf[i].sum(),
    }
    nbytes = {name: 2 * n for name in runs} | {"f32 F.linear": 4 * n, "sum f32": 4 * n, "int8 op": n}
    return runs, nbytes


def head_runs(heads: int, out_f: int, in_f: int, copies: int) -> tuple[dict, dict[str, int]]:
    """One row per head through [H, out, in] bf16: per-head F.linear vs one batched matmul."""
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(heads, out_f, in_f, generator=g).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(heads, 1, in_f, generator=g).to(torch.bfloat16)
    runs = {
        "per-head F.linear": lambda i: torch.stack([F.linear(x[h], w[i][h]) for h in range(heads)]),
        "batched matmul": lambda i: torch.matmul(x, w[i].transpose(1, 2)),
        "sum bf16": lambda i: w[i].sum(),
    }
    return runs, dict.fromkeys(runs, 2 * heads * out_f * in_f)


def table(label: str, times: dict[str, list[float]], nbytes: dict[str, int], base: str) -> tuple[str, dict]:
    ref = statistics.median(times[base])
    lines = [f"{label}", f"| kernel | ms / call | GB/s | {base} / kernel |", "|---|---:|---:|---:|"]
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"ms": 1e3 * med, "gb_s": nbytes[name] / med / 1e9, "speedup": ref / med}
        lines.append(f"| {name} | {1e3 * med:.2f} | {nbytes[name] / med / 1e9:.1f} | {ref / med:.2f}x |")
    return "\n".join(lines), rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default=",".join(SLICE), help="OUTxIN,... (default: the slice's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--mib", type=int, default=400, help="weight MiB per timed pass (default 400)")
    p.add_argument("--no-heads", action="store_true", help="skip the per-head products")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bf16-gemv.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"{args.threads} threads, torch {torch.__version__}, capability {cpu}, median of {args.repeats}")
    result = {"threads": args.threads, "torch": torch.__version__, "capability": cpu, "shapes": {}}
    for shape in args.shapes.split(","):
        out_f, in_f = map(int, shape.split("x"))
        copies = max(2, -(-args.mib * 2**20 // (2 * out_f * in_f)))
        runs, nbytes = matrix_runs(out_f, in_f, copies)
        label = f"\n{shape} {SLICE.get(shape, FIXTURE.get(shape, ''))} ({copies} copies)"
        text, rows = table(label, timed(runs, copies, args.repeats), nbytes, "F.linear")
        print(text, flush=True)
        result["shapes"][shape] = rows
        del runs
    for heads, out_f, in_f in () if args.no_heads else HEADS:
        copies = max(2, -(-args.mib * 2**20 // (2 * heads * out_f * in_f)))
        runs, nbytes = head_runs(heads, out_f, in_f, copies)
        label = f"\n{heads} heads x {out_f}x{in_f} ({copies} copies)"
        text, rows = table(label, timed(runs, copies, args.repeats), nbytes, "per-head F.linear")
        print(text, flush=True)
        result["shapes"][f"{heads}x{out_f}x{in_f}"] = rows
        del runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
