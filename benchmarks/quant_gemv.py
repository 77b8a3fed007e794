"""int8 and int4 decode products: latentkv's kernels against torch's ops, at the memory wall (issue 28).

    PYTHONPATH=src python benchmarks/quant_gemv.py [--threads 2] [--rows 1,4,8] [--shapes expert,dense]
                                                   [--mib 1024] [--repeats 7] [--out FILE]

For each GLM-5 matrix shape [out x in] (the dense and expert decode matrices of the slice, which
has GLM-5's widths) and each row count (one sequence's decode, 4 rows, a batch of 8), it times the
product of those rows with an int8 and an int4 matrix through:

    torch op      what the formats ran before: x cast to bfloat16, `_weight_int8pack_mm` /
                  `_weight_int4pack_mm_for_cpu` on the op's packed layout, the result cast back
    latentkv      latentkv's kernel (latentkv/native) on float32 x as the process runs it, and on
                  AVX-512 VNNI both of its activation paths: x quantized per group to int16
                  (vpdpwssd) and to int8 (vpdpbusd), named "int16 x" / "int8 x" ("f32 x": the
                  float paths)
    inductor      (--inductor) int8 only: torch.compile(mode="max-autotune") of the dequantize-
                  then-multiply pattern, x @ q.to(bfloat16)^T * scale, the pattern Inductor's CPU
                  weight-only-quantization lowering targets, with the weights as graph inputs

and reads the machine's read bandwidth the way the issue measured it: a torch sum over the same
number of bytes (float32), with the same threads. Each timed pass runs over --mib MiB of distinct
matrices (views into one buffer of random codes, well past the last-level cache), so every call
reads its weights from memory, as a decode step does; candidates are interleaved pass by pass,
and a row reports the median of --repeats passes with their min-max. bytes: the weights and
scales a call reads (int8: 1 per weight + 2 per row; int4: 0.5 per weight + 4 per 64-weight
group). GB/s = bytes / time; "of sum" = that over the sum's GB/s in the same run.
A table on stdout, every number in JSON (--out, default benchmarks/results/quant-gemv.json),
with the CPU model, its flags, the threads and the torch version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from latentkv import native
from latentkv.weights import int4

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

# GLM-5 (and the slice) decode matrices, out x in: hidden 6144, q_lora 2048, 64 heads, experts
# 2048 wide (gate | up fused), dense MLP 12288 wide, vocabulary padded to 16384 in the slice.
SHAPES = {
    "expert": {"4096x6144": "expert gate | up", "6144x2048": "expert down"},
    "dense": {
        "2752x6144": "q_a | kv_a | indexer wk",
        "16384x2048": "q_b",
        "6144x16384": "o_proj",
        "24576x6144": "dense gate | up",
        "6144x12288": "dense down",
        "16384x6144": "lm_head",
    },
}
GROUP = int4.DEFAULT_GROUP_SIZE


def cpu_info() -> dict:
    """The CPU model, its flags and the kernel paths, for the JSON."""
    own = native.kernels()
    return {
        "cpu": machine.cpu_model(),
        "flags": machine.cpu_flags(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "latentkv_kernels": own.name if own is not None else f"unavailable: {native.unavailable()}",
    }


class Buffers:
    """Random int8 codes, random int4 codes (any byte is two valid nibbles, in any packed layout)
    and bfloat16 scales, --mib MiB of each format's weights: every shape's matrices are views
    into them, so a pass over a shape's matrices reads that many distinct bytes."""

    def __init__(self, mib: int, g: torch.Generator):
        self.nbytes = mib * 2**20
        self.q8 = torch.randint(-127, 128, (self.nbytes,), dtype=torch.int8, generator=g)
        self.q4 = torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=g)
        # int4 scales and zeros: 4 bytes per 64 weights, at most an eighth of the int4 bytes
        self.sz = (torch.rand(self.nbytes // 16, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
        self.s8 = (torch.rand(self.nbytes // 512, generator=g) * 0.01 + 0.001).to(torch.bfloat16)

    def int8(self, out_f: int, in_f: int) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """(count, q [count, out, in], scale [count, out], bytes per matrix)"""
        count = self.nbytes // (out_f * in_f)
        q = self.q8[: count * out_f * in_f].view(count, out_f, in_f)
        return count, q, self.s8[: count * out_f].view(count, out_f), out_f * in_f + 2 * out_f

    def int4(self, out_f: int, in_f: int) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """(count, packed [count, out, in / 2], scale_zeros [count, in / G, out, 2], bytes each)"""
        half, groups = out_f * in_f // 2, in_f // GROUP
        count = self.nbytes // (half + groups * out_f * 4)
        packed = self.q4[: count * half].view(count, out_f, in_f // 2)
        sz = self.sz[: count * groups * out_f * 2].view(count, groups, out_f, 2)
        return count, packed, sz, half + groups * out_f * 4


def own_paths() -> list:
    """latentkv's kernels as this process runs them, and on AVX-512 VNNI both activation paths
    for both formats (int16 x, path 3, and int8 x, path 4)."""
    own = native.kernels()
    if own is None:
        return []
    if own.isa in (3, 4):
        return [k for isa in (3, 4) if (k := native.with_isa(isa)) is not None]
    return [own]


def candidates(buf: Buffers, x: torch.Tensor, out_f: int, inductor: bool = False) -> dict:
    """name -> (run(i) over matrix i, bytes a call reads, matrices per pass)."""
    in_f = x.shape[1]
    c8, q8, s8, n8 = buf.int8(out_f, in_f)
    c4, q4, sz, n4 = buf.int4(out_f, in_f)

    def op8(i):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8[i], s8[i]).float()

    def op_4(i):  # the bytes read as the op's own packed layout
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), q4[i], GROUP, sz[i]).float()

    runs = {"int8 torch op": (op8, n8, c8), "int4 torch op": (op_4, n4, c4)}
    for k in own_paths():
        acts8, acts4 = native.ACTIVATIONS[k.isa], native.ACTIVATIONS[k.isa4]
        runs[f"int8 latentkv {acts8} x"] = (lambda i, k=k: k.int8_mm(x, q8[i], s8[i]), n8, c8)
        runs[f"int4 latentkv {acts4} x"] = (lambda i, k=k: k.int4_mm(x, q4[i], sz[i], GROUP, out_f), n4, c4)
    if inductor:
        woq = torch.compile(
            lambda x, q, s: (x @ q.to(torch.bfloat16).T) * s, mode="max-autotune", dynamic=False
        )
        xb = x.to(torch.bfloat16)
        runs["int8 inductor"] = (lambda i: woq(xb, q8[i], s8[i]).float(), n8, c8)
    return runs


def read_bandwidth(mib: int, repeats: int) -> list[float]:
    """GB/s of a torch float32 sum over `mib` MiB (the issue's measure of the memory's speed)."""
    buf = torch.rand(mib * 2**18)
    buf.sum()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        rates.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return rates


def timed(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each run over its matrices, interleaved pass by pass."""
    for run, _, _ in runs.values():
        run(0)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (run, _, count) in runs.items():
            t0 = time.perf_counter()
            for i in range(count):
                run(i)
            times[name].append((time.perf_counter() - t0) / count)
    return times


def summarize(times: list[float], nbytes: int, sum_gbs: float) -> dict:
    med = statistics.median(times)
    return {
        "ms": 1e3 * med,
        "ms_min": 1e3 * min(times),
        "ms_max": 1e3 * max(times),
        "bytes": nbytes,
        "gb_s": nbytes / med / 1e9,
        "of_sum": nbytes / med / 1e9 / sum_gbs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,8")
    p.add_argument(
        "--shapes", default="expert,dense", help="expert, dense, or OUTxIN,... (default: both sets)"
    )
    p.add_argument("--mib", type=int, default=1024, help="MiB of each format per timed pass (default 1024)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inductor", action="store_true", help="add torch.compile's int8 weight-only-quant path")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/quant-gemv.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes: dict[str, str] = {}
    for part in args.shapes.split(","):
        shapes |= SHAPES.get(part, {part: ""})
    rows = [int(r) for r in args.rows.split(",")]
    info = cpu_info() | {"threads": args.threads, "mib": args.mib, "repeats": args.repeats, "group": GROUP}
    print(f"{info['cpu']}, {args.threads} threads, torch {info['torch']} ({info['capability']}), "
          f"latentkv kernels: {info['latentkv_kernels']}; median of {args.repeats} (min-max)")  # fmt: skip
    sums = read_bandwidth(args.mib, args.repeats)
    sum_gbs = statistics.median(sums)
    print(
        f"read bandwidth (torch sum over {args.mib} MiB): {sum_gbs:.1f} GB/s ({min(sums):.1f}-{max(sums):.1f})"
    )
    result = {**info, "read_gb_s": sums, "shapes": {}}
    g = torch.Generator().manual_seed(0)
    buf = Buffers(args.mib, g)
    for shape, what in shapes.items():
        out_f, in_f = map(int, shape.split("x"))
        counts = (buf.int8(out_f, in_f)[0], buf.int4(out_f, in_f)[0])
        print(f"\n{shape} {what} ({counts[0]} int8, {counts[1]} int4 matrices per pass)")
        print("| rows | kernel | ms (min-max) | GB/s | of sum | vs torch op |")
        print("|---:|---|---:|---:|---:|---:|")
        result["shapes"][shape] = {"what": what, "matrices_per_pass": counts, "rows": {}}
        for r in rows:
            x = torch.randn(r, in_f, generator=g)
            runs = candidates(buf, x, out_f, args.inductor)
            times = timed(runs, args.repeats)
            cells = {name: summarize(times[name], runs[name][1], sum_gbs) for name in runs}
            for name, c in cells.items():
                base = cells[name.split()[0] + " torch op"]["ms"]
                c["vs_op"] = base / c["ms"]
                print(f"| {r} | {name} | {c['ms']:.3f} ({c['ms_min']:.3f}-{c['ms_max']:.3f}) | "
                      f"{c['gb_s']:.1f} | {100 * c['of_sum']:.0f}% | {c['vs_op']:.2f}x |", flush=True)  # fmt: skip
            result["shapes"][shape]["rows"][str(r)] = cells
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
