"""The expert store when its files misbehave: a layer file missing, a folder or a FIFO (never a hang),
removed between opening the store and reading it, failing with EIO; a manifest nested 100,000 deep
or with counts no model has; a usage history that is a FIFO or cannot be saved. Each is one line
naming the file (and, for a read, the expert), and a store put right is read again without a restart."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from faults import leftovers

from latentkv import fs
from latentkv.experts.reader import ExpertReader
from latentkv.experts.store_file import MANIFEST, ExpertFileError, ExpertUnreadable, read_manifest
from latentkv.experts.streamed import ExpertStreamer, StreamConfig
from latentkv.models.registry import builtin_path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    from latentkv.streaming.convert import convert_experts

    d = tmp_path_factory.mktemp("pristine") / "experts"
    convert_experts(builtin_path("fixture"), d, "f32")
    return d


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    d = tmp_path / "experts"
    shutil.copytree(pristine, d)
    return d


def _within(f, seconds: float = 20.0):
    """f() on a thread: what it returned or raised; a failure if it is still running after `seconds`."""
    out: list = []

    def run():
        try:
            out.append(f())
        except Exception as exc:  # noqa: BLE001 - returned for the test to look at
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "it hung"
    return out[0]


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo"])
def test_a_layer_file_that_is_not_a_file(store, kind):
    path = store / "layer-0002.lkx"
    path.unlink()
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    with ExpertReader(store) as r:
        got = _within(lambda: r.read(2, 5))
        assert r.read(1, 5).expert == 5  # the other layers still read
    assert isinstance(got, ExpertUnreadable)
    said = {
        "missing": "no such file or directory",
        "folder": "is a directory, not a regular file",
        "fifo": "is a FIFO, not a regular file",
    }
    assert str(got).startswith(f"model.layers.2.mlp.experts.5: {path}") and said[kind] in str(got)


def test_a_fifo_layer_file_is_one_line_for_verify_and_generate(store, cli, tmp_path):
    os.unlink(store / "layer-0003.lkx")
    os.mkfifo(store / "layer-0003.lkx")
    # a read of the FIFO would wait for ever; 240 s is a hang even on a loaded machine (where a
    # --ram-gb generate of the fixture has taken 53 s)
    verify = cli("experts", "verify", str(store), timeout=240)
    assert verify.code == 1 and "Traceback" not in verify.err
    assert "model.layers.3.mlp.experts.0:" in verify.out and "is a FIFO, not a regular file" in verify.out
    # the --ram-gb run finds its store beside the model, as MODEL/experts
    model = tmp_path / "model"
    shutil.copytree(builtin_path("fixture"), model)
    shutil.move(store, model / "experts")
    flags = ("--prompt-ids", "1,2,3", "--max-tokens", "4", "--ram-gb", "1")
    cli("generate", str(model), *flags, timeout=240).refused(
        "model.layers.3.mlp.experts.", "is a FIFO, not a regular file"
    )


def test_a_layer_file_removed_after_the_store_opened_then_put_back(store, tmp_path):
    streamer = ExpertStreamer(store, None, StreamConfig(budget=0, history=False))
    try:
        shutil.move(store / "layer-0001.lkx", tmp_path / "aside.lkx")
        with pytest.raises(ExpertUnreadable, match="model.layers.1.mlp.experts.3: .*no such file") as info:
            streamer.get(1, [3])
        assert "latentkv experts convert" in str(info.value)  # the repair
        assert streamer.snapshot()["store"]["degraded"]
        shutil.move(tmp_path / "aside.lkx", store / "layer-0001.lkx")
        assert sorted(streamer.get(1, [3])) == [3]  # opened again by path
        assert not streamer.snapshot()["store"]["degraded"]
    finally:
        streamer.close()


def test_an_io_error_while_reading_then_the_disk_recovers(store):
    streamer = ExpertStreamer(store, None, StreamConfig(budget=0, history=False))
    try:
        with fs.inject("read", store / "layer-0002.lkx", errno.EIO):
            with pytest.raises(ExpertUnreadable, match="input/output error"):
                streamer.get(2, [0, 1])
            assert [d["expert"] for d in streamer.snapshot()["store"]["damaged"]] != []
        streamer.health.recheck(streamer.reader.read, force=True)  # what /health's stats do
        assert streamer.snapshot()["store"] == {
            **streamer.snapshot()["store"],
            "degraded": False,
            "damaged": [],
        }
    finally:
        streamer.close()


def _reseal(store: Path, body: dict) -> None:
    import hashlib

    from latentkv.experts import store_file as sf

    check = hashlib.sha256(sf._canonical(body)).hexdigest()
    (store / MANIFEST).write_text(json.dumps({"manifest": body, "sha256": check}))


def test_a_manifest_nested_too_deep(store, inproc):
    (store / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ExpertFileError, match="nested 100000 levels deep"):
        read_manifest(store)
    inproc("experts", "verify", str(store)).refused(
        f"{store / MANIFEST} is not a readable manifest", "nested"
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda b: b["layers"][0].update(checks=["0" * 32] * (1 << 17)), "expert checks"),
        (
            lambda b: b["layers"][0]["layout"]["tensors"][0].update(shape=[1 << 40, 1 << 40]),
            "beyond any expert",
        ),
        (lambda b: b["layers"][0]["layout"]["tensors"][0].update(shape=[1] * 100), "at most 8 sizes"),
        (lambda b: b["layers"][0].update(layer=1 << 40), "is not in 0.."),
        (lambda b: b.update(layers=b["layers"] * 5000), "at most 8192"),
    ],
    ids=["checks", "huge-tensor", "many-dims", "layer-index", "layers"],
)
def test_a_manifest_with_counts_no_model_has(store, change, says):
    body = read_manifest(store).to_json()
    change(body)
    _reseal(store, body)
    with pytest.raises(ExpertFileError, match=says):
        read_manifest(store)


def test_a_usage_history_that_is_a_fifo_or_cannot_be_saved(store, tmp_path, read_only):
    os.mkfifo(store / "usage.json")
    streamer = _within(lambda: ExpertStreamer(store, None, StreamConfig(budget=0)))
    assert any("is a FIFO, not a regular file" in note for note in streamer.notes)
    streamer.close()  # saving replaces the FIFO with the history: a FIFO is never written into
    assert (store / "usage.json").is_file()
    ro = read_only(store)
    streamer = ExpertStreamer(ro, None, StreamConfig(budget=0))
    streamer.get(1, [0])
    streamer.close()  # the history cannot be saved: a note, not a failure
    assert any("read-only" in note and "without saving the usage history" in note for note in streamer.notes)
    assert "usage.json" in leftovers(store)
