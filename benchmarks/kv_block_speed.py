"""In-process speed ratios of the KV tiers against f32 (issue 18), behind docs/kv-tiers.md "Speed".

Two measurements, each as a ratio of f32's time taken in the same process, the tiers
interleaved and the fastest of --repeats kept, on one thread and as the calling thread's CPU
time: ratios that hold up on a shared machine (absolute times do not; for those, run `latentkv
bench decode` on an idle one).

    attention  one decode token of --heads heads over --rows rows of kv_lora 512 + rope 64 (the
               slice's widths; 2,048 rows is what DSA reads at 4,096 tokens of context): f32 as
               `F32Rows` (one matmul over float32 rows), every other tier through
               `attention.consumers.attend` over its packed rows (the torch reference), and
               the tiers latentkv's CPU kernel reads (bf16, q8_0, q8s, q4_0, q4s; AVX2 or AVX-512) through
               it as well (`attention.native`, the backend a decode step takes on such a CPU)
    fixture    greedy generation of --tokens tokens of the demo prompt on builtin:fixture, through
               whichever backend the tier gets (LATENTKV_CPU_ATTENTION=0: the reference for all)

    PYTHONPATH=src .venv/bin/python benchmarks/kv_block_speed.py --out benchmarks/results/kv-block-speed.json
    PYTHONPATH=OLD/src .venv/bin/python benchmarks/kv_block_speed.py   # an older checkout: "before"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

TIERS = "f32,q8_0,q8s,q5_0,q5s,q4_0,q4s,q4_1,hq4_0,wq4,fp8,tq4"
PROMPT = "class Stack:\n    def __init__(self):\n        self."


def fastest(runs: dict[str, object], repeats: int) -> dict[str, float]:
    """CPU seconds of each callable, fastest of `repeats` after one untimed warm-up call, the
    callables interleaved."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.thread_time()
            run()
            best[name] = min(best[name], time.thread_time() - start)
    return best


def attention_runs(tiers: list[str], rows: int, heads: int) -> dict[str, object]:
    from latentkv.kv.cache import F32Rows
    from latentkv.kv.codecs import get_codec

    try:
        from latentkv.attention import consumers as attention
        from latentkv.attention.readers import attend as attend_rows
    except ImportError:  # a checkout from before the attention backend held the arithmetic
        from latentkv.kv import attention

        def attend_rows(query, reader, allowed):
            return reader.attend(query, allowed)

    g = torch.Generator().manual_seed(0)
    query = torch.randn(heads, 1, 576, generator=g) * 0.05
    runs = {}
    for tier in tiers:
        x = torch.randn(rows, 576, generator=g)
        if tier == "f32":
            reader = F32Rows(x, 512)
            runs[tier] = lambda reader=reader: attend_rows(query, reader, None)
            continue
        codec_c, codec_r = get_codec(tier, 512), get_codec(tier, 64)
        c, r = codec_c.encode(x[:, :512]), codec_r.encode(x[:, 512:])
        runs[tier] = lambda a=(codec_c, codec_r, query, c, r): attention.attend(*a)
        if (kernel := _cpu_kernel(codec_c, codec_r, c, r)) is not None:
            runs[f"{tier} kernel"] = lambda kernel=kernel: kernel(query)
    return runs


def _cpu_kernel(codec_c, codec_r, c, r):
    """The CPU backend's decode over these rows, where this checkout has it and serves the tier."""
    try:
        from latentkv.attention.native import CPU
        from latentkv.kv.cache import PackedRows
    except ImportError:  # a checkout from before the CPU kernel
        return None
    from latentkv import native
    from latentkv.attention.native import row_format

    kernels = native.kernels()
    if row_format(codec_c) is None or row_format(codec_r) is None or kernels is None or kernels.isa < 1:
        return None
    reader = PackedRows(c, r, codec_c, codec_r)
    return lambda query: CPU.attend(query, reader, None, None)


def fixture_runs(tiers: list[str], tokens: int) -> dict[str, object]:
    from latentkv.config import EngineConfig
    from latentkv.engine.generate import generate
    from latentkv.engine.sampling import SamplingParams
    from latentkv.runtime import load

    loaded = load("builtin:fixture", EngineConfig(threads=1), quiet=True)
    model, tok = loaded.model, loaded.tokenizer
    prompt = tok.encode(PROMPT)

    def run(tier: str) -> None:
        cache = model.make_cache(model.tier(tier))
        generate(model, prompt, tokens, SamplingParams(0.0, 1.0), tok, cache=cache, stop_ids=())

    return {tier: (lambda tier=tier: run(tier)) for tier in tiers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiers", default=TIERS, help=f"comma-separated, f32 first (default: {TIERS})")
    p.add_argument("--rows", type=int, default=2048, help="cached rows of the attention call (default: 2048)")
    p.add_argument("--heads", type=int, default=64, help="query heads (default: 64)")
    p.add_argument("--tokens", type=int, default=48, help="tokens generated on the fixture (default: 48)")
    p.add_argument("--repeats", type=int, default=11, help="interleaved repeats, fastest kept (default: 11)")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    tiers = args.tiers.split(",")
    if tiers[0] != "f32":
        raise SystemExit("--tiers must start with f32 (the ratios are against it)")
    torch.set_num_threads(1)
    with torch.inference_mode():
        attend = fastest(attention_runs(tiers, args.rows, args.heads), args.repeats)
    fixture = fastest(fixture_runs(tiers, args.tokens), max(1, args.repeats // 2))
    print(
        f"| tier | attention ms ({args.rows} rows) | x f32 | CPU kernel ms | kernel x reference "
        "| fixture tok/s | x f32 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for tier in tiers:
        kernel = attend.get(f"{tier} kernel")
        kernel_cells = "| | " if kernel is None else f"| {kernel * 1e3:.2f} | {attend[tier] / kernel:.2f}x "
        print(
            f"| {tier} | {attend[tier] * 1e3:.2f} | {attend['f32'] / attend[tier]:.2f}x {kernel_cells}"
            f"| {args.tokens / fixture[tier]:.1f} | {fixture['f32'] / fixture[tier]:.2f}x |"
        )
    if args.out:
        rows = [
            {
                "tier": t,
                "attention_seconds": attend[t],
                "attention_vs_f32": attend["f32"] / attend[t],
                "cpu_kernel_seconds": attend.get(f"{t} kernel"),
                "fixture_tok_s": args.tokens / fixture[t],
                "fixture_vs_f32": fixture["f32"] / fixture[t],
            }
            for t in tiers
        ]
        meta = {
            "args": vars(args) | {"out": str(args.out)},
            "torch": torch.__version__,
            "cpu": machine.cpu_model(),
            "commit": machine.commit(),
            "cpu_attention": os.environ.get("LATENTKV_CPU_ATTENTION", "on (unset)"),
        }
        meta["uname"] = " ".join(os.uname())
        args.out.write_text(
            json.dumps({**meta, "threads": 1, "clock": "thread_time", "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
