"""latentkv vs llama.cpp on the same HF checkpoint, weight format by weight format, each engine at
its best.

    python benchmarks/vs_llamacpp.py MODEL [--threads 2] [--depths 0,4096] [-r 3] [--out FILE.json]

MODEL is a checkpoint directory or builtin:NAME. Pairs (--pairs): llama.cpp bf16 / latentkv bf16
(the same format), f16 / bf16 as an extra row, q8_0 / int8, q4_K_M / int4. For each: decode tok/s
at each depth (llama-bench `-n GEN -d D`; latentkv `bench decode --context max(D, 1)`), prefill
tok/s of 512 tokens (llama-bench `-p 512`; latentkv's prefill of a 512-token context), latentkv
with every KV tier of --kv (llama.cpp's own KV stays f16, its default), and latentkv's resident
memory after load against the bytes its weight format takes.

The same statistic for both engines: -r rounds (default 3), each running every llama.cpp format
once (`llama-bench -r 1 -fa 1`, flash attention on: its fastest CPU path) and every latentkv format
once (a fresh `latentkv bench decode --repeats 1`), interleaved, the engine that goes first
alternating by round, so a change in the machine's load falls on both; every number is the median
of the rounds' samples with their min-max (llama.cpp's own `samples_ts`, latentkv's tok/s per
run). With --bytes, a child process also counts the bytes a decode step of each latentkv format
reads (every weight matrix it multiplies by, each time it does, plus the KV cache's bytes) and
measures the machine's read bandwidth (a float32 torch sum over 1 GiB, the same threads), so each
decode row gets its share of that bandwidth (of the fastest child's median, one reference for all
formats). The JSON holds every sample, the CPU model and flags, the
threads, llama.cpp's build and latentkv's commit. One table with latentkv / llama.cpp ratios of
the medians, a bar-by-bar note (issue 28's goals: int4 >= 1.3x q4_K_M, int8 >= 1.2x q8_0, bf16 >=
1.0x at every decode depth; prefill >= 1.0x), JSON under benchmarks/results/.

llama.cpp is never built here: the one build lives in ~/.cache/latentkv/llama.cpp, made by
`benchmarks/llamacpp.py --build`, whose module this script uses for the tools and the GGUF
conversion (without it, `llama-bench`, `llama-quantize` and `convert_hf_to_gguf.py` are looked
for under --llama-cpp DIR). GGUF files are converted once per format into --work and kept
between runs (written under a temporary name, renamed when complete). A depth the model cannot
hold (builtin:fixture has 1024 positions) is lowered to what it can, in both engines, and the
table says so. Run it on an idle machine: timings on a busy one say nothing.

    python benchmarks/vs_llamacpp.py --kernels OUT IN [THREADS]

prints the prefill kernels side by side instead (int4 and int8: torch's op, latentkv's decode
kernel and the dequantized tiles their Linear runs above its row threshold, beside bf16 and f32
matmuls), interleaved in one process, at 1..512 rows: where the row thresholds (weights/int4.py,
int8.py) come from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

DEFAULT_LLAMA = Path.home() / ".cache" / "latentkv" / "llama.cpp"
QUANTIZE_TYPE = {"q8_0": "Q8_0", "q4_K_M": "Q4_K_M"}
FLOAT_GGUF = ("bf16", "f16")  # converted straight from the checkpoint
GGUF_FORMATS = (*FLOAT_GGUF, *QUANTIZE_TYPE)
DEFAULT_PAIRS = "bf16:bf16,f16:bf16,q8_0:int8,q4_K_M:int4"
MEMORY_BAR = 0.05  # resident weights within 5% of the format's bytes
# issue 28's goals: latentkv / llama.cpp decode at every depth, per latentkv format; prefill >= 1
DECODE_BARS = {"int4": 1.3, "int8": 1.2, "bf16": 1.0}


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
    """MODEL as a GGUF of format fmt, converted (bf16, f16) or quantized from the f16 one once,
    cached in work."""
    work.mkdir(parents=True, exist_ok=True)
    base = fmt if fmt in FLOAT_GGUF else "f16"
    f16 = work / f"{model.name}-{base}.gguf"
    if not f16.exists():
        part = f16.with_suffix(".part")
        shared = shared_module()
        if shared is not None:
            shared.convert_to_gguf(model, part, base)  # splits fused experts, patches the tokenizer steps
        else:
            converter = find(llama, "convert_hf_to_gguf.py")
            source = str(per_expert(model, work))
            cmd = [sys.executable, "-c", CONVERT_AS_GLM4, str(converter), source]
            run([*cmd, "--outtype", base, "--outfile", str(part)])
        part.rename(f16)
    if fmt in FLOAT_GGUF:
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


def llama_bench(llama: Path, model_gguf: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """One llama-bench run (-r 1, flash attention on): its samples and what it says about itself
    (parse_llama_bench)."""
    cmd = [str(tool(llama, "llama-bench")), "-m", str(model_gguf), "-t", str(args.threads), "-fa", "1"]
    cmd += ["-p", str(args.prefill), "-n", str(args.gen), "-d", ",".join(map(str, args.depths))]  # -p 0: none
    cmd += ["-r", "1", "-o", "json"]
    return parse_llama_bench(json.loads(run(cmd)))


def parse_llama_bench(rows: list[dict]) -> tuple[dict, dict]:
    """llama-bench's JSON rows -> ({"pp512": [tok/s], "tg@D": [tok/s]} from its own
    per-repetition samples (`samples_ts`; `avg_ts` where a build has none), what it says about
    its build and the CPU). Prefill counts at depth 0 only (llama-bench also runs it at every -d)."""
    out: dict[str, list[float]] = {}
    about = {}
    for r in rows:
        depth = r.get("n_depth", 0)
        samples = [float(v) for v in r.get("samples_ts") or [r["avg_ts"]]]
        if r["n_prompt"] and not r["n_gen"] and depth == 0:
            out.setdefault(f"pp{r['n_prompt']}", []).extend(samples)
        elif r["n_gen"] and not r["n_prompt"]:
            out.setdefault(f"tg@{depth}", []).extend(samples)
        about = {
            k: r[k] for k in ("build_commit", "build_number", "cpu_info", "type_k", "flash_attn") if k in r
        }
    return out, about


def latentkv_bench(model: Path, dtype: str, args: argparse.Namespace) -> dict:
    """One fresh `latentkv bench decode --repeats 1`: its samples (parse_latentkv_bench)."""
    contexts = sorted({max(d, 1) for d in args.depths} | ({args.prefill} if args.prefill else set()))
    cmd = [sys.executable, "-m", "latentkv", "bench", "decode", str(model), "--weight-dtype", dtype]
    cmd += ["--threads", str(args.threads), "--kv-cache-dtype", ",".join(args.kv)]
    cmd += ["--context", ",".join(map(str, contexts)), "--decode-tokens", str(args.gen)]
    cmd += ["--repeats", "1", "--json"] + (["--compile"] if args.compile else [])
    return parse_latentkv_bench(json.loads(run(cmd))["rows"], args.depths, args.prefill, args.compile)


def parse_latentkv_bench(rows: list[dict], depths: list[int], prefill: int, compiled: bool) -> dict:
    """`bench decode --json` rows -> {kv tier: {"pp512": [tok/s], "tg@D": [tok/s]}}, one sample
    per number: depth D is the row of context max(D, 1), prefill the row of context `prefill`;
    rows of the other engine (eager or compiled) and speculative rows are not ours."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r["engine"] != ("latentkv+compile" if compiled else "latentkv") or r.get("speculative"):
            continue
        tier = out.setdefault(r["kv_cache_dtype"], {})
        if prefill and r["context"] == prefill:
            tier.setdefault(f"pp{prefill}", []).append(r["prefill_tps"])
        for d in depths:
            if r["context"] == max(d, 1):
                tier.setdefault(f"tg@{d}", []).append(r["decode_tps"])
    return out


