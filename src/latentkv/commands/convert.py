"""`latentkv convert MODEL OUT`: rewrite a checkpoint in our quantized layout (models/convert.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from latentkv.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from latentkv.config import WEIGHT_DTYPES

    p.add_argument(
        "model", metavar="MODEL", help="model directory (config.json + safetensors) or builtin:NAME"
    )
    p.add_argument("out", metavar="OUT", type=Path, help="new directory for the converted model")
    p.add_argument(
        "--weight-dtype",
        required=True,
        choices=WEIGHT_DTYPES,
        help="format of the dense matrices (attention, dense MLP, shared experts, lm_head)",
    )
    p.add_argument(
        "--expert-dtype",
        default=None,
        choices=WEIGHT_DTYPES,
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
    from latentkv.models.convert import MANIFEST, ConvertError, convert
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve

    try:
        source = resolve(args.model)
    except ModelNotFound as exc:
        raise UserError(str(exc)) from None
    _check_out(args.out)
    if (Path(source) / MANIFEST).exists():
        raise UserError(f"{args.model} is already converted; convert the original checkpoint")
    t0 = time.perf_counter()
    try:
        manifest = convert(
            Path(source), args.out, args.weight_dtype, args.expert_dtype, progress=not args.json
        )
    except (ConfigError, CheckpointError, ConvertError) as exc:
        raise UserError(str(exc)) from None
    size = (args.out / "model.safetensors").stat().st_size
    summary = {
        "out": str(args.out),
        "weight_dtype": manifest["weight_dtype"],
        "expert_dtype": manifest["expert_dtype"],
        "packed_matrices": len(manifest["tensors"]),
        "bytes": size,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(
            f"converted {args.model} -> {args.out} ({summary['weight_dtype']} weights, {summary['expert_dtype']} "
            f"experts, {size / 2**20:.1f} MiB) in {summary['seconds']:.1f} s; load it with --weight-dtype "
            f"{summary['weight_dtype']} --expert-dtype {summary['expert_dtype']}",
            file=sys.stderr,
        )
    return 0
