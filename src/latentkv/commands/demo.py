"""`latentkv demo`: the bundled model end to end, with the numbers that matter."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from latentkv.commands.common import add_cache_arguments
from latentkv.errors import UserError

DEMO_PROMPT = "class Stack:\n    def __init__(self):\n        self."
DEMO_MODEL = "builtin:fixture"
# The first continuation is sampled as one would run the model (greedy decoding of a 7.8M model
# falls into loops like "self.path, self.path, ..."); seeded, so every run prints the same text.
DEMO_SAMPLING = SimpleNamespace(temperature=0.7, top_p=0.9, seed=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEMO_MODEL, help=f"model to run (default: {DEMO_MODEL})")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default: 48)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument(
        "--temperature",
        type=float,
        default=DEMO_SAMPLING.temperature,
        help=f"sampling temperature of the first continuation, 0 for greedy (default: {DEMO_SAMPLING.temperature})",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=DEMO_SAMPLING.top_p,
        help=f"nucleus mass (default: {DEMO_SAMPLING.top_p})",
    )
    p.add_argument(
        "--seed", type=int, default=DEMO_SAMPLING.seed, help=f"sampling seed (default: {DEMO_SAMPLING.seed})"
    )
    p.add_argument(
        "--compare",
        default=",".join(COMPARE_TIERS),
        help=f"tiers to run side by side after the main run, or 'none' (default: {','.join(COMPARE_TIERS)})",
    )
    add_cache_arguments(p)


COMPARE_TIERS = ("f32", "bf16", "q8s", "fp8", "tq6", "q4s", "tq4-r8", "tq4", "tq3", "polar4")


def run(args: argparse.Namespace) -> int:
    from latentkv.commands.common import cache_config, check_text, describe_tier
    from latentkv.commands.generate import kv_report
    from latentkv.config import ConfigError, EngineConfig
    from latentkv.engine.generate import generate
    from latentkv.engine.sampling import SamplingParams
    from latentkv.runtime import load

    try:
        engine = EngineConfig(threads=args.threads, cache=cache_config(args))
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    loaded = load(args.model, engine)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.cfg
    print(
        f"model: {args.model}  ({cfg.model_type}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"kv_lora {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim})"
    )
    if args.model == "builtin:tiny":
        print(
            "note: builtin:tiny has random weights (it is the oracle model), so the text is noise;"
            " what the demo shows is the engine and its cache."
        )
    try:
        sampling = SamplingParams(args.temperature, args.top_p, seed=args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    prompt = tok.encode(check_text(args.prompt, "--prompt")) if tok else [0]
    cache = model.make_cache(loaded.tier)
    result = generate(model, prompt, args.max_tokens, sampling, tok, cache=cache, stop_ids=())
    _show_continuation(args.prompt, result, tok, sampling)
    stats = result.stats
    kv = kv_report(model, cache)
    print()
    print(f"  prompt      {stats.prompt_tokens:>6} tokens  {stats.prompt_tps:>9.1f} tok/s")
    print(f"  generated   {stats.generated_tokens:>6} tokens  {stats.decode_tps:>9.1f} tok/s")
    print(
        f"  KV cache    {kv['bytes_per_token_per_layer']:>6} B/token/layer ({describe_tier(cache.tier)}; "
        f"kv_lora {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}), {stats.kv_bytes:,} bytes in use"
    )
    print(
        f"  per-head KV {kv['expanded_per_head_kv_bytes_per_token_per_layer']:>6} B/token/layer "
        f"(what transformers caches for GLM-5): ours is {kv['smaller_than_expanded']}x smaller"
    )
    if kv["index_bytes_per_token"]:
        print(f"  DSA keys    {kv['index_bytes_per_token']:>6} B/token (indexer key cache, f32)")
    if args.compare != "none":
        _compare_tiers(model, tok, prompt, args.max_tokens, args.compare)
        if args.model == "builtin:tiny":
            print(
                "  (greedy; on a random-weight model logits are nearly tied, so this measures how much each\n"
                "   tier perturbs the computation, not quality: `latentkv oracle --kv-cache-dtype all`)"
            )
        else:
            print(
                "  (greedy, so tiers compare token for token; what each tier costs in quality, with\n"
                "   intervals: `latentkv eval ppl MODEL`)"
            )
    print(
        f"\nnext: `latentkv generate {args.model} --prompt 'import os' --json`, `latentkv eval ppl {args.model}`",
        file=sys.stderr,
    )
    return 0


def _show_continuation(prompt: str, result, tok, sampling) -> None:
    """The prompt and its continuation as a user would read them: the text itself, in a block."""
    how = (
        "greedy"
        if sampling.greedy
        else (
            f"sampled: --temperature {sampling.temperature} --top-p {sampling.top_p} --seed {sampling.seed}"
        )
    )
    if tok is None:
        print(f"\noutput ids ({how}): {result.tokens}")
        return
    print(f"\n--- prompt, then the model's continuation ({how}) ---")
    print(prompt + result.text)
    print("---")


def _compare_tiers(model, tok, prompt: list[int], max_tokens: int, tiers: str) -> None:
    """Every tier side by side, decoded greedily: row bytes, decode speed, how long it tracks
    f32's tokens, and the continuation it wrote."""
    from latentkv.config import ConfigError, parse_kv_cache_dtypes
    from latentkv.engine.generate import generate
    from latentkv.engine.sampling import SamplingParams

    try:
        names = parse_kv_cache_dtypes(tiers)
    except ConfigError as exc:
        raise UserError(str(exc)) from None

    reference = generate(model, prompt, max_tokens, SamplingParams(), tok, stop_ids=()).tokens  # f32, greedy
    print("\n  tier     B/token/layer   decode tok/s   tokens equal to f32's   first difference")
    for name in names:
        try:
            tier = model.tier(name)
        except ValueError:
            print(f"  {name:<8} (not available: this model's latent widths are not powers of two)")
            continue
        cache = model.make_cache(tier)
        out = generate(model, prompt, max_tokens, SamplingParams(), tok, cache=cache, stop_ids=())
        same = sum(a == b for a, b in zip(out.tokens, reference, strict=False))
        first = next((i for i, (a, b) in enumerate(zip(out.tokens, reference, strict=False)) if a != b), None)
        print(
            f"  {name:<8} {cache.tier.bytes_per_token_layer:>13}   {out.stats.decode_tps:>12.1f}   "
            f"{same:>9}/{len(reference):<12}   {'-' if first is None else f'token {first}'}"
        )
        if tok is not None:
            print(f"           {_one_line(out.text)}")


def _one_line(text: str, width: int = 100) -> str:
    """A continuation on one line: newlines shown as the repr does, cut to `width` characters."""
    shown = repr(text)[1:-1]
    return shown if len(shown) <= width else shown[: width - 3] + "..."