def stat(samples: list[float]) -> dict:
    """The statistic both engines are reported with: median of the samples, with min and max."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
    }


def merge(into: dict, new: dict) -> None:
    """Append the sample lists of `new` to those of `into` (nested dicts of lists)."""
    for key, value in new.items():
        if isinstance(value, dict):
            merge(into.setdefault(key, {}), value)
        else:
            into.setdefault(key, []).extend(value)


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
    model = load_model(Path(model_dir), dtype, device="cpu")
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


def measure_bytes(
    model_dir: str, dtype: str, depths: list[int], tier: str, threads: int, mib: int = 1024
) -> dict:
    """Count the bytes one decode step reads at each depth (in this process, meant to be a fresh
    child): every weight matrix's bytes each time the step multiplies by it (each `Linear`,
    per-head product and expert called, counted once per call however the format computes it
    inside; a layer's routed experts in one call count each expert it ran once), plus
    the KV cache's bytes (latent rows and indexer keys: all of them, an upper bound where DSA
    attends to a selection). The cache is filled with random rows (the bytes do not depend on
    them). Also the read bandwidth: a float32 torch sum over `mib` MiB with the same threads."""
    import torch

    from latentkv.eval.bench.workload import fill_random, measured_index_bytes, predicted_kv_bytes
    from latentkv.experts.base import Expert
    from latentkv.models.weights import load_model
    from latentkv.weights.base import FORMATS
    from latentkv.weights.heads import HeadLinears

    try:  # absent from checkouts before the one-call experts (this script measures those too)
        from latentkv.weights.swiglu import PackedExperts
    except ImportError:
        PackedExperts = None

    torch.set_num_threads(threads)
    model = load_model(Path(model_dir), dtype, device="cpu")
    count, inside = [0], [0]

    def counting(fn):
        def call(self, *args, **kwargs):
            if not inside[0]:  # the outermost call: a format's add_to may call its own __call__
                count[0] += self.nbytes
            inside[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                inside[0] -= 1

        return call

    for cls in {*FORMATS.values(), HeadLinears, Expert}:
        for name in ("__call__", "add_to"):
            if name in vars(cls):
                setattr(cls, name, counting(vars(cls)[name]))
    if PackedExperts is not None:
        packed_call = PackedExperts.__call__

        def packed_counting(self, x, idx, weights, by_id):
            count[0] += int(idx.unique().numel()) * self.expert_bytes
            return packed_call(self, x, idx, weights, by_id)

        PackedExperts.__call__ = packed_counting
    out = {"weights": dtype, "kv_tier": tier, "weight_bytes": {}, "kv_bytes": {}}
    with torch.inference_mode():
        for depth in depths:
            cache = model.make_cache(model.tier(tier))
            fill_random(cache, max(depth, 1))
            model.forward(torch.tensor([5]), cache)  # warm-up step
            count[0] = 0
            model.forward(torch.tensor([6]), cache)
            out["weight_bytes"][str(depth)] = count[0]
            out["kv_bytes"][str(depth)] = predicted_kv_bytes(cache) + measured_index_bytes(cache)
    buf = torch.rand(mib * 2**18)
    buf.sum()
    rates = []
    for _ in range(7):
        t0 = time.perf_counter()
        buf.sum()
        rates.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    out["read_gb_s"] = rates
    return out


def latentkv_bytes(model: Path, dtype: str, args: argparse.Namespace) -> dict:
    """measure_bytes in a fresh process (this script's --measure-bytes)."""
    depths = ",".join(map(str, args.depths))
    cmd = [
        sys.executable,
        __file__,
        "--measure-bytes",
        str(model),
        dtype,
        depths,
        args.kv[0],
        str(args.threads),
    ]
    return json.loads(run(cmd))


def kernel_table(out_f: int, in_f: int, rows: list[int], repeats: int = 7) -> str:
    """int4 and int8 prefill kernels at M rows, interleaved in this process: the op, the tile path
    (what the Linear runs above its threshold), and plain bf16 / f32 F.linear on the float matrix;
    the fastest of `repeats` wall times, and thread CPU time (steadier on a busy machine)."""
    import torch
    import torch.nn.functional as F

    from latentkv import native
    from latentkv.weights import int4, make_linear

    w = torch.randn(out_f, in_f)
    i4, i8, wb = make_linear(w, "int4"), make_linear(w, "int8"), w.to(torch.bfloat16)
    op_packed = int4.pack_for_op(i4.nibbles()[0])  # the op's own layout (out % 16 == 0 here)
    op_sz = i4.scale_zeros[:, :out_f].contiguous()

    def i4_op(x):
        return i4._op(x.to(torch.bfloat16).contiguous(), op_packed, op_sz)

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
    own = native.kernels()
    if own is not None:  # latentkv's decode kernels, at every row count
        paths["int4 latentkv"] = lambda x: own.int4_mm(x, i4.packed, i4.scale_zeros, i4.group_size, out_f)
        paths["int8 latentkv"] = lambda x: own.int8_mm(x, i8.q, i8.scale)
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


def _metric_order(item: tuple[str, dict]) -> tuple[int, int]:
    """pp512 first, then tg@D by depth."""
    kind, _, rest = item[0].partition("@")
    return (0, int(kind[2:] or 0)) if kind.startswith("pp") else (1, int(rest or 0))


def _median(cell: dict | None) -> float | None:
    return None if not cell else cell["median"]


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def _fmt(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def _spread(cell: dict | None) -> str:
    """median (min-max) of one number's samples."""
    if not cell:
        return "-"
    return f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def speed_table(results: list[dict], kv: list[str]) -> str:
    head = "| llama.cpp | latentkv | metric | llama.cpp tok/s (KV f16) |"
    head += "".join(f" latentkv KV {t} | ratio |" for t in kv)
    lines = [head, "|---|---|---|---:|" + "---:|---:|" * len(kv)]
    for r in results:
        for metric, theirs in sorted(r["llama.cpp"].items(), key=_metric_order):
            cells = ""
            for t in kv:
                ours = r["latentkv"].get(t, {}).get(metric)
                cells += f" {_spread(ours)} | {_fmt(_ratio(_median(ours), _median(theirs)), 'x')} |"
            lines.append(f"| {r['gguf']} | {r['weights']} | {metric} | {_spread(theirs)} |{cells}")
    return "\n".join(lines)


def bandwidth_table(results: list[dict], traffic: dict[str, dict], kv: str) -> str:
    """Per latentkv format and decode depth: the bytes a step reads, the rate that makes at the
    median decode speed, and its share of the measured read bandwidth: one reference for every
    format, the fastest of the children's medians (the sum's rate differs by up to 25% between
    fresh processes on a VM, and the fastest is the stricter bar)."""
    lines = [
        "| latentkv | metric | weight bytes / token | KV bytes / token | tok/s | GB/s | of read bandwidth |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    seen = set()
    read = max((statistics.median(t["read_gb_s"]) for t in traffic.values()), default=0.0)
    for r in results:
        dtype, t = r["weights"], traffic.get(r["weights"])
        if t is None or dtype in seen:
            continue
        seen.add(dtype)
        for depth, wbytes in sorted(t["weight_bytes"].items(), key=lambda kv: int(kv[0])):
            tps = _median(r["latentkv"].get(kv, {}).get(f"tg@{depth}"))
            if tps is None:
                continue
            total = wbytes + t["kv_bytes"][depth]
            gbs = total * tps / 1e9
            lines.append(
                f"| {dtype} | tg@{depth} | {wbytes / 1e9:.3f} GB | {t['kv_bytes'][depth] / 1e6:.1f} MB | "
                f"{tps:.2f} | {gbs:.1f} | {100 * gbs / read:.0f}% of {read:.1f} GB/s |"
            )
    return "\n".join(lines)


def bars(results: list[dict], kv: list[str], goals: dict[str, float] | None = None) -> list[str]:
    """One line per bar (pair x metric): met or missed by how much, at the first KV tier of --kv
    (the others' ratios follow). Decode bars: `goals` per latentkv format (default DECODE_BARS,
    issue 28's for the slice); prefill: 1.0x."""
    goals = DECODE_BARS if goals is None else goals
    lines = []
    for r in results:
        for metric, theirs in sorted(r["llama.cpp"].items(), key=_metric_order):
            ratios = {t: _ratio(_median(r["latentkv"].get(t, {}).get(metric)), _median(theirs)) for t in kv}
            ratios = {t: x for t, x in ratios.items() if x is not None}
            what = f"{r['weights']} vs {r['gguf']} {metric}"
            if kv[0] not in ratios:
                lines.append(f"{what}: no latentkv number at KV {kv[0]}")
                continue
            goal = goals.get(r["weights"], 1.0) if metric.startswith("tg") else 1.0
            x = ratios[kv[0]]
            verdict = "met" if x >= goal else f"missed by {100 * (1 - x / goal):.0f}%"
            lines.append(
                f"{what}: {verdict} ({x:.2f}x at KV {kv[0]}, goal {goal:.1f}x; "
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
    p.add_argument(
        "--pairs", default=DEFAULT_PAIRS, help=f"gguf:latentkv format pairs (default: {DEFAULT_PAIRS})"
    )
    p.add_argument(
        "--kv", default="bf16", help="latentkv KV tiers; the bars are judged at the first (default: bf16)"
    )
    p.add_argument(
        "-r",
        "--repetitions",
        type=int,
        default=3,
        help="interleaved rounds, one sample per number each (default: 3)",
    )
    p.add_argument(
        "--bytes",
        action="store_true",
        help="count the bytes a decode step reads and measure the read bandwidth",
    )
    p.add_argument(
        "--compile", action="store_true", help="latentkv decodes through its compiled step (small models)"
    )
    p.add_argument(
        "--goals",
        default=",".join(f"{k}={v}" for k, v in DECODE_BARS.items()),
        help="decode goals, latentkv / llama.cpp per latentkv format (default: issue 28's for the slice)",
    )
    p.add_argument("--gen", type=int, default=64, help="decode tokens per run (default: 64)")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (default: 512; 0: no prefill)")
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run's samples to --out's (same model, machine and settings; other depths or "
        "pairs join the table): a long table in several short runs",
    )
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
    if min(args.depths) < 0 or args.repetitions < 1 or args.gen < 2 or args.prefill < 0 or not args.kv:
        return "--depths must be >= 0, -r >= 1, --gen >= 2, --prefill >= 0, --kv not empty"
    if len(set(args.pairs)) != len(args.pairs):
        return "--pairs names a pair twice"
    try:
        args.goals = {k: float(v) for k, v in (g.split("=") for g in args.goals.split(",") if g)}
    except ValueError:
        return f"bad --goals {args.goals!r}: FORMAT=RATIO,..."
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
    print(kernel_table(out_f, in_f, [1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 512]))
    return 0


def run_pairs(
    model: Path, args: argparse.Namespace, skip_memory: set[str] = frozenset()
) -> tuple[list[dict], list[dict], dict]:
    """Both engines, round by round (every format once per round, interleaved, the first engine
    alternating): (speed results per pair, latentkv memory rows, what llama-bench said about itself)."""
    ggufs = list(dict.fromkeys(fmt for fmt, _ in args.pairs))
    ours = list(dict.fromkeys(dtype for _, dtype in args.pairs))
    files = {fmt: gguf(model, fmt, args.work, args.llama_cpp) for fmt in ggufs}
    theirs: dict[str, dict] = {fmt: {} for fmt in ggufs}
    mine: dict[str, dict] = {dtype: {} for dtype in ours}
    about: dict = {}
    for round_ in range(args.repetitions):
        steps = [("llama.cpp", fmt) for fmt in ggufs] + [("latentkv", dtype) for dtype in ours]
        # interleave the two engines, starting with the other one each round
        a, b = steps[: len(ggufs)], steps[len(ggufs) :]
        if round_ % 2:
            a, b = b, a
        order = [s for pair in zip(a, b, strict=False) for s in pair] + a[len(b) :] + b[len(a) :]
        for engine, fmt in order:
            t0 = time.time()
            if engine == "llama.cpp":
                samples, about = llama_bench(args.llama_cpp, files[fmt], args)
                merge(theirs[fmt], samples)
            else:
                merge(mine[fmt], latentkv_bench(model, fmt, args))
            print(
                f"round {round_ + 1}: {engine} {fmt} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True
            )
    results = []
    for fmt, dtype in args.pairs:
        results.append(
            {
                "gguf": fmt,
                "weights": dtype,
                "llama.cpp": {m: stat(v) for m, v in theirs[fmt].items()},
                "latentkv": {t: {m: stat(v) for m, v in ms.items()} for t, ms in mine[dtype].items()},
            }
        )
    memory = [latentkv_memory(model, dtype) for dtype in ours if dtype not in skip_memory]
    return results, memory, about


def run_context(llama_about: dict) -> dict:
    """The CPU model and flags, the threads and both engines' versions, for the JSON."""
    import torch

    shared = shared_module()
    from latentkv.weights import describe

    return {
        "cpu": machine.cpu_model(),
        "cpu_flags": machine.cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "latentkv_commit": machine.commit(("src",)),
        "latentkv_kernels": {fmt: describe(fmt) for fmt in ("bf16", "int8", "int4")},
        "llama.cpp": {"version": shared.version() if shared else "unknown", **llama_about},
    }


# settings that must agree for two runs' samples to share a table
SAME = ("model", "threads", "gen", "kv", "flash_attn", "compile")


def combine(old: dict, new: dict) -> dict | str:
    """`new` (this run's payload) with `old`'s samples added (--append): pairs matched by (gguf,
    weights), samples concatenated per engine, tier and metric, every statistic recomputed;
    memory and byte counts kept from the first run that measured them. An error line if the
    runs cannot share a table (another model, machine or setting)."""
    for key in SAME:
        if old.get(key) != new.get(key):
            return f"--append: {key} differs from the file's ({old.get(key)!r} vs {new.get(key)!r})"
    for key in ("cpu", "llama.cpp", "torch"):
        if old["machine"].get(key) != new["machine"].get(key):
            return f"--append: the machine's {key} differs from the file's"
    out = dict(new)
    results = {(r["gguf"], r["weights"]): r for r in old["results"]}
    for r in new["results"]:
        into = results.setdefault((r["gguf"], r["weights"]), {**r, "llama.cpp": {}, "latentkv": {}})
        if into is r:
            continue
        for metric, cell in r["llama.cpp"].items():
            into["llama.cpp"][metric] = stat(
                into["llama.cpp"].get(metric, {}).get("samples", []) + cell["samples"]
            )
        for tier, metrics in r["latentkv"].items():
            mine = into["latentkv"].setdefault(tier, {})
            for metric, cell in metrics.items():
                mine[metric] = stat(mine.get(metric, {}).get("samples", []) + cell["samples"])
    out["results"] = list(results.values())
    have = {m["weights"] for m in old["memory"]}
    out["memory"] = old["memory"] + [m for m in new["memory"] if m["weights"] not in have]
    out["bytes"] = {**new["bytes"], **old["bytes"]}
    for dtype, t in new["bytes"].items():  # depths the file's count lacks
        for part in ("weight_bytes", "kv_bytes"):
            out["bytes"][dtype][part] = {**t[part], **old["bytes"].get(dtype, {}).get(part, {})}
    out["depths"] = sorted(set(old["depths"]) | set(new["depths"]))
    out["depths_requested"] = sorted(set(old["depths_requested"]) | set(new["depths_requested"]))
    out["prefill"] = old["prefill"] or new["prefill"]
    out["notes"] = list(dict.fromkeys(old["notes"] + new["notes"]))
    out["runs"] = old.get("runs", []) + new["runs"]
    out["rounds"] = min(len(c["samples"]) for r in out["results"] for c in r["llama.cpp"].values())
    return out


def report(payload: dict) -> str:
    """The tables and the bars of a payload (one run's or several appended)."""
    results, kv, traffic = payload["results"], payload["kv"]["latentkv"], payload["bytes"]
    text = speed_table(results, kv) + "\n\n"
    if traffic:
        text += bandwidth_table(results, traffic, kv[0]) + "\n\n"
    return text + memory_table(payload["memory"]) + "\n\n" + "\n".join(payload["notes"] + payload["bars"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure-memory"]:
        print(json.dumps(measure_memory(argv[1], argv[2])))
        return 0
    if argv[:1] == ["--measure-bytes"]:
        depths = [int(d) for d in argv[3].split(",")]
        print(json.dumps(measure_bytes(argv[1], argv[2], depths, argv[4], *map(int, argv[5:7]))))
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
    name = args.model.removeprefix("builtin:").rstrip("/").split("/")[-1]
    out = args.out or Path(__file__).parent / "results" / f"vs-llamacpp-{name}.json"
    old = None
    if args.append and out.is_file():
        try:
            old = json.loads(out.read_text())
        except ValueError:
            print(f"error: --append: {out} is not a results file", file=sys.stderr)
            return 2
    requested = args.depths
    args.depths, notes = fit_depths(model, args.depths, args.gen)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results, memory, about = run_pairs(
        model, args, skip_memory={m["weights"] for m in (old or {}).get("memory", [])}
    )
    traffic = {}
    if args.bytes:
        traffic = {
            dtype: latentkv_bytes(model, dtype, args) for dtype in dict.fromkeys(d for _, d in args.pairs)
        }
    settings = {"threads": args.threads, "depths": args.depths, "depths_requested": requested}
    settings |= {"rounds": args.repetitions, "gen": args.gen, "prefill": args.prefill}
    settings |= {"kv": {"llama.cpp": "f16", "latentkv": args.kv}, "flash_attn": 1, "compile": args.compile}
    settings |= {"statistic": "median of the rounds' samples, with min and max", "goals": args.goals}
    run_ = {"started": started, "depths": args.depths, "pairs": [list(p) for p in args.pairs]}
    run_["command"] = " ".join(["python", "benchmarks/vs_llamacpp.py", *argv])  # as typed, to rerun it
    about = run_context(about)
    run_ |= {"rounds": args.repetitions, "prefill": args.prefill, "bytes": args.bytes}
    run_["latentkv_commit"] = about["latentkv_commit"]  # pieces may span commits: each says its own
    payload = {"model": str(model), **settings, "machine": about, "notes": notes, "bars": []}
    payload |= {"results": results, "memory": memory, "bytes": traffic, "runs": [run_]}
    if old is not None:
        merged = combine(old, payload)
        if isinstance(merged, str):
            print(f"error: {merged}", file=sys.stderr)
            return 2
        payload = merged
    payload["bars"] = bars(payload["results"], args.kv, args.goals)
    print(report(payload))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
