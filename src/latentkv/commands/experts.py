"""`latentkv experts convert|verify`: write a model's expert store; check every expert of one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from latentkv.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="experts", metavar="EXPERTS", required=True)
    c = sub.add_parser(
        "convert",
        help="write the routed experts as an expert store (one aligned extent per expert)",
        description="Write MODEL's routed experts as an expert store for --ram-gb runs: one 4 KiB-aligned "
        "extent per expert, a manifest with a checksum per expert (docs/expert-file-format.md). One "
        "expert is in memory at a time. Default folder: MODEL/experts when MODEL is a writable folder "
        "(--ram-gb looks there first), else the user cache (where --ram-gb looks next).",
    )
    c.add_argument("model", metavar="MODEL", help="model directory or builtin:NAME")
    c.add_argument("--out", type=Path, default=None, help="the store's folder (default: see above)")
    c.add_argument("--weight-dtype", default="f32", help="the experts' weight format (default: f32)")
    c.add_argument("--force", action="store_true", help="replace an existing store")
    c.add_argument(
        "--placement",
        type=Path,
        default=None,
        metavar="FILE",
        help="write one rank's share of the experts only (with --rank): FILE from `latentkv plan MODEL "
        "--nodes N --placement-out FILE` (docs/distributed.md); copied from this machine's full store when "
        "there is one, else converted from the checkpoint. Default folder: the user cache's share folder, "
        "where that rank looks first",
    )
    c.add_argument("--rank", type=int, default=None, help="with --placement: the rank whose share to write")
    v = sub.add_parser(
        "verify",
        help="read every expert of a store and check it",
        description="Read and check every expert extent; print the damaged ones by name. Exit 0 when "
        "all verify, 1 when any is damaged, 2 when the store cannot be opened.",
    )
    v.add_argument("store", metavar="DIR", type=Path, help="an expert store folder (holds manifest.json)")
    v.add_argument("--model", default=None, help="check the store belongs to this model too")
    v.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    return _convert(args) if args.experts == "convert" else _verify(args)


def _convert(args: argparse.Namespace) -> int:
    import os

    from latentkv.experts.store_file import ExpertFileError
    from latentkv.models.registry import ModelNotFound, resolve
    from latentkv.streaming.attach import default_store_dir
    from latentkv.streaming.convert import convert_experts

    if (args.placement is None) != (args.rank is None):
        raise UserError("--placement and --rank go together: the rank whose share of FILE to write")
    try:
        directory = resolve(args.model)
        if args.placement is not None:
            return _convert_share(args, directory)
        out = args.out
        if out is None:
            mine = not args.model.startswith("builtin:") and os.access(directory, os.W_OK)
            out = directory / "experts" if mine else default_store_dir(directory, args.weight_dtype)
        m = convert_experts(directory, out, args.weight_dtype, replace=args.force, progress=True)
    except (ModelNotFound, ExpertFileError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    mtp = " + the MTP layer" if "mtp_layer" in m.meta else ""
    print(
        f"wrote {out}: {len(m.layers) - bool(mtp)} MoE layers{mtp}, {m.expert_bytes / 2**30:.3f} GiB of experts",
        file=sys.stderr,
    )
    return 0


def _convert_share(args: argparse.Namespace, directory: Path) -> int:
    """`experts convert MODEL --placement FILE --rank R`: rank R's share only."""
    from latentkv.config import ModelConfig
    from latentkv.experts.placement import Placement
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer
    from latentkv.streaming.cluster_plan import moe_layer_ids
    from latentkv.streaming.shares import default_share_dir, write_share

    placement = Placement.load(args.placement)
    if not 0 <= args.rank < placement.nodes:
        raise UserError(f"--rank must be in 0..{placement.nodes - 1} for this placement (got {args.rank})")
    cfg = ModelConfig.from_hf(directory)
    layers = moe_layer_ids(cfg, routed_layer(cfg, Checkpoint(directory)))
    placement.check_layers({i: cfg.n_routed_experts for i in layers})
    share = placement.share(args.rank)
    if not share:
        raise UserError(f"rank {args.rank} owns no experts in this placement: it needs no share")
    out = args.out or default_share_dir(directory, args.weight_dtype, placement.digest, args.rank)
    m = write_share(
        directory, out, args.weight_dtype, placement, args.rank, replace=args.force, progress=True
    )
    print(
        f"wrote {out}: rank {args.rank}'s share of placement {placement.digest} "
        f"({sum(map(len, share.values()))} experts over {len(share)} layers, {m.expert_bytes / 2**30:.3f} GiB)",
        file=sys.stderr,
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from latentkv.experts.reader import ExpertReader
    from latentkv.experts.store_file import ExpertDamaged, ExpertFileError

    fingerprint = None
    try:
        if args.model is not None:
            from latentkv.models.loader import Checkpoint
            from latentkv.models.registry import resolve

            fingerprint = Checkpoint(resolve(args.model)).fingerprint()
        reader = ExpertReader(args.store, fingerprint)
    except (ExpertFileError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    damaged, checked = [], 0
    with reader:
        for layer, entry in sorted(reader.manifest.layers.items()):
            futures = [(e, reader.submit(layer, e)) for e in entry.held]
            for _e, f in futures:
                try:
                    f.result()
                except ExpertFileError as exc:  # ExpertDamaged, or a foreign layer file
                    damaged.append(str(exc))
                    if not isinstance(exc, ExpertDamaged):
                        break
                checked += 1
    report = {"store": str(args.store), "checked": checked, "damaged": damaged}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{checked} experts checked, {len(damaged)} damaged")
        for line in damaged:
            print(f"  {line}")
    return 1 if damaged else 0
