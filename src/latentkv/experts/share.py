"""One rank's share of an expert store: some experts of each layer, copied verbatim from a full
store (each extent verified as read, written with its own check again) or, from a checkpoint,
by `latentkv.streaming.convert` (docs/distributed.md, docs/expert-file-format.md "Shares").

    copy_share(full_store_dir, out_dir, {3: [0, 4, 9], 5: [...]}, meta={"share": {...}})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from latentkv.experts.reader import ExpertReader
from latentkv.experts.store_file import ExpertFileError, ExpertStoreWriter, Manifest

SHARE_META = "share"  # the manifest meta key: {"rank": R, "nodes": N, "placement": digest}


def share_meta(rank: int, nodes: int, placement: str, owners: dict | None = None) -> dict:
    """The manifest meta of rank `rank`'s share of the placement named `placement`; `owners`
    (the whole placement, `Placement.to_json()`) lets a head adopt the placement a share was
    written for."""
    meta: dict = {SHARE_META: {"rank": rank, "nodes": nodes, "placement": placement}}
    if owners is not None:
        meta["placement"] = owners
    return meta


def share_of(manifest: Manifest) -> dict | None:
    """The share a store holds ({"rank", "nodes", "placement"}), or None for a full store."""
    meta = manifest.meta.get(SHARE_META)
    return dict(meta) if manifest.is_share and isinstance(meta, dict) else None


def copy_share(
    source: str | Path,
    out: str | Path,
    share: Mapping[int, Sequence[int]],
    meta: dict | None = None,
    replace: bool = False,
    progress: bool = False,
) -> Manifest:
    """Write the experts `share` (layer -> ids) of the store at `source` as a share store at `out`."""
    bar = None
    with ExpertReader(source, direct=None, threads=2) as reader:
        src = reader.manifest
        missing = [layer for layer in share if layer not in src.layers]
        if missing:
            raise ExpertFileError(f"the expert store at {source} has no layer {missing[0]}")
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=sum(len(v) for v in share.values()), desc="copying experts", unit="expert", leave=False
            )
        body = {**src.meta, **(meta or {})}
        with ExpertStoreWriter(out, src.fingerprint, meta=body, replace=replace, checksum=src.checksum) as w:
            for layer, ids in sorted(share.items()):
                entry = src.layers[layer]
                ids = sorted(ids)
                if not ids:
                    continue
                with w.layer(layer, entry.n_experts, entry.layout, tuple(ids)) as lw:
                    for e in ids:
                        ext = reader.read(layer, e)
                        lw.write(e, [ext.view(t.name) for t in entry.layout.tensors])
                        if bar is not None:
                            bar.update(1)
            manifest = w.finish()
    if bar is not None:
        bar.close()
    return manifest
