"""One rank's share of a model's experts on its own disk (docs/distributed.md).

    store = ensure_share(model_dir, "int4", placement, rank)   # found, copied or converted

A rank reads its experts from, in this order: a share of this placement for this rank (the
folder `latentkv experts convert --placement FILE --rank R` writes by default), else the model's
full store when this machine has one (it then reads only its own experts from it), else a share
written now: copied from a full store, or converted from the checkpoint, its experts only.
"""

from __future__ import annotations

from pathlib import Path

from latentkv.experts.placement import Placement
from latentkv.experts.share import copy_share, share_meta, share_of
from latentkv.experts.store_file import MANIFEST, ExpertFileError, read_manifest


def default_share_dir(model_dir: str | Path, weight_format: str, placement: str, rank: int) -> Path:
    """Where rank `rank`'s share of the placement named `placement` (its digest) lives by default:
    under the user's cache, beside the full stores."""
    from latentkv.config import cache_root
    from latentkv.models.loader import Checkpoint

    name = f"{Checkpoint(model_dir).fingerprint()[:16]}-{weight_format}-{placement}-rank{rank}"
    return cache_root() / "experts" / name


def full_store(model_dir: str | Path, weight_format: str) -> Path | None:
    """The model's full expert store on this machine (MODEL/experts or the user cache's), if any."""
    from latentkv.streaming.attach import default_store_dir

    store = default_store_dir(model_dir, weight_format)
    return store if (store / MANIFEST).exists() else None


def check_share(store: Path, placement: Placement, rank: int, fingerprint: str) -> None:
    """Refuse a share of another placement or rank (or a store of another model)."""
    manifest = read_manifest(store, fingerprint)
    got = share_of(manifest)
    want = {"rank": rank, "nodes": placement.nodes, "placement": placement.digest}
    if got is not None and got != want:
        raise ExpertFileError(
            f"the expert store at {store} is rank {got.get('rank')}'s share of placement "
            f"{got.get('placement')} ({got.get('nodes')} ranks); this rank is rank {rank} of placement "
            f"{placement.digest} ({placement.nodes} ranks): write its share with `latentkv experts convert "
            f"MODEL --placement FILE --rank {rank}`"
        )
    if got is None and manifest.is_share:
        raise ExpertFileError(f"the expert store at {store} is a share without its placement record")


def write_share(
    model_dir: str | Path,
    out: Path,
    weight_format: str,
    placement: Placement,
    rank: int,
    replace: bool = False,
    progress: bool = False,
):
    """Write rank `rank`'s share at `out`: copied from the full store when this machine has one,
    else converted from the checkpoint. Returns the manifest."""
    from latentkv.streaming.convert import convert_experts

    share = placement.share(rank)
    meta = share_meta(rank, placement.nodes, placement.digest, placement.to_json())
    source = full_store(model_dir, weight_format)
    if source is not None:
        return copy_share(source, out, share, meta, replace=replace, progress=progress)
    return convert_experts(model_dir, out, weight_format, replace, progress, share=share, extra_meta=meta)


def ensure_share(
    model_dir: str | Path, weight_format: str, placement: Placement, rank: int, progress: bool = False
) -> Path:
    """The store rank `rank` reads its experts from (see the module docstring)."""
    share = default_share_dir(model_dir, weight_format, placement.digest, rank)
    if (share / MANIFEST).exists():
        return share
    source = full_store(model_dir, weight_format)
    if source is not None:
        return source
    write_share(model_dir, share, weight_format, placement, rank, replace=True, progress=progress)
    return share
