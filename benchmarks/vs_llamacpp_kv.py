"""KV cache formats side by side: llama.cpp's cache types and latentkv's tiers, KL divergence per byte.

    .venv/bin/python benchmarks/llamacpp.py --build                   # once (benchmarks/llamacpp.py)
    .venv/bin/python benchmarks/vs_llamacpp_kv.py --chunks 96 --threads 2 \\
        --out benchmarks/results/vs-llamacpp-kv.json

1. converts the model (default builtin:fixture) to GGUF (f32 weights) with llama.cpp's converter;
2. runs `llama-perplexity -c C --chunks N --kl-divergence` once with the base cache type (f16:
   its logits are the reference) and once per llama.cpp KV type (-ctk = -ctv, flash attention on,
   as a quantized MLA cache needs); llama-perplexity scores the second half of each chunk;
3. scores our tiers on the same chunks (the first N windows of C tokens of the same text) and the
   same positions (`score_from` C/2) through latentkv's eval, f32 as our reference;
4. prints one table: bytes per token per layer at the model's widths and at GLM-5's (512 + 64),
   KLD and top-1 agreement from both engines; writes JSON.

The two references differ (llama.cpp's f16 cache, our f32): the base's own distance from f32 is
tiny next to the 4- and 8-bit formats', and `--base-type f32` removes it where llama.cpp's CPU
flash attention takes an f32 cache. The engines tokenize the text themselves; the table reports
both token counts so a tokenizer mismatch shows.
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

LLAMA_TYPES = "q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl"
OUR_TIERS = "q8_0,q8s,q5_0,q5s,q4_1,q4_0,q4s,hq4_0,fp8,tq4-r8,tq4"
# ggml block sizes: (bytes, values) per block
GGML_BLOCKS = {
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q5_1": (24, 32),
    "q5_0": (22, 32),
    "q4_1": (20, 32),
    "q4_0": (18, 32),
    "iq4_nl": (18, 32),
}
GLM5 = (512, 64)


def ggml_bytes(kind: str, widths: tuple[int, int]) -> int:
    size, values = GGML_BLOCKS[kind]
    return sum(w // values * size for w in widths)


def gguf_path(model: str, directory: Path) -> Path:
    out = llamacpp.cache_dir() / "models" / f"{model.replace(':', '-').replace('/', '-')}-f32.gguf"
    if not out.exists():
        print(f"converting {directory} -> {out}", file=sys.stderr)
        llamacpp.convert_to_gguf(directory, out, "f32")
    return out


_KLD = re.compile(r"Mean\s+KLD:\s+([-+\d.eE]+)\s+±\s+([-+\d.eE]+)")
_TOP = re.compile(r"Same top p:\s+([\d.]+)\s+±\s+([\d.]+)\s*%")
_PPL = re.compile(r"Mean PPL\(Q\)\s*:\s+([\d.]+)")
_TOKENS = re.compile(
    r"tokenizing the input ..\s*\n.*?(\d+) tokens|calculating perplexity over (\d+) chunks", re.S
)


def llama_perplexity(gguf: Path, text: Path, args, kind: str, base_file: Path, base: bool) -> dict:
    cmd = [
        str(llamacpp.binary("llama-perplexity")),
        *("-m", str(gguf), "-f", str(text), "-c", str(args.context), "--chunks", str(args.chunks)),
        *("-b", str(args.context), "-t", str(args.threads), "-fa", "on", "-ctk", kind, "-ctv", kind),
        *("--kl-divergence-base", str(base_file)),
    ]
    if not base:
        cmd.append("--kl-divergence")
    print("$ " + " ".join(cmd), file=sys.stderr)
    run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        raise SystemExit(f"llama-perplexity failed for {kind} (exit {run.returncode}):\n{log[-3000:]}")
    out: dict = {"engine": "llama.cpp", "tier": kind, "command": " ".join(cmd)}
    if (m := _KLD.search(log)) is not None:
        out["kld"], out["kld_err"] = float(m.group(1)), float(m.group(2))
    if (m := _TOP.search(log)) is not None:
        out["top1"] = float(m.group(1)) / 100
    if (m := _PPL.search(log)) is not None:
        out["ppl"] = float(m.group(1))
    if (m := re.search(r"tokenization took .*?\n", log)) is not None:
        out["log_tokenization"] = m.group(0).strip()
    if (m := re.search(r"calculating perplexity over (\d+) chunks", log)) is not None:
        out["chunks"] = int(m.group(1))
    return out


def ours(args, tiers: list[str]) -> tuple[list[dict], int, tuple[int, int]]:
    import torch

    from latentkv.config import CacheConfig
    from latentkv.eval import ppl
    from latentkv.models.registry import resolve
    from latentkv.models.weights import load_model
    from latentkv.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    directory = resolve(args.model)
    model = load_model(directory, device="cpu")
    text = (args.text or directory / "heldout.txt").read_text(encoding="utf-8")
    ids = Tokenizer(directory).encode(text, add_special_tokens=False)
    windows = ppl.make_windows(ids, args.context)[: args.chunks]  # llama-perplexity's first N chunks
    configs = [CacheConfig(t) for t in tiers]
    scores = ppl.score_context(model, windows, configs, progress=_progress, score_from=args.context // 2)
    summary = ppl.summarize(scores, model.layout, resamples=1000)
    widths = (model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim)
    rows = [{"engine": "latentkv", **r} for r in summary["tiers"]]
    return rows, len(ids), widths


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def glm5_bytes(tier: str) -> int:
    from latentkv.kv.codecs import TIERS, get_codec

    t = TIERS[tier]
    return get_codec(t.c, GLM5[0]).bytes_per_row + get_codec(t.r, GLM5[1]).bytes_per_row


def table(rows: list[dict]) -> str:
    out = [
        "| engine | format | B/token/layer | GLM-5 B/token/layer | KLD | top-1 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (-r["bytes"], r.get("kld", 0.0))):
        kld = f"{r['kld']:.6f}" if "kld" in r else "-"
        top = f"{r['top1']:.4f}" if "top1" in r else "-"
        out.append(f"| {r['engine']} | {r['tier']} | {r['bytes']} | {r['bytes_glm5']} | {kld} | {top} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:fixture")
    p.add_argument("--text", type=Path, default=None, help="default: the model's heldout.txt")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--chunks", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base-type", default="f16", help="llama.cpp's reference cache type (f16; f32)")
    p.add_argument("--llama-types", default=LLAMA_TYPES)
    p.add_argument("--tiers", default=OUR_TIERS, help="latentkv tiers (f32 is the reference)")
    p.add_argument("--skip-llama", action="store_true", help="only our side (no llama.cpp needed)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from latentkv.models.registry import resolve

    directory = resolve(args.model)
    text = args.text or directory / "heldout.txt"
    rows, our_tokens, widths = ours(args, ["f32", *[t for t in args.tiers.split(",") if t and t != "f32"]])
    for r in rows:
        r["bytes"], r["bytes_glm5"] = r.pop("bytes_per_token_layer"), glm5_bytes(r["tier"])
    if not args.skip_llama:
        gguf = gguf_path(args.model, directory)
        base_file = (
            llamacpp.cache_dir() / "kld" / f"{gguf.stem}-c{args.context}-n{args.chunks}-{args.base_type}.kld"
        )
        base_file.parent.mkdir(parents=True, exist_ok=True)
        base = llama_perplexity(gguf, text, args, args.base_type, base_file, base=True)
        base.update(bytes=ggml_bytes(args.base_type, widths), bytes_glm5=ggml_bytes(args.base_type, GLM5))
        rows.append({**base, "kld": 0.0, "top1": 1.0})
        for kind in [k for k in args.llama_types.split(",") if k]:
            r = llama_perplexity(gguf, text, args, kind, base_file, base=False)
            rows.append({**r, "bytes": ggml_bytes(kind, widths), "bytes_glm5": ggml_bytes(kind, GLM5)})
    print(table(rows))
    payload = {
        "model": args.model,
        "context": args.context,
        "chunks": args.chunks,
        "scored_positions": f">= {args.context // 2} of each chunk",
        "latentkv_text_tokens": our_tokens,
        "llama_cpp_version": llamacpp.version(),
        "llama_cpp_base": args.base_type,
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
