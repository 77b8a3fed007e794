"""latentkv vs llama.cpp on the same HF checkpoint, weight format by weight format.

    python benchmarks/vs_llamacpp.py MODEL [--threads 2] [--depths 0,4096] [-r 3] [--out FILE.json]

MODEL is a checkpoint directory or builtin:NAME. Pairs: llama.cpp f16 / latentkv bf16, q8_0 /
int8, q4_K_M / int4. For each: decode tok/s at each depth (llama-bench `-n GEN -d D`; latentkv
`bench decode --context max(D, 1)`), prefill tok/s of 512 tokens (llama-bench `-p 512`;
latentkv's prefill of a 512-token context), latentkv with every KV tier of --kv (llama.cpp's
own KV stays f16, its default), and latentkv's resident memory after load against the bytes
its weight format takes. One table with latentkv / llama.cpp ratios, a bar-by-bar note, JSON
under benchmarks/results/.

llama.cpp is never built here: the one build lives in ~/.cache/latentkv/llama.cpp, made by
`benchmarks/llamacpp.py --build`, whose module this script uses for the tools and the GGUF
conversion (without it, `llama-bench`, `llama-quantize` and `convert_hf_to_gguf.py` are looked
for under --llama-cpp DIR). GGUF files are converted once per format into --work and kept
between runs (written under a temporary name, renamed when complete). A depth the model cannot
hold (builtin:fixture has 1024 positions) is lowered to what it can, in both engines, and the
table says so. Run it on an idle machine: timings on a busy one say nothing.

    python benchmarks/vs_llamacpp.py --kernels OUT IN [THREADS]

prints the prefill kernels side by side instead (int4 and int8: torch's op vs the dequantized
tiles their Linear runs above its row threshold, beside bf16 and f32 matmuls), interleaved in
one process, at 1..512 rows: where the int4 threshold (weights/int4.py) comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_LLAMA = Path.home() / ".cache" / "latentkv" / "llama.cpp"
QUANTIZE_TYPE = {"q8_0": "Q8_0", "q4_K_M": "Q4_K_M"}
GGUF_FORMATS = ("f16", *QUANTIZE_TYPE)
MEMORY_BAR = 0.05  # resident weights within 5% of the format's bytes


# llama.cpp's converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know; ours
# split text with GLM-4's regex, so it is told so; and its GLM vocabulary step wants GLM's own
# special tokens ([gMASK], ...), which our small tokenizers lack: the generic BPE step serves.
# Used only without benchmarks/llamacpp.py. (argv: the converter's path, then its arguments)
CONVERT_AS_GLM4 = """
import runpy, sys
from pathlib import Path
converter = Path(sys.argv[1])
sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
sys.argv = sys.argv[1:]
runpy.run_path(str(converter), run_name="__main__")
"""


def find(root: Path, name: str) -> Path:
    """The first file called `name` under root (build/bin first)."""
    for candidate in [root / "build" / "bin" / name, *root.rglob(name)]:
        if candidate.is_file():
            return candidate
    sys.exit(f"error: no {name} under {root}; build llama.cpp once: python benchmarks/llamacpp.py --build")


def shared_module():
    """benchmarks/llamacpp.py (the one llama.cpp build's module) when this checkout has it."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import llamacpp
    except ImportError:
        return None
    return llamacpp


def tool(llama: Path, name: str) -> Path:
    shared = shared_module()
    return shared.binary(name) if shared is not None else find(llama, name)


def gguf(model: Path, fmt: str, work: Path, llama: Path) -> Path:
    """MODEL as a GGUF of format fmt, converted (f16) and quantized once, cached in work."""
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / f"{model.name}-f16.gguf"
    if not f16.exists():
        part = f16.with_suffix(".part")
        shared = shared_module()
        if shared is not None:
            shared.convert_to_gguf(model, part, "f16")  # splits fused experts, patches the tokenizer steps
        else:
            converter = find(llama, "convert_hf_to_gguf.py")
            source = str(per_expert(model, work))
            cmd = [sys.executable, "-c", CONVERT_AS_GLM4, str(converter), source]
            run([*cmd, "--outtype", "f16", "--outfile", str(part)])
        part.rename(f16)
    if fmt == "f16":
        return f16
    out = work / f"{model.name}-{fmt}.gguf"
    if not out.exists():
        part = out.with_suffix(".part")
        run([str(tool(llama, "llama-quantize")), str(f16), str(part), QUANTIZE_TYPE[fmt]])
        part.rename(out)
    return out


def with_tokenizer(model: Path, donor: Path | None, work: Path) -> Path:
    """MODEL itself if it has a tokenizer; else a directory of links to its files plus the donor's
    tokenizer files (the random benchmark checkpoints ship none; llama.cpp's converter needs one)."""
    if (model / "tokenizer.json").is_file():
        return model
    if donor is None:
        sys.exit(
            f"error: {model} has no tokenizer.json; pass --tokenizer-from DIR (e.g. src/latentkv/builtin/fixture)"
        )
    view = work / f"{model.name}-with-tokenizer"
    view.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (donor / name).is_file() and not (view / name).exists():
            (view / name).write_bytes((donor / name).read_bytes())
    return view


def per_expert(model: Path, work: Path) -> Path:
    """MODEL itself if its experts are stored one by one; else a copy with them split (llama.cpp's
    converter rejects transformers' fused `experts.gate_up_proj`): `latentkv convert` to f32."""
    from latentkv.models.loader import Checkpoint

    if not any(n.endswith("experts.gate_up_proj") for n in Checkpoint(model).keys()):  # noqa: SIM118
        return model
    split = work / f"{model.name}-per-expert"
    if not (split / "config.json").exists():
        run([sys.executable, "-m", "latentkv", "convert", str(model), str(split), "--weight-dtype", "f32"])
    return split


def run(cmd: list[str]) -> str:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {Path(cmd[0]).name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def llama_bench(llama: Path, model_gguf: Path, args: argparse.Namespace) -> dict:
    """{"pp512": tok/s, "tg@D": tok/s} from one llama-bench run (JSON output)."""
    cmd = [str(tool(llama, "llama-bench")), "-m", str(model_gguf), "-t", str(args.threads)]
    cmd += ["-p", str(args.prefill), "-n", str(args.gen), "-d", ",".join(map(str, args.depths))]
    cmd += ["-r", str(args.repetitions), "-o", "json"]
    out = {}
    for r in json.loads(run(cmd)):
        depth = r.get("n_depth", 0)
        if r["n_prompt"] and not r["n_gen"] and depth == 0:
            out[f"pp{r['n_prompt']}"] = r["avg_ts"]
        elif r["n_gen"] and not r["n_prompt"]:
            out[f"tg@{depth}"] = r["avg_ts"]
    return out


def latentkv_bench(model: Path, dtype: str, args: argparse.Namespace) -> dict:
    """{kv tier: {"pp512": tok/s, "tg@D": tok/s}} from one `latentkv bench decode` process."""
    contexts = sorted({max(d, 1) for d in args.depths} | {args.prefill})
    cmd = [sys.executable, "-m", "latentkv", "bench", "decode", str(model), "--weight-dtype", dtype]
    cmd += ["--threads", str(args.threads), "--kv-cache-dtype", ",".join(args.kv)]
    cmd += ["--context", ",".join(map(str, contexts)), "--decode-tokens", str(args.gen)]
    cmd += ["--repeats", str(args.repetitions), "--json"]
    out: dict[str, dict] = {}
    for r in json.loads(run(cmd))["rows"]:
        if r["engine"] != "latentkv" or r.get("speculative"):
            continue
        tier = out.setdefault(r["kv_cache_dtype"], {})
        if r["context"] == args.prefill:
            tier[f"pp{args.prefill}"] = r["prefill_tps"]
        for d in args.depths:
            if r["context"] == max(d, 1):
                tier[f"tg@{d}"] = r["decode_tps"]
    return out


def rss_kib() -> dict[str, int]:
    """This process's resident memory from /proc (Linux): anonymous and file-backed KiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS"):
            fields[key] = int(value.split()[0])
    return fields


def measure_memory(model_dir: str, dtype: str) -> dict:
    """Load the weights of model_dir in dtype (in this process, meant to be a fresh child; no
    tokenizer) and compare the anonymous memory the load added with the bytes the weight format
    takes. The checkpoint's pages read through mmap are file-backed (the kernel can drop them):
    reported, not counted."""
    import ctypes
    import gc

    import torch

    from latentkv.models.weights import load_model

    torch.zeros(1) @ torch.zeros(1)  # torch's own start-up allocations before the baseline
    before = rss_kib()
    model = load_model(Path(model_dir), dtype)
    gc.collect()
    after = rss_kib()
    try:  # glibc keeps freed load temporaries in its arenas; ask it to return them
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = rss_kib()["RssAnon"]
    except (OSError, AttributeError):
        trimmed = after["RssAnon"]
    weights = model.weight_bytes()
    return {
        "weights": dtype,
        "parameters": model.num_parameters(),
        "format_bytes": weights,
        "anon_bytes_after_load": (after["RssAnon"] - before["RssAnon"]) * 1024,
        "anon_bytes_after_trim": (trimmed - before["RssAnon"]) * 1024,
        "file_bytes_after_load": after["RssFile"] * 1024,
        "rss_bytes_after_load": after["VmRSS"] * 1024,
    }


def latentkv_memory(model: Path, dtype: str) -> dict:
    """measure_memory in a fresh process (this script's --measure-memory)."""
    return json.loads(run([sys.executable, __file__, "--measure-memory", str(model), dtype]))


def kernel_table(out_f: int, in_f: int, rows: list[int], repeats: int = 7) -> str:
    """int4 and int8 prefill kernels at M rows, interleaved in this process: the op, the tile path
    (what the Linear runs above its threshold), and plain bf16 / f32 F.linear on the float matrix;
    the fastest of `repeats` wall times, and thread CPU time (steadier on a busy machine)."""
    import torch
    import torch.nn.functional as F

    from latentkv.weights import make_linear

    w = torch.randn(out_f, in_f)
    i4, i8, wb = make_linear(w, "int4"), make_linear(w, "int8"), w.to(torch.bfloat16)

    def i4_op(x):
        return i4._op(x.to(torch.bfloat16).contiguous(), i4.packed, i4.scale_zeros)

    def i8_op(x):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), i8.q, i8.scale)

    paths = {
        "int4 op": i4_op,
        "int4 tiles": lambda x: i4._tiled(x.to(torch.bfloat16).contiguous()),
        "int8 op": i8_op,
        "int8 tiles": i8._tiled,
        "bf16 F.linear": lambda x: F.linear(x.to(torch.bfloat16), wb),
        "f32 F.linear": lambda x: F.linear(x, w),
    }
    lines = [f"{out_f}x{in_f}, {torch.get_num_threads()} threads: ms wall / ms CPU (fastest of {repeats})"]
    lines += ["| rows | " + " | ".join(paths) + " |", "|---:|" + "---:|" * len(paths)]
    for m in rows:
        x = torch.randn(m, in_f)
        wall = {name: [] for name in paths}
        cpu = {name: [] for name in paths}
        for _ in range(repeats):
            for name, f in paths.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                f(x)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
        cells = [f"{1e3 * min(wall[n]):.1f} / {1e3 * min(cpu[n]):.1f}" for n in paths]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def _fmt(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def speed_table(results: list[dict], kv: list[str]) -> str:
    head = "| llama.cpp | latentkv | metric | llama.cpp tok/s (KV f16) |"
    head += "".join(f" latentkv KV {t} | ratio |" for t in kv)
    lines = [head, "|---|---|---|---:|" + "---:|---:|" * len(kv)]
    for r in results:
        for metric, theirs in r["llama.cpp"].items():
            cells = ""
            for t in kv:
                ours = r["latentkv"].get(t, {}).get(metric)
                cells += f" {_fmt(ours)} | {_fmt(_ratio(ours, theirs), 'x')} |"
            lines.append(f"| {r['gguf']} | {r['weights']} | {metric} | {theirs:.2f} |{cells}")
    return "\n".join(lines)


def bars(results: list[dict], kv: list[str]) -> list[str]:
    """One line per bar (pair x metric): met or missed by how much, at latentkv's best KV tier."""
    lines = []
    for r in results:
        for metric, theirs in r["llama.cpp"].items():
            ratios = {t: _ratio(r["latentkv"].get(t, {}).get(metric), theirs) for t in kv}
            ratios = {t: x for t, x in ratios.items() if x is not None}
            what = f"{r['weights']} vs {r['gguf']} {metric}"
            if not ratios:
                lines.append(f"{what}: no latentkv number")
                continue
            best = max(ratios, key=ratios.get)
            x = ratios[best]
            verdict = "met" if x >= 1 else f"missed by {100 * (1 - x):.0f}%"
            lines.append(
                f"{what}: {verdict} ({x:.2f}x at KV {best}; "
                + ", ".join(f"{t} {v:.2f}x" for t, v in ratios.items())
                + ")"
            )
    return lines


def memory_table(memory: list[dict]) -> str:
    lines = [
        "| latentkv | parameters | format bytes | anon RSS added by load | ratio | after malloc_trim "
        "| ratio | within 5% |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in memory:
        fmt = m["format_bytes"]
        load_x, trim_x = m["anon_bytes_after_load"] / fmt, m["anon_bytes_after_trim"] / fmt
        ok = (
            "yes"
            if abs(load_x - 1) <= MEMORY_BAR
            else ("after trim" if abs(trim_x - 1) <= MEMORY_BAR else "no")
        )
        lines.append(
            f"| {m['weights']} | {m['parameters'] / 1e6:.1f}M | {fmt / 2**20:.1f} MiB | "
            f"{m['anon_bytes_after_load'] / 2**20:.1f} MiB | {load_x:.3f} | "
            f"{m['anon_bytes_after_trim'] / 2**20:.1f} MiB | {trim_x:.3f} | {ok} |"
        )
    return "\n".join(lines)


def fit_depths(model: Path, depths: list[int], gen: int) -> tuple[list[int], list[str]]:
    """Depths the model can hold with gen more tokens (both engines run the lowered depth)."""
    limit = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    if not limit:
        return depths, []
    fitted = [min(d, limit - gen - 1) for d in depths]
    notes = [
        f"depth {d} lowered to {f}: the model holds {limit} positions"
        for d, f in zip(depths, fitted, strict=True)
        if d != f
    ]
    return list(dict.fromkeys(fitted)), notes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF checkpoint directory (config.json + safetensors), or builtin:NAME")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--depths", default="0,4096", help="decode depths (default: 0,4096)")
    p.add_argument("--pairs", default="f16:bf16,q8_0:int8,q4_K_M:int4", help="gguf:latentkv format pairs")
    p.add_argument("--kv", default="f32,bf16,fp8", help="latentkv KV tiers (default: f32,bf16,fp8)")
    p.add_argument(
        "-r", "--repetitions", type=int, default=3, help="runs per number, both engines (default: 3)"
    )
    p.add_argument("--gen", type=int, default=64, help="decode tokens per run (default: 64)")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (default: 512)")
    p.add_argument(
        "--llama-cpp", type=Path, default=DEFAULT_LLAMA, help=f"llama.cpp tree (default: {DEFAULT_LLAMA})"
    )
    p.add_argument(
        "--work", type=Path, default=DEFAULT_LLAMA.parent / "gguf", help="where GGUF files are kept"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON (default: benchmarks/results/vs-llamacpp-NAME.json)"
    )
    p.add_argument(
        "--tokenizer-from", type=Path, default=None, help="tokenizer donor for a checkpoint without one"
    )
    p.add_argument("--convert-only", action="store_true", help="make the GGUF files, run nothing")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> str | None:
    """Parse the list options in place; an error line, or None."""
    try:
        args.depths = [int(d) for d in args.depths.split(",")]
        args.pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
        args.kv = [t for t in args.kv.split(",") if t]
    except ValueError:
        return f"bad --depths {args.depths!r}"
    if not all(len(pair) == 2 and pair[0] in GGUF_FORMATS for pair in args.pairs):
        return f"bad --pairs: each is GGUF:LATENTKV with GGUF one of {', '.join(GGUF_FORMATS)}"
    if min(args.depths) < 0 or args.repetitions < 1 or args.gen < 2 or args.prefill < 1 or not args.kv:
        return "--depths must be >= 0, -r >= 1, --gen >= 2, --prefill >= 1, --kv not empty"
    return None


def resolve(model: str) -> Path:
    from latentkv.models.registry import ModelNotFound
    from latentkv.models.registry import resolve as resolve_model

    try:
        return resolve_model(model).resolve()
    except ModelNotFound as exc:
        sys.exit(f"error: {exc}")


def kernels_main(argv: list[str]) -> int:
    """--kernels OUT IN [THREADS]: the prefill kernel table."""
    import torch

    try:
        out_f, in_f, threads = (int(v) for v in [*argv[:2], *(argv[2:3] or ["2"])])
        assert len(argv) in (2, 3) and min(out_f, in_f, threads) > 0 and out_f % 16 == in_f % 64 == 0
    except (ValueError, AssertionError):
        print("error: --kernels OUT IN [THREADS]: OUT a multiple of 16, IN of 64", file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    print(kernel_table(out_f, in_f, [1, 16, 32, 48, 64, 96, 128, 512]))
    return 0


def run_pairs(model: Path, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Both engines, pair by pair: (speed results, latentkv memory rows)."""
    results, memory = [], []
    for fmt, dtype in args.pairs:
        t0 = time.time()
        theirs = llama_bench(args.llama_cpp, gguf(model, fmt, args.work, args.llama_cpp), args)
        ours = latentkv_bench(model, dtype, args)
        memory.append(latentkv_memory(model, dtype))
        seconds = time.time() - t0
        results.append(
            {"gguf": fmt, "weights": dtype, "llama.cpp": theirs, "latentkv": ours, "seconds": seconds}
        )
    return results, memory


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure-memory"]:
        print(json.dumps(measure_memory(argv[1], argv[2])))
        return 0
    if argv[:1] == ["--kernels"]:
        return kernels_main(argv[1:])
    args = parse_args(argv)
    if (error := check_args(args)) is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = with_tokenizer(resolve(args.model), args.tokenizer_from, args.work)
    for fmt, _ in args.pairs:
        gguf(model, fmt, args.work, args.llama_cpp)
    if args.convert_only:
        return 0
    requested = args.depths
    args.depths, notes = fit_depths(model, args.depths, args.gen)
    results, memory = run_pairs(model, args)
    verdicts = bars(results, args.kv)
    print(speed_table(results, args.kv) + "\n\n" + memory_table(memory) + "\n")
    print("\n".join(notes + verdicts))
    name = args.model.removeprefix("builtin:").rstrip("/").split("/")[-1]
    out = args.out or Path(__file__).parent / "results" / f"vs-llamacpp-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"threads": args.threads, "depths": args.depths, "depths_requested": requested}
    settings |= {"repetitions": args.repetitions, "gen": args.gen, "prefill": args.prefill}
    settings |= {"kv": {"llama.cpp": "f16", "latentkv": args.kv}, "cpu_count": os.cpu_count()}
    payload = {"model": str(model), **settings, "notes": notes, "bars": verdicts}
    out.write_text(json.dumps({**payload, "results": results, "memory": memory}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
