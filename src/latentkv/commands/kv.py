"""`latentkv kv stats|inspect`: bytes per token, distortion and the longest context per KV tier;
what a KV file holds and whether it would load here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from latentkv.commands.common import add_cache_arguments
from latentkv.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="kv", metavar="KV", required=True)
    s = sub.add_parser(
        "stats",
        help="bytes per token, rel-L2 error and the longest context in a RAM budget, per tier",
        description="Per KV tier: bytes per token (per layer and over all layers), compression vs "
        "f32 and bf16, mean relative L2 error of the codec on N(0,1) rows and (with --model) on the "
        "latent rows of a real forward pass, and the longest context that fits in --ram-gb. "
        "Without --model, GLM-5's dims.",
    )
    s.add_argument(
        "--model", default=None, help="model directory or builtin:NAME (default: GLM-5's dims, no weights)"
    )
    add_cache_arguments(s, multiple=True, default="all")
    s.add_argument("--ram-gb", type=float, default=16.0, help="RAM budget for the cache in GiB (default: 16)")
    s.add_argument(
        "--rows", type=int, default=4096, help="N(0,1) rows for the Gaussian error (default: 4096)"
    )
    s.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="with --model: prompt tokens of the forward pass whose rows are measured (default: 256)",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_inspect(sub)


def _add_inspect(sub) -> None:
    i = sub.add_parser(
        "inspect",
        help="what a KV file holds, whether it verifies, and whether it would load here",
        description="Format version, model fingerprint, KV tier and codec parameters, tokens, bytes "
        "(and the size its records predict), whether every committed record verifies, and whether "
        "the file would load under the current flags: with --model against that model and tier, "
        "else against the tier alone. Exit status: 0 the file is sound, 1 it is damaged or not a KV "
        "file, 2 usage errors (no such file, bad flags).",
    )
    i.add_argument("file", metavar="FILE", type=Path, help="a KV file (a session's NAME.kv)")
    i.add_argument(
        "--model",
        default=None,
        help="model directory or builtin:NAME to check the file against (no weights load)",
    )
    add_cache_arguments(i)
    i.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    if args.kv == "inspect":
        return _run_inspect(args)
    from latentkv.commands.common import cache_configs
    from latentkv.config import check_gib, check_tokens
    from latentkv.eval import kvstats

    check_gib("--ram-gb", args.ram_gb)
    check_tokens("--rows", args.rows, high=1 << 24)
    check_tokens("--tokens", args.tokens)
    caches = cache_configs(args, default="all")
    real = None
    if args.model is None:
        cfg, name, assumptions = kvstats.glm5_config(), "GLM-5 (default dims)", [kvstats.GLM5_ASSUMPTIONS]
    else:
        cfg, real = _real_rows(args)
        name, assumptions = args.model, []
    payload = {"model": name, "assumptions": assumptions, "tokens": args.tokens if real is not None else None}
    payload.update(kvstats.report(cfg, caches, args.ram_gb, args.rows, real))
    if args.json:
        print(json.dumps(payload, indent=1))
        return 0
    d = payload["dims"]
    print(
        f"KV tiers for {name}: {d['num_layers']} layers, kv_lora {d['kv_lora_rank']} + rope "
        f"{d['qk_rope_head_dim']}; indexer keys {d['index_head_dim']} x f32 on {d['index_layers']} layers; "
        f"context limit {d['max_position_embeddings']:,} tokens"
    )
    print(kvstats.table(payload))
    rows = f"{payload['gaussian_rows']} N(0,1) rows (seed {payload['gaussian_seed']})"
    if real is not None:
        rows += f"; real rows: {payload['real_rows']} ({args.tokens} tokens x {d['num_layers']} layers)"
    print(f"\nrel-L2: mean ||x - x_hat|| / ||x|| over {rows}", file=sys.stderr)
    for note in assumptions:
        print(f"assumed: {note}", file=sys.stderr)
    return 0


def _real_rows(args: argparse.Namespace):
    """Load MODEL (f32) and capture its latent rows over a prompt of --tokens tokens."""
    from latentkv.config import EngineConfig
    from latentkv.eval import kvstats
    from latentkv.runtime import load

    loaded = load(args.model, EngineConfig(), quiet=args.json)
    model = loaded.model
    tokens = kvstats.prompt_tokens(model.cfg, loaded.tokenizer, args.tokens)
    return model.cfg, kvstats.real_rows(model, tokens)


# --- inspect --------------------------------------------------------------------------------


def _run_inspect(args: argparse.Namespace) -> int:
    from latentkv.commands.common import cache_config
    from latentkv.kv.store import inspect

    _check_readable(args.file)
    config = cache_config(args)
    info = inspect(args.file)
    if "error" not in info:
        info["loads_here"] = _loads_here(args.file, args.model, config)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(inspect_text(info))
    return 0 if info["verifies"] else 1


def _check_readable(path: Path) -> None:
    """UserError (one line, exit 2) unless `path` is a regular file we may read: a FIFO, a
    directory or a device is refused from its stat, never opened for a blocking read."""
    import os

    from latentkv.kv.store_file import open_regular
    from latentkv.kv.store_header import KVFileUnavailable

    try:
        os.close(open_regular(path, os.O_RDONLY))
    except FileNotFoundError:
        raise UserError(f"no such file: {path}") from None
    except KVFileUnavailable as exc:
        raise UserError(str(exc)) from None


def _loads_here(path: Path, model: str | None, config) -> dict:
    """The verdict on loading the file under `config` (and `model`, when given), with its scope."""
    from latentkv.kv.cache import SHAPES_ONLY, CacheLayout, resolve_tier
    from latentkv.kv.store import KVFile, codec_spec, compare, compare_codec, header_for, layout_of
    from latentkv.kv.store_header import KVFileError

    with KVFile.open(path) as f:
        header = f.header
    try:
        if model is None:
            verdict = compare_codec(header.codec, codec_spec(layout_of(header, SHAPES_ONLY), config))
            scope = "codec"
        else:
            cfg, fingerprint = _model_fingerprint(model)
            tier = resolve_tier(CacheLayout.for_model(cfg, SHAPES_ONLY), config)
            current = header_for(cfg, tier.make_cache(), fingerprint)
            verdict, scope = compare(header, current), "model+codec"
    except (KVFileError, ValueError) as exc:  # the tier cannot store this layout's rows
        return {
            "action": "refuse",
            "message": str(exc),
            "differences": [],
            "resume_flags": "",
            "scope": "codec",
        }
    return {**verdict.as_dict(), "scope": scope, "kv_cache_dtype": config.kv_cache_dtype}


def _model_fingerprint(model: str):
    """(ModelConfig, weights fingerprint) of MODEL from config.json and the safetensors headers."""
    from latentkv.config import ConfigError, ModelConfig
    from latentkv.models.loader import Checkpoint, CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve

    try:
        directory = resolve(model)
        return ModelConfig.from_hf(directory), Checkpoint(directory).fingerprint()
    except (ModelNotFound, ConfigError, CheckpointError) as exc:
        raise UserError(str(exc)) from None


def inspect_text(info: dict) -> str:
    """`kv inspect` for people: one field per line."""
    if "error" in info:
        return f"{info['path']}: cannot be read: {info['error']}"
    m = info["model"]
    dsa = (
        f", DSA keys {m['index_head_dim']} x f32 on {len(m['index_layers'])} layers"
        if m["index_layers"]
        else ""
    )
    size = f"{info['bytes']:,} bytes"
    expected = info["expected_bytes"]
    size += " (as expected: " if info["bytes"] == expected else f" (expected {expected:,}: "
    size += f"header {info['header_bytes']:,} + {info['committed_tokens']} x {info['record_bytes']:,})"
    lines = [
        info["path"],
        f"  format      {info['format_version']} (written by {info['writer']}, {info['created']})",
        f"  file id     {info['file_id']}",
        f"  model       {m['model_type']}, {m['num_layers']} layers, kv_lora {m['kv_lora_rank']} + rope "
        f"{m['qk_rope_head_dim']}{dsa}, vocab {m['vocab_size']}",
        f"  weights     {m['checkpoint'][:16]} (SHA-256 of the safetensors headers)",
        f"  tier        {info['codec']['description']}, codec revision {info['codec']['revision']}; "
        f"resume with {info['resume_flags']}",
        f"  tokens      {info['tokens']} verified of {info['committed_tokens']} committed",
        f"  bytes       {size}",
        f"  verifies    {'yes' if info['verifies'] else 'NO'}",
    ]
    if loads := info.get("loads_here"):
        what = "" if loads["scope"] == "model+codec" else " (tier only; pass --model to check the model too)"
        answer = {"same": "yes", "reencode": "yes, re-encoded", "refuse": "no"}[loads["action"]]
        lines.append(f"  loads here  {answer}{what}: {loads['message']}")
    lines += [f"  note        {note}" for note in info["notes"]]
    return "\n".join(lines)
