"""`latentkv bench speculative`: MTP drafting's acceptance and decode tok/s, with and without."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from latentkv.commands.bench import common
from latentkv.commands.common import add_device_argument, add_streaming_arguments, add_vram_argument
from latentkv.errors import UserError

RANDOM_MODELS = ("random:tiny", "random:slice")
STREAMED_NOTE = (
    "--ram-gb: the experts (the MTP layer's too) stream from disk into one cache shared by all rows "
    "of a model, in row order (the first row starts cold: use --repeats 2+ to compare warm rows); "
    "expert columns cover each row's prompt pass too; drop the page cache before a cold run"
)


def add(sub) -> None:
    d = sub.add_parser(
        "speculative",
        help="MTP speculative decoding: acceptance per draft position, tokens per verify, tok/s with and without",
        description="For each model, concurrency and draft length: greedy decode of the same prompts with "
        "drafting (the pause rule off) and without; acceptance per draft position, tokens per verify step, "
        "decode tok/s and its ratio to plain decoding, and whether the tokens are identical (they must be). "
        "random:tiny and random:slice are builtin:tiny's and the GLM-5-width slice's shapes with random "
        "weights and a random MTP layer (the low-acceptance case), built once under the cache directory. "
        "With --ram-gb the experts (the MTP layer's too) stream from disk within that budget and each row "
        "adds the expert cache's hit rates and MiB read per token. With --device cuda the models run on the "
        "GPU (f32 weights), and --vram-gb plans its memory as in `latentkv generate`.",
    )
    d.add_argument(
        "--model",
        default="builtin:fixture,random:tiny",
        help="comma-separated: model directories, builtin:NAME, random:tiny, random:slice "
        "(default: builtin:fixture,random:tiny)",
    )
    d.add_argument("--draft-tokens", default="1,2,3", help="comma-separated draft lengths (default: 1,2,3)")
    d.add_argument(
        "--concurrency", default="1,8", help="comma-separated sequences decoded together (default: 1,8)"
    )
    d.add_argument("--prompt-tokens", type=int, default=128, help="prompt length per sequence (default: 128)")
    d.add_argument(
        "--decode-tokens", type=int, default=64, help="tokens generated per sequence (default: 64)"
    )
    d.add_argument("--kv-cache-dtype", default="f32", help="one KV tier (default: f32)")
    d.add_argument(
        "--repeats", type=int, default=1, help="keep the fastest of this many runs per row (default: 1)"
    )
    add_device_argument(d)
    add_streaming_arguments(d)
    add_vram_argument(d)
    d.add_argument(
        "--expert-share",
        type=float,
        default=None,
        metavar="F",
        help="stream the experts with a RAM budget whose expert cache holds this share of all experts "
        "(the MTP layer's included), e.g. 0.25; per model, from `latentkv plan` (instead of --ram-gb)",
    )
    common.add_output(d)


def run(args: argparse.Namespace) -> dict:
    from latentkv.config import CacheConfig, ConfigError

    drafts = common.ints(args.draft_tokens, "--draft-tokens")
    if max(drafts) > 8:
        raise UserError("--draft-tokens must be in 1..8")
    concurrency = common.ints(args.concurrency, "--concurrency")
    if args.expert_share is not None and (args.ram_gb is not None or not 0 < args.expert_share <= 1):
        raise UserError("--expert-share takes a share in (0, 1], instead of --ram-gb")
    if args.prompt_tokens < 2 or args.decode_tokens < 2 or args.repeats < 1:
        raise UserError("--prompt-tokens and --decode-tokens must be >= 2, --repeats >= 1")
    tiers = common.tiers(args.kv_cache_dtype)
    if len(tiers) != 1:
        raise UserError("--kv-cache-dtype takes one tier here")
    try:
        cache = CacheConfig(tiers[0])
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    _check_device(args)
    common.set_threads(args.threads)
    rows: list[dict] = []
    for name in [m.strip() for m in args.model.split(",") if m.strip()]:
        rows += _model_rows(args, name, cache, drafts, concurrency)
        gc.collect()
    notes = [
        "drafting rows: the MTP layer drafts N tokens on every step (the pause rule off); "
        "tok/s needs an idle machine, acceptance does not",
    ]
    if args.ram_gb is not None or args.expert_share is not None:
        notes.append(STREAMED_NOTE)
    return {
        "bench": "speculative",
        "models": args.model,
        "kv_cache_dtype": cache.kv_cache_dtype,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "device": args.device,
        "ram_gb": args.ram_gb,
        "vram_gb": args.vram_gb,
        "expert_share": args.expert_share,
        "expert_cache_policy": args.expert_cache_policy if args.ram_gb or args.expert_share else None,
        "notes": notes,
        "rows": rows,
    }


def _check_device(args: argparse.Namespace) -> None:
    """--device and --vram-gb refused as `load` would refuse them (one line, exit 2), before any
    model is resolved or a random one written to disk."""
    from latentkv.config import ConfigError, EngineConfig
    from latentkv.runtime import check_device

    streamed = args.expert_share is not None or args.ram_gb is not None
    try:  # --expert-share becomes a --ram-gb per model; any budget stands for it here
        engine = EngineConfig(
            device=args.device, vram_gb=args.vram_gb, ram_gb=args.ram_gb or (1.0 if streamed else None)
        )
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    check_device(engine)


def _model_rows(args, name: str, cache, drafts: list[int], concurrency: list[int]) -> list[dict]:
    from latentkv.commands.common import check_speculative
    from latentkv.engine.speculative import SpeculativeConfig

    directory = _directory(name)
    loaded = _load(args, directory, cache, max(drafts), max(concurrency))
    try:
        check_speculative(loaded.model, SpeculativeConfig())
        return _rows(args, name, directory, loaded, cache, drafts, concurrency)
    finally:
        loaded.close()


def _load(args, directory: Path, cache, draft_tokens: int, sequences: int):
    """The model, resident or (--ram-gb) with its experts streamed, planned for these rows."""
    from latentkv.config import ConfigError, EngineConfig, ModelConfig
    from latentkv.runtime import check_tier, load

    length = args.prompt_tokens + args.decode_tokens + draft_tokens
    if length > ModelConfig.from_hf(directory).max_position_embeddings:
        raise UserError(f"{directory}: --prompt-tokens + --decode-tokens exceed the model's context")
    try:
        ram_gb = _ram_gb(args, directory, cache, length, sequences, draft_tokens)
        engine = EngineConfig(
            cache=cache,
            ram_gb=ram_gb,
            vram_gb=args.vram_gb,
            expert_policy=args.expert_cache_policy,
            device=args.device,
        )
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    check_tier(ModelConfig.from_hf(directory), cache)
    return load(
        str(directory),
        engine,
        quiet=args.json,
        max_model_len=length,
        max_num_seqs=sequences,
        draft_tokens=draft_tokens,
    )


def _ram_gb(args, directory: Path, cache, length: int, sequences: int, draft_tokens: int) -> float | None:
    """--ram-gb, or the budget whose expert cache holds --expert-share of the experts (the
    resident parts as `latentkv plan` sizes them, plus that share of the expert bytes)."""
    if args.expert_share is None:
        return args.ram_gb
    from latentkv.config import ModelConfig
    from latentkv.streaming.attach import default_store_dir
    from latentkv.streaming.planner import GIB, make_plan

    store = default_store_dir(directory, "f32")
    p = make_plan(
        ModelConfig.from_hf(directory),
        directory,
        1 << 50,
        cache=cache,
        max_model_len=length,
        max_num_seqs=sequences,
        store_dir=store if (store / "manifest.json").exists() else None,
        draft_tokens=draft_tokens,
    )
    fixed = p.dense_bytes + p.kv_bytes + p.activation_bytes + p.working_bytes
    experts = round(args.expert_share * p.experts_total)
    return (fixed + experts * p.expert_extent_bytes + p.expert_extent_bytes // 2) / GIB


def _rows(args, name: str, directory: Path, loaded, cache, drafts: list[int], concurrency: list[int]):
    from latentkv.eval.bench.measure_speculative import bench_speculative

    model, streamer = loaded.model, loaded.streamer
    rows = []
    for c in concurrency:
        reference, plain_tps = None, None
        for n in [0, *drafts]:
            best = None
            for _ in range(args.repeats):
                row, outs = bench_speculative(
                    model,
                    name,
                    directory,
                    c,
                    n,
                    args.prompt_tokens,
                    args.decode_tokens,
                    cache,
                    reference,
                    streamer,
                )
                best = row if best is None or row.decode_tps > best.decode_tps else best
            if n == 0:
                reference, plain_tps = outs, best.decode_tps
            else:
                best.vs_plain = best.decode_tps / plain_tps if plain_tps else None
            rows.append(best.as_dict())
            hits = f", expert hits {best.experts['hit_rate']:.0%}" if best.experts else ""
            common.progress(
                f"{name} C={c} N={n}: {best.decode_tps:.1f} tok/s, tokens/verify {best.tokens_per_verify}, "
                f"acceptance {best.acceptance_per_position}{hits}",
                args.json,
            )
    return rows


def _directory(name: str) -> Path:
    """A model's directory; random:tiny / random:slice are built once under the cache directory."""
    from latentkv.config import ConfigError, cache_root
    from latentkv.models.registry import ModelNotFound, resolve

    if name in RANDOM_MODELS:
        return _random_model(name, cache_root() / "bench" / name.replace(":", "-"))
    try:
        return resolve(name)
    except (ModelNotFound, ConfigError) as exc:
        raise UserError(str(exc)) from None


