"""A share of an expert store (one rank's experts of each layer): written by id, read by id, each
extent with the same check as in the full store, refused when asked for an expert it does not
hold, and refused whole by a reader that knows only full stores (format 2 vs 1)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from latentkv.cli import main
from latentkv.experts import store_file as sf
from latentkv.experts.placement import Placement
from latentkv.experts.reader import ExpertReader
from latentkv.experts.share import copy_share, share_meta, share_of
from latentkv.experts.store_file import (
    ALIGN,
    MANIFEST,
    ExpertFileError,
    ExpertStoreWriter,
    ExtentLayout,
    read_manifest,
)

FP = "b" * 64
E = 6


def _layout() -> ExtentLayout:
    return ExtentLayout.pack([("w", "float32", (33, 17)), ("s", "bfloat16", (9,))])


def _parts(layer: int, e: int) -> list[bytes]:
    return [bytes([(layer * 31 + e * 7 + i) % 251 for i in range(t.nbytes)]) for t in _layout().tensors]


def _write_full(d):
    with ExpertStoreWriter(d, FP) as w:
        for layer in (2, 5):
            with w.layer(layer, E, _layout()) as lw:
                for e in range(E):
                    lw.write(e, _parts(layer, e))
        return w.finish()


def test_a_written_share_reads_by_expert_id(tmp_path):
    d = tmp_path / "share"
    ids = {2: (1, 4), 5: (0, 3, 5)}
    with ExpertStoreWriter(d, FP, meta=share_meta(1, 2, "abc")) as w:
        for layer, held in ids.items():
            with w.layer(layer, E, _layout(), held) as lw:
                with pytest.raises(ValueError, match="in order"):
                    lw.write(held[-1], _parts(layer, held[-1]))
                for e in held:
                    lw.write(e, _parts(layer, e))
        m = w.finish()
    assert m.is_share and share_of(m) == {"rank": 1, "nodes": 2, "placement": "abc"}
    raw = json.loads((d / MANIFEST).read_text())["manifest"]
    assert (
        raw["version"] == [2, 0] and raw["layers"][1]["ids"] == [0, 3, 5] and raw["layers"][1]["total"] == E
    )
    entry = read_manifest(d, FP).layers[5]
    assert entry.n_experts == E and entry.held == (0, 3, 5)
    assert os.path.getsize(d / entry.file) == ALIGN + 3 * _layout().stride
    with ExpertReader(d, FP) as r:
        for layer, held in ids.items():
            for e in held:
                ext = r.read(layer, e)
                assert [bytes(ext.view(t.name)) for t in ext.layout.tensors] == _parts(layer, e)
        with pytest.raises(ExpertFileError, match=r"experts\.2: not in the expert store"):
            r.read(2, 2)


def test_copy_share_keeps_each_experts_bytes_and_check(tmp_path):
    full = _write_full(tmp_path / "full")
    share = copy_share(tmp_path / "full", tmp_path / "share", {2: [5, 0], 5: [3]}, share_meta(0, 3, "d1"))
    for layer, e in ((2, 0), (2, 5), (5, 3)):
        assert share.layers[layer].check(e) == full.layers[layer].check(e)
    with ExpertReader(tmp_path / "share", FP) as r:
        assert [bytes(r.read(2, 5).view(t.name)) for t in _layout().tensors] == _parts(2, 5)


def _rewrite(d, body: dict) -> None:
    check = hashlib.sha256(sf._canonical(body)).hexdigest()
    (d / MANIFEST).write_text(json.dumps({"manifest": body, "sha256": check}))


def test_versions_and_ids_must_agree(tmp_path, monkeypatch):
    _write_full(tmp_path / "full")
    copy_share(tmp_path / "full", tmp_path / "share", {2: [1]}, share_meta(0, 2, "x"))
    body = json.loads((tmp_path / "share" / MANIFEST).read_text())["manifest"]
    # a reader that knows only full stores refuses a share whole, with advice
    monkeypatch.setattr(sf, "KNOWN_MAJORS", (1,))
    with pytest.raises(ExpertFileError, match="upgrade latentkv"):
        read_manifest(tmp_path / "share")
    monkeypatch.undo()
    wrong = dict(body, version=[1, 1])
    _rewrite(tmp_path / "share", wrong)
    with pytest.raises(ExpertFileError, match="with expert ids"):
        read_manifest(tmp_path / "share")
    unsorted = json.loads(json.dumps(body))
    unsorted["layers"][0]["ids"] = [7]
    _rewrite(tmp_path / "share", unsorted)
    with pytest.raises(ExpertFileError, match="ascending ids below"):
        read_manifest(tmp_path / "share")


def test_plan_nodes_and_convert_one_ranks_share(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    placement = tmp_path / "p.json"
    args = ["plan", "builtin:fixture", "--nodes", "3", "--ram-gb", "0.6,0.55,0.55", "--max-model-len", "64"]
    assert main([*args, "--disk-gbps", "1,2,1", "--placement-out", str(placement), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    p = Placement.load(placement)
    assert plan["placement"]["digest"] == p.digest and plan["fits"]
    assert [r["experts"] for r in plan["ranks"]] == p.counts() and sum(p.counts()) == 4 * 8
    assert [r["role"] for r in plan["ranks"]] == ["head", "worker", "worker"]
    assert plan["ranks"][1]["disk_gbps"] == 2.0
    assert main(["experts", "convert", "builtin:fixture", "--placement", str(placement), "--rank", "2"]) == 0
    (store,) = (tmp_path / "cache" / "experts").glob(f"*-f32-{p.digest}-rank2")
    m = read_manifest(store)
    assert {layer: list(e.held) for layer, e in m.layers.items()} == p.share(2)
    assert share_of(m) == {"rank": 2, "nodes": 3, "placement": p.digest}
    assert main(["experts", "verify", str(store), "--model", "builtin:fixture"]) == 0
    capsys.readouterr()
    # bad flags: one line, exit 2
    for bad in (
        [*args, "--ram-gb", "1,2"],
        ["plan", "builtin:fixture", "--disk-gbps", "2,3"],  # one machine: one speed
        ["plan", "builtin:fixture", "--nodes", "0", "--ram-gb", "1"],
        ["plan", "builtin:fixture", "--nodes", "2"],
        ["experts", "convert", "builtin:fixture", "--rank", "1"],
        ["experts", "convert", "builtin:fixture", "--placement", str(placement), "--rank", "3"],
        ["experts", "convert", "builtin:tiny", "--placement", str(placement), "--rank", "1"],
    ):
        assert main(bad) == 2, bad
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error" in err, (bad, err)


def test_a_rank_finds_its_share_or_the_full_store_and_refuses_another_ranks(tmp_path, monkeypatch):
    from latentkv.experts.placement import Rank, place
    from latentkv.models.loader import Checkpoint
    from latentkv.models.registry import resolve
    from latentkv.streaming.shares import check_share, default_share_dir, ensure_share, write_share

    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    model = resolve("builtin:tiny")
    fp = Checkpoint(model).fingerprint()
    layers = {layer: 8 for layer in read_manifest_layers(model)}
    p = place(layers, 1 << 16, [Rank(0), Rank(0)])
    # no store on this machine: the share is converted from the checkpoint, its experts only
    store = ensure_share(model, "f32", p, 1)
    assert store == default_share_dir(model, "f32", p.digest, 1)
    assert {k: list(v.held) for k, v in read_manifest(store).layers.items()} == p.share(1)
    check_share(store, p, 1, fp)
    with pytest.raises(ExpertFileError, match="rank 1's share of placement"):
        check_share(store, p, 0, fp)
    write_share(model, tmp_path / "other", "f32", p, 0)
    with pytest.raises(ExpertFileError, match="this rank is rank 1"):
        check_share(tmp_path / "other", p, 1, fp)


def read_manifest_layers(model) -> list[int]:
    from latentkv.config import ModelConfig
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer
    from latentkv.streaming.cluster_plan import moe_layer_ids

    cfg = ModelConfig.from_hf(model)
    return moe_layer_ids(cfg, routed_layer(cfg, Checkpoint(model)))
