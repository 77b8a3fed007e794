"""GGUF in: our load of llama.cpp's GGUFs against the safetensors checkpoint, and against llama.cpp.

    .venv/bin/python benchmarks/llamacpp.py --build                   # once (benchmarks/llamacpp.py)
    .venv/bin/python benchmarks/vs_llamacpp_gguf.py --chunks 32 --threads 2 \\
        --out benchmarks/results/gguf-vs-llamacpp.json

1. converts the model (default builtin:fixture) with llama.cpp's converter (f32 and bf16) and
   quantizes the f32 file with `llama-quantize` to each of --types, as a user's GGUF is made;
2. the logits table: latentkv loads each GGUF (MODEL = the .gguf) and scores the first --chunks
   windows of --context tokens of the held-out text, against latentkv's load of the safetensors
   checkpoint (f32) on the same windows: KL divergence, top-1 agreement, perplexity; and against
   the checkpoint that GGUF dequantizes to (its values in float32, loaded in f32), which leaves
   only our formats' own error (compute rounding, and the types re-quantized: the GGUF line of
   the load says which);
3. the perplexity table: `llama-perplexity -c C --chunks N` on each GGUF against ours on the same
   GGUF, the same windows and the same positions (the second half of each chunk, as
   llama-perplexity scores them), each with its interval.

The engines tokenize the text themselves (ours with the tokenizer rebuilt from the GGUF; the
JSON records our token count: llama-perplexity prints none). The F32 GGUF's two perplexities
agree to 5 digits when both score the same tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import llamacpp  # noqa: E402
import machine  # noqa: E402

TYPES = "Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,IQ4_XS"
_PPL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")


def make_ggufs(model: str, directory: Path, types: list[str]) -> dict[str, Path]:
    """name -> GGUF path: the converter's f32 and bf16 files, and llama-quantize's from the f32."""
    stem = model.replace(":", "-").replace("/", "-")
    folder = llamacpp.cache_dir() / "models"
    out = {}
    for outtype in ("f32", "bf16"):
        path = folder / f"{stem}-{outtype}.gguf"
        if not path.exists():
            print(f"converting {directory} -> {path}", file=sys.stderr)
            llamacpp.convert_to_gguf(directory, path, outtype)
        out[outtype.upper()] = path
    for kind in types:
        path = folder / f"{stem}-{kind}.gguf"
        if not path.exists():
            cmd = [str(llamacpp.binary("llama-quantize")), str(out["F32"]), str(path), kind]
            print("$ " + " ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True, capture_output=True)
        out[kind] = path
    return out


def dequantized_folder(view: Path, out: Path) -> Path:
    """The safetensors checkpoint of what a GGUF dequantizes to (float32), beside its config and
    tokenizer: the float reference of its own values."""
    import shutil

    from safetensors.torch import save_file

    from latentkv.models.loader import Checkpoint

    if (out / "model.safetensors").exists():
        return out
    ckpt = Checkpoint(view)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: ckpt.get(n).float().contiguous() for n in ckpt.keys()}, str(out / "model.safetensors"))  # noqa: SIM118
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (view / name).exists():
            shutil.copy2(view / name, out / name)
    return out


def load_gguf(view: Path):
    """Load a GGUF view as `latentkv generate` does, and the line its load prints: per GGUF type
    the format and, for re-quantized types, the worst relative RMS error measured while loading."""
    import contextlib
    import io

    from latentkv.models.weights import load_model

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model = load_model(view, progress=True, device="cpu")
    lines = [x for x in err.getvalue().splitlines() if "GGUF matrices" in x]
    line = lines[0].removeprefix("latentkv: ") if lines else "all float"
    print(f"  {line}", file=sys.stderr)
    return model, line


def ours(args, ggufs: dict[str, Path]) -> tuple[list[dict], dict]:
    """Our scores: each GGUF against the safetensors f32 load, and against its own values."""
    import torch

    from latentkv.config import CacheConfig
    from latentkv.eval import ppl
    from latentkv.models.registry import resolve
    from latentkv.models.weights import load_model
    from latentkv.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    directory = resolve(args.model)
    text = (args.text or directory / "heldout.txt").read_text(encoding="utf-8")
    reference = load_model(directory, device="cpu")
    rows, tokens = [], {}
    f32 = CacheConfig("f32")
    for name, path in ggufs.items():
        view = resolve(str(path))
        ids = Tokenizer(view).encode(text, add_special_tokens=False)
        tokens[name] = len(ids)
        windows = ppl.make_windows(ids, args.context)[: args.chunks]
        model, mapping = load_gguf(view)
        own = load_model(
            dequantized_folder(view, llamacpp.cache_dir() / "dequantized" / path.stem), device="cpu"
        )
        variants = [
            ppl.Variant(reference, f32, "safetensors f32"),
            ppl.Variant(own, f32, f"{name} dequantized"),
            ppl.Variant(model, f32, f"{name} (latentkv)"),
        ]
        scores = ppl.score_variants(windows, variants, _progress, score_from=args.context // 2)
        summary = ppl.summarize(scores, model.layout, resamples=1000)
        vs_own = ppl.score_variants(windows, variants[1:], None, score_from=args.context // 2)
        own_row = ppl.summarize(vs_own, model.layout, resamples=1000)["tiers"][1]
        row = summary["tiers"][2]
        rows.append(
            {
                "gguf": name,
                "file": path.name,
                "bytes": path.stat().st_size,
                "mapping": mapping,
                "vs_safetensors": {k: row[k] for k in ("ppl", "ppl_ci", "kld", "kld_ci", "top1", "top1_ci")},
                "quantization_alone": {k: summary["tiers"][1][k] for k in ("ppl", "kld", "top1")},
                "vs_own_values": {k: own_row[k] for k in ("kld", "kld_ci", "top1", "top1_ci")},
                "safetensors_ppl": summary["tiers"][0]["ppl"],
                "tokens_scored": summary["tokens_scored"],
            }
        )
    return rows, tokens


def llama_perplexity(path: Path, text: Path, args) -> dict:
    cmd = [
        str(llamacpp.binary("llama-perplexity")),
        *("-m", str(path), "-f", str(text), "-c", str(args.context), "--chunks", str(args.chunks)),
        *("-b", str(args.context), "-t", str(args.threads)),
    ]
    print("$ " + " ".join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        raise SystemExit(f"llama-perplexity failed on {path.name} (exit {run.returncode}):\n{log[-3000:]}")
    m = _PPL.search(log)
    if m is None:
        raise SystemExit(f"no 'Final estimate' in llama-perplexity's output for {path.name}:\n{log[-2000:]}")
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)), "command": " ".join(cmd)}


def torch_version() -> str:
    import torch

    return torch.__version__


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def tables(rows: list[dict]) -> str:
    out = [
        "GGUF vs safetensors (latentkv on both; KL and top-1 against the safetensors f32 load, and"
        " against the GGUF's own values in f32)",
        "",
        "| GGUF | MiB | KL vs safetensors | top-1 | KL of the quantization alone | KL vs its own values | top-1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, q, o = r["vs_safetensors"], r["quantization_alone"], r["vs_own_values"]
        out.append(
            f"| {r['gguf']} | {r['bytes'] / 2**20:.1f} | {s['kld']:.6f} | {s['top1']:.4f} | {q['kld']:.6f} "
            f"| {o['kld']:.2e} | {o['top1']:.4f} |"
        )
    out += [
        "",
        "Perplexity on the same windows and positions: llama-perplexity and latentkv, each on the same GGUF",
        "",
        "| GGUF | llama.cpp ppl | latentkv ppl (95% interval) | difference |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        if "llama_cpp" not in r:
            continue
        ll, s = r["llama_cpp"], r["vs_safetensors"]
        ci = f" ({s['ppl_ci'][0]:.3f}-{s['ppl_ci'][1]:.3f})" if s.get("ppl_ci") else ""
        out.append(
            f"| {r['gguf']} | {ll['ppl']:.3f} ± {ll['ppl_err']:.3f} | {s['ppl']:.3f}{ci} "
            f"| {100 * (s['ppl'] / ll['ppl'] - 1):+.2f}% |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:fixture")
    p.add_argument("--text", type=Path, default=None, help="default: the model's heldout.txt")
    p.add_argument("--types", default=TYPES, help="llama-quantize types of the f32 GGUF")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-llama", action="store_true", help="no llama-perplexity (the logits table only)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--append", action="store_true", help="add the rows to --out's (split long tables)")
    p.add_argument(
        "--no-floats", dest="floats", action="store_false", help="leave out the F32 and BF16 files"
    )
    p.add_argument(
        "--prepare", action="store_true", help="only make the GGUFs (not timed; before a quiet run)"
    )
    args = p.parse_args(argv)

    from latentkv import version
    from latentkv.models.registry import resolve

    directory = resolve(args.model)
    ggufs = make_ggufs(args.model, directory, [t for t in args.types.split(",") if t])
    if args.prepare:
        print(json.dumps({k: str(v) for k, v in ggufs.items()}, indent=1))
        return 0
    if args.floats is False:
        ggufs = {k: v for k, v in ggufs.items() if k not in ("F32", "BF16")}
    rows, tokens = ours(args, ggufs)
    if not args.skip_llama:
        text = args.text or directory / "heldout.txt"
        for r in rows:
            r["llama_cpp"] = llama_perplexity(ggufs[r["gguf"]], text, args)
    print(tables(rows))
    payload = {
        "model": args.model,
        "context": args.context,
        "chunks": args.chunks,
        "scored_positions": f">= {args.context // 2} of each chunk",
        "latentkv_text_tokens": tokens,
        "latentkv_version": version(),
        "llama_cpp_version": llamacpp.version(),
        "cpu": machine.cpu_model(),
        "torch": torch_version(),
        "threads": args.threads,
        "rows": rows,
    }
    if args.out is not None:
        if args.append and args.out.exists():
            before = json.loads(args.out.read_text())
            payload["rows"] = [r for r in before["rows"] if r["gguf"] not in ggufs] + payload["rows"]
            payload["latentkv_text_tokens"] = {**before["latentkv_text_tokens"], **tokens}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
