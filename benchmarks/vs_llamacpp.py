"""latentkv vs llama.cpp on the same HF checkpoint, weight format by weight format.

    python benchmarks/vs_llamacpp.py MODEL [--threads 2] [--depths 0,4096] [--out FILE.json]

Pairs: llama.cpp f16 / latentkv bf16, q8_0 / int8, q4_K_M / int4. For each: decode tok/s at
each depth (llama-bench `-n 64 -d D`; latentkv `bench decode --context max(D, 1)`) and prefill
tok/s of 512 tokens (llama-bench `-p 512`; latentkv's prefill of a 512-token context), one
table with latentkv / llama.cpp ratios, JSON under benchmarks/results/.

llama.cpp is never built here: the one build lives in ~/.cache/latentkv/llama.cpp, made by the
KV-frontier benchmark's module `benchmarks/llamacpp.py --build`. This script uses that module for
the tools and the GGUF conversion when the checkout has it (else it finds `llama-bench`,
`llama-quantize` and `convert_hf_to_gguf.py` under --llama-cpp DIR itself),
converts MODEL to GGUF once per format into --work (kept between runs), and runs both engines
one after the other with the same thread count. Run it on an idle machine: timings on a busy one
say nothing. The GLM-5 tokenizer needs the converter to know its pre-tokenizer (GLM-4's regex,
type `glm4`); llama.cpp's own KV stays f16 (its default), latentkv's f32 (both reported).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_LLAMA = Path.home() / ".cache" / "latentkv" / "llama.cpp"
PAIRS = [("f16", "bf16"), ("q8_0", "int8"), ("q4_K_M", "int4")]
QUANTIZE_TYPE = {"q8_0": "Q8_0", "q4_K_M": "Q4_K_M"}
PREFILL = 512
GEN = 64


# llama.cpp's converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know; ours
# split text with GLM-4's regex, so it is told so; and its GLM vocabulary step wants GLM's own
# special tokens ([gMASK], ...), which our small tokenizers lack: the generic BPE step serves.
# (argv: the converter's path, then its arguments)
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
    sys.exit(f"error: no {name} under {root}; build llama.cpp once with the KV-frontier benchmark (--build)")


def shared_module():
    """benchmarks/llamacpp.py, the one llama.cpp build's module (the KV-frontier benchmark's),
    when this checkout has it; None otherwise (then the tree is searched under --llama-cpp)."""
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
    shared = shared_module()
    if not f16.exists() and shared is not None:
        shared.convert_to_gguf(model, f16, "f16")  # splits fused experts, patches the tokenizer steps
    elif not f16.exists():
        converter = find(llama, "convert_hf_to_gguf.py")
        source = str(per_expert(model, work))
        run(
            [
                sys.executable,
                "-c",
                CONVERT_AS_GLM4,
                str(converter),
                source,
                "--outtype",
                "f16",
                "--outfile",
                str(f16),
            ]
        )
    if fmt == "f16":
        return f16
    out = work / f"{model.name}-{fmt}.gguf"
    if not out.exists():
        run([str(tool(llama, "llama-quantize")), str(f16), str(out), QUANTIZE_TYPE[fmt]])
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
        sys.exit(f"error: {cmd[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def llama_bench(llama: Path, model_gguf: Path, threads: int, depths: list[int]) -> dict:
    """{"pp512": tok/s, "tg@D": tok/s} from one llama-bench run (JSON output)."""
    cmd = [str(tool(llama, "llama-bench")), "-m", str(model_gguf), "-t", str(threads)]
    cmd += ["-p", str(PREFILL), "-n", str(GEN), "-d", ",".join(map(str, depths)), "-o", "json"]
    out = {}
    for r in json.loads(run(cmd)):
        depth = r.get("n_depth", 0)
        if r["n_prompt"] and not r["n_gen"] and depth == 0:
            out[f"pp{r['n_prompt']}"] = r["avg_ts"]
        elif r["n_gen"] and not r["n_prompt"]:
            out[f"tg@{depth}"] = r["avg_ts"]
    return out


def latentkv_bench(model: str, dtype: str, threads: int, depths: list[int]) -> dict:
    """The same numbers from `latentkv bench decode` (one process per format)."""
    contexts = sorted({max(d, 1) for d in depths} | {PREFILL})
    cmd = [
        sys.executable,
        "-m",
        "latentkv",
        "bench",
        "decode",
        model,
        "--weight-dtype",
        dtype,
        "--threads",
        str(threads),
    ]
    cmd += [
        "--context",
        ",".join(map(str, contexts)),
        "--decode-tokens",
        str(GEN),
        "--repeats",
        "3",
        "--json",
    ]
    rows = json.loads(run(cmd))["rows"]
    by_ctx = {r["context"]: r for r in rows if r["engine"] == "latentkv" and r["kv_cache_dtype"] == "f32"}
    out = {f"pp{PREFILL}": by_ctx[PREFILL]["prefill_tps"]}
    for d in depths:
        out[f"tg@{d}"] = by_ctx[max(d, 1)]["decode_tps"]
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| llama.cpp | latentkv | metric | llama.cpp tok/s | latentkv tok/s | latentkv / llama.cpp |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        for metric, theirs in r["llama.cpp"].items():
            ours = r["latentkv"].get(metric)
            ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
            lines.append(
                f"| {r['gguf']} | {r['weights']} | {metric} | {theirs:.2f} | "
                f"{'-' if ours is None else f'{ours:.2f}'} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF checkpoint directory (config.json + safetensors + tokenizer.json)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--depths", default="0,4096", help="decode depths (default: 0,4096)")
    p.add_argument("--pairs", default="f16:bf16,q8_0:int8,q4_K_M:int4", help="gguf:latentkv format pairs")
    p.add_argument(
        "--llama-cpp", type=Path, default=DEFAULT_LLAMA, help=f"llama.cpp tree (default: {DEFAULT_LLAMA})"
    )
    p.add_argument(
        "--work", type=Path, default=DEFAULT_LLAMA.parent / "gguf", help="where GGUF files are kept"
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vs-llamacpp.json"))
    p.add_argument(
        "--tokenizer-from", type=Path, default=None, help="tokenizer donor for a checkpoint without one"
    )
    args = p.parse_args()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"error: {model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:
        depths = [int(d) for d in args.depths.split(",")]
        pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
        assert all(len(pair) == 2 and pair[0] in QUANTIZE_TYPE | {"f16": ""} for pair in pairs)
    except (ValueError, AssertionError):
        print(f"error: bad --depths {args.depths!r} or --pairs {args.pairs!r}", file=sys.stderr)
        return 2
    model = with_tokenizer(model, args.tokenizer_from, args.work)
    results = []
    for fmt, dtype in pairs:
        t0 = time.time()
        theirs = llama_bench(
            args.llama_cpp, gguf(model, fmt, args.work, args.llama_cpp), args.threads, depths
        )
        ours = latentkv_bench(str(model), dtype, args.threads, depths)
        results.append(
            {
                "gguf": fmt,
                "weights": dtype,
                "llama.cpp": theirs,
                "latentkv": ours,
                "seconds": time.time() - t0,
            }
        )
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": str(model),
        "threads": args.threads,
        "depths": depths,
        "kv": {"llama.cpp": "f16", "latentkv": "f32"},
    }
    args.out.write_text(json.dumps({**payload, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
