"""`latentkv convert MODEL OUT`: rewrite a checkpoint in our quantized layout (models/convert.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from latentkv.commands.common import MODEL_HELP
from latentkv.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from latentkv.weights import format_names

    formats = format_names()

    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("out", metavar="OUT", type=Path, help="new directory for the converted model")
    p.add_argument(
        "--weight-dtype",
        default=None,
        choices=formats,
        help="format of the dense matrices (attention, dense MLP, shared experts, lm_head); required "
        "for a safetensors checkpoint; for a GGUF, the format of its float tensors (default f32: a "
        "GGUF's quantized matrices keep the formats they map onto, docs/models.md)",
    )
    p.add_argument(
        "--expert-dtype",
        default=None,
        choices=formats,
        help="format of the routed experts (default: --weight-dtype)",
    )
    p.add_argument("--json", action="store_true", help="print the manifest summary as JSON")


def _check_out(out: Path) -> None:
    """OUT must be new, or an empty folder (it is written beside it and renamed onto it last)."""
    from latentkv import fs

    try:
        if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
            raise UserError(f"{out} exists and is not an empty directory; give a new directory")
    except OSError as exc:
        raise fs.error(exc, out, "checking the output folder") from None


def run(args: argparse.Namespace) -> int:
    import json

    from latentkv.config import ConfigError
    from latentkv.models.convert import ConvertError, convert, read_manifest
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve

    try:
        source = resolve(args.model)
        source_manifest = read_manifest(Path(source))
    except (ModelNotFound, CheckpointError) as exc:
        raise UserError(str(exc)) from None
    from_gguf = source_manifest is not None and source_manifest.get("source") == "gguf"
    if source_manifest is not None and not from_gguf:
        raise UserError(f"{args.model} is already converted; convert the original checkpoint")
    if args.weight_dtype is None and not from_gguf:
        raise UserError("--weight-dtype is required (f32, bf16, int8 or int4) for a safetensors checkpoint")
    weight_dtype = args.weight_dtype or "f32"
    _check_out(args.out)
    t0 = time.perf_counter()
    try:
        manifest = convert(Path(source), args.out, weight_dtype, args.expert_dtype, progress=not args.json)
    except (ConfigError, CheckpointError, ConvertError) as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{args.out}: cannot write it: {exc.strerror or exc}") from None
    size = (args.out / "model.safetensors").stat().st_size
    summary = {
        "out": str(args.out),
        "weight_dtype": manifest["weight_dtype"],
        "expert_dtype": manifest["expert_dtype"],
        "packed_matrices": len(manifest["tensors"]),
        "bytes": size,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if from_gguf:
        summary["gguf"] = gguf_summary(manifest["tensors"])
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for line in gguf_lines(summary.get("gguf", {})):
            print(line, file=sys.stderr)
        print(
            f"converted {args.model} -> {args.out} ({summary['weight_dtype']} weights, {summary['expert_dtype']} "
            f"experts, {size / 2**20:.1f} MiB) in {summary['seconds']:.1f} s; load it with --weight-dtype "
            f"{summary['weight_dtype']} --expert-dtype {summary['expert_dtype']}",
            file=sys.stderr,
        )
    return 0


def gguf_summary(tensors: dict) -> dict:
    """Per GGUF type of the converted matrices: the format it went to, how many, whether exact,
    and for re-quantized ones the worst relative RMS error."""
    out: dict[str, dict] = {}
    for entry in tensors.values():
        if "gguf_type" not in entry:
            continue
        row = out.setdefault(
            entry["gguf_type"], {"format": entry["format"], "matrices": 0, "exact": entry["exact"]}
        )
        row["matrices"] += 1
        if "rel_rms_error" in entry:
            row["max_rel_rms_error"] = max(row.get("max_rel_rms_error", 0.0), entry["rel_rms_error"])
    return out


def gguf_lines(summary: dict) -> list[str]:
    from latentkv.models.gguf import percent

    lines = []
    for gguf_type, row in sorted(summary.items()):
        how = (
            "exactly"
            if row["exact"]
            else f"re-quantized, relative RMS error up to {percent(row.get('max_rel_rms_error', 0.0))}"
        )
        lines.append(f"  {row['matrices']:5d} {gguf_type} matrices -> {row['format']} ({how})")
    return lines
