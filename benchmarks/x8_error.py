"""What quantizing the activations to int8 costs: latentkv's two AVX-512 VNNI paths for int8 and
int4 weights (x per group in int16, isa 3, or in int8, isa 4) against float64, beside what
llama.cpp's decode does to the same activations (q8_0: groups of 32, float16 scale; q8_K: groups
of 256, float32 scale) and torch's ops (x rounded to bfloat16, in float64 here).

    PYTHONPATH=src python benchmarks/x8_error.py [--rows 1,8] [--trials 3] [--out FILE]
                                                 [--ppl builtin:fixture] [--windows 64]

Error part: for GLM-5's decode shapes (expert gate | up, expert down, a dense slice), fresh
random weights (normal, a few rows scaled up) quantized to each format, and fresh activations
(normal with a few outlier channels 20x the rest, as transformer activations have); every
product is compared with x @ W~^T in float64 over the format's own dequantized matrix W~ (so the
weights' own rounding is not counted). Reported: the relative error ||y - ref|| / ||ref|| over
all outputs (median over trials), and for scale the error the weight format itself makes,
||x W^T - x W~^T|| / ||x W^T||.

--ppl MODEL: perplexity of MODEL's held-out text with int8 and int4 weights (KV f32), each
through both VNNI paths (the process's kernels replaced by the chosen path before the model
loads), with --context 32 windows (decode-sized products: int8 takes latentkv's kernel up to 32
rows, int4 up to 256), against f32 weights, paired; the table `latentkv eval ppl` prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from latentkv import native
from latentkv.weights import make_linear

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

SHAPES = {"4096x6144": "expert gate | up", "6144x2048": "expert down", "2048x6144": "dense slice"}


def activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Normal rows with 1% outlier channels, 20x the rest."""
    x = torch.randn(m, k, generator=g)
    outliers = torch.randperm(k, generator=g)[: max(1, k // 100)]
    x[:, outliers] *= 20
    return x


def grouped(x: torch.Tensor, group: int, step_of) -> torch.Tensor:
    """x [M, K] quantized to int8 per group of columns (codes round(x / step), |codes| <= 127),
    back in float64; step_of(max |x| of the group) gives the group's step."""
    m, k = x.shape
    xg = torch.nn.functional.pad(x.double(), (0, -k % group)).view(m, -1, group)
    step = step_of(xg.abs().amax(-1, keepdim=True))
    q = torch.where(step > 0, (xg / step).round().clamp(-127, 127), torch.zeros_like(xg))
    return (q * step).view(m, -1)[:, :k]


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q8_0 of x: groups of 32, step max / 127 stored as float16."""
    return grouped(x, 32, lambda top: (top / 127).half().double())


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q8_K of x: groups of 256, step max / 127 as float32 (its K-quants' decode)."""
    return grouped(x, 256, lambda top: (top / 127).float().double())


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def products(lin, fmt: str, x: torch.Tensor, k3, k4) -> dict[str, torch.Tensor]:
    """name -> y for x through lin on each path."""
    out = {}
    for name, k in (("latentkv int16 x", k3), ("latentkv int8 x", k4)):
        if fmt == "int8":
            out[name] = k.int8_mm(x, lin.q, lin.scale)
        else:
            out[name] = k.int4_mm(x, lin.packed, lin.scale_zeros, lin.group_size, lin.out_features)
    return out


def error_table(rows: list[int], trials: int, g: torch.Generator) -> dict:
    k3, k4 = native.with_isa(3), native.with_isa(4)
    result: dict = {}
    print(
        "| shape | format | rows | int16 x | int8 x | llama.cpp q8_0 x | llama.cpp q8_K x | bf16 x | weights' own |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape, what in SHAPES.items():
        n, k = map(int, shape.split("x"))
        for fmt in ("int8", "int4"):
            for m in rows:
                errs: dict[str, list[float]] = {}
                for _ in range(trials):
                    w = torch.randn(n, k, generator=g) * (1 + 3 * (torch.rand(n, 1, generator=g) > 0.99))
                    lin = make_linear(w, fmt)
                    w64 = lin.dequantize().double()[:, :k]
                    x = activations(m, k, g)
                    ref = x.double() @ w64.T
                    cells = {name: rel(y, ref) for name, y in products(lin, fmt, x, k3, k4).items()}
                    cells["q8_0 x"] = rel(q8_0(x) @ w64.T, ref)
                    cells["q8_K x"] = rel(q8_k(x) @ w64.T, ref)
                    cells["bf16 x"] = rel(x.to(torch.bfloat16).double() @ w64.T, ref)
                    cells["weights"] = rel(ref, x.double() @ w.double().T)
                    for name, e in cells.items():
                        errs.setdefault(name, []).append(e)
                med = {name: statistics.median(v) for name, v in errs.items()}
                result.setdefault(shape, {"what": what}).setdefault(fmt, {})[str(m)] = med
                print(f"| {shape} ({what}) | {fmt} | {m} | {med['latentkv int16 x']:.1e} | "
                      f"{med['latentkv int8 x']:.1e} | {med['q8_0 x']:.1e} | {med['q8_K x']:.1e} | "
                      f"{med['bf16 x']:.1e} | {med['weights']:.1e} |", flush=True)  # fmt: skip
    return result


def ppl(model: str, windows: int, isa: int, out: Path) -> dict:
    """`latentkv eval ppl MODEL --weight-dtype int8,int4` with the kernels on path `isa`."""
    from latentkv import cli

    chosen = native.with_isa(isa)
    native.kernels = lambda: chosen  # every format asks native.kernels() when it is built
    argv = ["eval", "ppl", model, "--weight-dtype", "int8,int4", "--kv-cache-dtype", "f32", "--context", "32",
            "--max-windows", str(windows), "--out", str(out)]  # fmt: skip
    print(f"\npath {isa} ({native.ACTIVATIONS[isa]} x): latentkv {' '.join(argv)}", flush=True)
    if cli.main(argv) != 0:
        raise SystemExit(f"eval ppl failed on path {isa}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl", default=None, metavar="MODEL", help="also measure perplexity on MODEL")
    p.add_argument("--windows", type=int, default=64, help="windows of 32 tokens for --ppl (default 64)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/x8-error.json"))
    args = p.parse_args()
    if native.with_isa(4) is None:
        print(f"no AVX-512 VNNI kernels here ({native.unavailable() or 'this CPU lacks VNNI/VBMI'})")
        return 1
    g = torch.Generator().manual_seed(args.seed)
    result = {
        "cpu": machine.cpu_model(),
        "torch": torch.__version__,
        "commit": machine.commit(),
        "seed": args.seed,
        "trials": args.trials,
        "errors": error_table([int(r) for r in args.rows.split(",")], args.trials, g),
    }
    if args.ppl:
        result["ppl"] = {}
        for isa in (3, 4):
            part = args.out.with_suffix(f".ppl-{isa}.json")
            result["ppl"][native.ACTIVATIONS[isa]] = ppl(args.ppl, args.windows, isa, part)
            part.unlink()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