def _random_model(name: str, directory: Path) -> Path:
    import json

    from latentkv.models.registry import builtin_path
    from latentkv.models.synthetic import SLICE_CONFIG, write_random_checkpoint

    if (directory / "config.json").exists():
        return directory
    if name == "random:tiny":
        cfg = json.loads((builtin_path("tiny") / "config.json").read_text())
    else:
        cfg = dict(SLICE_CONFIG)
    cfg["num_nextn_predict_layers"] = 1
    return write_random_checkpoint(cfg, directory, seed=17)


def table(rows: list[dict]) -> str:
    streamed = any(r.get("experts") for r in rows)
    extra = " expert hits (main / MTP) | MiB read/token |" if streamed else ""
    lines = [
        "| model | KV | sequences | draft tokens | acceptance per position | tokens/verify | decode tok/s "
        "| vs plain | same tokens |" + extra,
        "|---|---|---:|---:|---|---:|---:|---:|---|" + ("---|---:|" if streamed else ""),
    ]
    for r in rows:
        acc = " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        same = "yes" if r["same_tokens"] else "**no**"
        lines.append(
            f"| {r['model']} | {r['kv_cache_dtype']} | {r['concurrency']} | {r['draft_tokens'] or 'off'} | {acc} "
            f"| {tpv} | {r['decode_tps']:,.1f} | {common.ratio(r['vs_plain'])} | {same} |"
            + (_expert_cells(r.get("experts")) if streamed else "")
        )
    return "\n".join(lines)


def _expert_cells(e: dict | None) -> str:
    if not e:
        return " - | - |"
    draft = "-" if e["draft_hit_rate"] is None else f"{e['draft_hit_rate']:.0%}"
    return f" {e['main_hit_rate']:.0%} / {draft} | {e['mib_read_per_token']:.2f} |"
