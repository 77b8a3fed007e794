"""The expert store on disk: round trip, damage (every flip / truncation refused with the
expert's name), foreign files, O_DIRECT and the plain-pread fallback."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from latentkv import fs
from latentkv.experts import reader as reader_mod
from latentkv.experts.reader import ExpertReader
from latentkv.experts.store_file import (
    ALIGN,
    MANIFEST,
    TENSOR_ALIGN,
    ExpertDamaged,
    ExpertFileError,
    ExpertStoreWriter,
    ExtentLayout,
    read_manifest,
)

FP = "a" * 64
LAYERS = {1: 3, 3: 2}  # layer -> experts


def _layout(layer: int) -> ExtentLayout:
    # Odd sizes so tensors need padding inside the extent, and an extent that spans 4 KiB blocks.
    return ExtentLayout.pack(
        [
            ("gate.weight", "float32", (3 + layer, 37)),
            ("gate.scale", "bfloat16", (5,)),
            ("up.weight", "int8", (41, 29)),
            ("down.weight", "float32", (37, 7)),
        ],
        meta={"layer": layer},
    )


def _payload(layer: int, expert: int, layout: ExtentLayout) -> list[bytes]:
    rng = random.Random(layer * 1000 + expert)
    return [rng.randbytes(t.nbytes) for t in layout.tensors]


def _write(directory: Path, fingerprint: str = FP, **kw) -> dict:
    truth = {}
    with ExpertStoreWriter(directory, fingerprint, meta={"model": "test"}, **kw) as w:
        for layer, n in LAYERS.items():
            layout = _layout(layer)
            with w.layer(layer, n, layout) as lw:
                for e in range(n):
                    parts = _payload(layer, e, layout)
                    lw.write(e, parts)
                    truth[layer, e] = parts
        w.finish()
    return truth


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, dict]:
    d = tmp_path / "experts"
    return d, _write(d)


def _read_all(directory: Path, **kw) -> dict:
    out = {}
    with ExpertReader(directory, FP, **kw) as r:
        for layer, e in ((l, e) for l, n in LAYERS.items() for e in range(n)):
            try:
                ext = r.read(layer, e)
                out[layer, e] = [bytes(ext.view(t.name)) for t in ext.layout.tensors]
            except ExpertDamaged as exc:
                out[layer, e] = exc
    return out


def test_layout_offsets_are_aligned_and_extents_are_whole_blocks():
    layout = _layout(1)
    assert [t.offset % TENSOR_ALIGN for t in layout.tensors] == [0] * 4
    ends = [t.offset + t.nbytes for t in layout.tensors]
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout.tensors[1:], strict=False))
    assert layout.length == ends[-1]
    assert layout.stride % ALIGN == 0 and layout.stride >= layout.length


def test_round_trip_every_expert_and_the_manifest(store):
    directory, truth = store
    assert _read_all(directory) == truth
    m = read_manifest(directory, FP)
    assert sorted(m.layers) == sorted(LAYERS)
    entry = m.layers[3]
    assert entry.n_experts == 2 and entry.layout == _layout(3) and entry.layout.meta == {"layer": 3}
    assert os.path.getsize(directory / entry.file) == entry.file_bytes
    assert all(entry.offset(e) % ALIGN == 0 for e in range(entry.n_experts))
    assert m.expert_bytes == sum(_layout(l).length * n for l, n in LAYERS.items())
    assert m.meta == {"model": "test"}


def test_reads_on_the_pool_verify_like_direct_calls(store):
    directory, truth = store
    with ExpertReader(directory, FP, threads=3) as r:
        futures = [((l, e), r.submit(l, e)) for l, n in LAYERS.items() for e in range(n) for _ in range(3)]
        for (l, e), f in futures:
            ext = f.result()
            assert [bytes(ext.view(t.name)) for t in ext.layout.tensors] == truth[l, e]
        assert r.stats.reads == len(futures)
        assert r.stats.bytes_read == sum(_layout(l).stride for (l, _e), _f in futures)


def _flip(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("checksum", ["xxh3-128", "sha256-128"])
def test_each_checksum_is_the_spec_and_refuses_a_flip(tmp_path, checksum):
    """The manifest's checks are H(seed || "expert" || u32 layer || u32 expert || payload)[:16]
    with H its `checksum` (computed here from the spec, not by the writer); stores written with
    SHA-256 (before format 1.1) still read; a flipped bit is refused under either."""
    import hashlib
    import struct

    import xxhash

    d = tmp_path / "experts"
    truth = _write(d, checksum=checksum)
    manifest = read_manifest(d)
    assert manifest.checksum == checksum
    seed = hashlib.sha256(b"latentkv experts\0" + FP.encode()).digest()
    for (layer, e), parts in truth.items():
        layout = manifest.layers[layer].layout
        payload = bytearray(layout.length)
        for t, part in zip(layout.tensors, parts, strict=True):
            payload[t.offset : t.offset + t.nbytes] = part
        h = xxhash.xxh3_128() if checksum == "xxh3-128" else hashlib.sha256()
        for piece in (seed, b"expert", struct.pack("<II", layer, e), bytes(payload)):
            h.update(piece)
        assert manifest.layers[layer].checks[e] == h.digest()[:16].hex()
    assert _read_all(d) == truth
    entry = manifest.layers[3]
    _flip(d / entry.file, entry.offset(1) + 5, 2)
    assert isinstance(_read_all(d)[3, 1], ExpertDamaged)


def test_an_unknown_checksum_is_refused(tmp_path):
    from latentkv.experts.store_file import Manifest

    d = tmp_path / "experts"
    _write(d)
    body = json.loads((d / MANIFEST).read_text())["manifest"]
    body["checksum"] = "crc32"
    with pytest.raises(ExpertFileError, match="unknown checksum 'crc32'"):
        Manifest.from_json(body)
    with pytest.raises(ValueError, match="unknown extent checksum"):
        ExpertStoreWriter(tmp_path / "other", FP, checksum="md5")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_flipped_bit_in_an_extent_refuses_that_expert_by_name(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("flip") / "experts"
    truth = _write(directory)
    layer = data.draw(st.sampled_from(sorted(LAYERS)))
    entry = read_manifest(directory).layers[layer]
    expert = data.draw(st.integers(0, entry.n_experts - 1))
    pos = data.draw(st.integers(0, entry.layout.length - 1))
    _flip(directory / entry.file, entry.offset(expert) + pos, data.draw(st.integers(0, 7)))
    got = _read_all(directory)
    exc = got.pop((layer, expert))
    assert isinstance(exc, ExpertDamaged)
    assert f"model.layers.{layer}.mlp.experts.{expert}" in str(exc) and "checksum" in str(exc)
    truth.pop((layer, expert))
    assert got == truth  # every other expert still reads, unchanged


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_truncated_layer_file_refuses_exactly_the_experts_it_cut(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("trunc") / "experts"
    truth = _write(directory)
    layer = data.draw(st.sampled_from(sorted(LAYERS)))
    entry = read_manifest(directory).layers[layer]
    size = data.draw(st.integers(ALIGN, entry.file_bytes - 1))
    os.truncate(directory / entry.file, size)
    got = _read_all(directory)
    for e in range(entry.n_experts):
        intact = entry.offset(e) + entry.layout.length <= size
        if intact:
            assert got[layer, e] == truth[layer, e]
        else:
            assert isinstance(got[layer, e], ExpertDamaged)
            assert f"model.layers.{layer}.mlp.experts.{e}" in str(got[layer, e])


def test_a_layer_file_cut_inside_its_header_is_refused(store):
    directory, _ = store
    entry = read_manifest(directory).layers[1]
    os.truncate(directory / entry.file, 10)
    with ExpertReader(directory, FP) as r, pytest.raises(ExpertFileError, match="too short|not a version"):
        r.read(1, 0)


def test_the_wrong_fingerprint_is_refused(store, tmp_path):
    directory, _ = store
    with pytest.raises(ExpertFileError, match="another model"):
        ExpertReader(directory, "b" * 64)
    # A layer file of another model's store (same shapes) swapped in is refused too.
    other = tmp_path / "other"
    _write(other, fingerprint="c" * 64)
    entry = read_manifest(directory).layers[3]
    shutil.copy(other / entry.file, directory / entry.file)
    with ExpertReader(directory, FP) as r, pytest.raises(ExpertFileError, match="another model"):
        r.read(3, 0)


def test_an_extent_moved_to_another_slot_is_refused(store):
    directory, _ = store
    entry = read_manifest(directory).layers[1]
    path = directory / entry.file
    data = bytearray(path.read_bytes())
    a, b, stride = entry.offset(0), entry.offset(1), entry.layout.stride
    data[a : a + stride], data[b : b + stride] = data[b : b + stride], data[a : a + stride]
    path.write_bytes(bytes(data))
    got = _read_all(directory)
    assert isinstance(got[1, 0], ExpertDamaged) and isinstance(got[1, 1], ExpertDamaged)


def test_a_damaged_or_missing_manifest_is_refused(store):
    directory, _ = store
    path = directory / MANIFEST
    outer = json.loads(path.read_text())
    outer["manifest"]["layers"][0]["checks"][0] = "0" * 32
    path.write_text(json.dumps(outer))
    with pytest.raises(ExpertFileError, match="fails its checksum"):
        read_manifest(directory)
    path.write_text("{not json")
    with pytest.raises(ExpertFileError, match="not a readable manifest"):
        read_manifest(directory)
    path.unlink()
    with pytest.raises(ExpertFileError, match="missing"):
        read_manifest(directory)


def test_a_newer_major_version_is_refused_with_advice(store):
    directory, _ = store
    from latentkv.experts import store_file as sf

    m = read_manifest(directory)
    body = m.to_json()
    body["version"] = [max(sf.KNOWN_MAJORS) + 1, 0]
    check = __import__("hashlib").sha256(sf._canonical(body)).hexdigest()
    (directory / MANIFEST).write_text(json.dumps({"manifest": body, "sha256": check}))
    with pytest.raises(ExpertFileError, match="upgrade latentkv"):
        read_manifest(directory)


def test_an_interrupted_rewrite_leaves_the_old_store_whole(tmp_path):
    d = tmp_path / "experts"
    truth = _write(d)
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(ExpertFileError, match="refusing to overwrite"):
        ExpertStoreWriter(d, FP)
    w = ExpertStoreWriter(d, FP, replace=True)
    with w.layer(1, 3, _layout(1)) as lw:
        for e in range(3):
            lw.write(e, _payload(1, e, _layout(1)))
    # no finish(), no abort(): the process died here, its new layer file still under a temporary name
    assert any(p.name.startswith(".layer-0001.lkx.") for p in d.iterdir())
    with ExpertReader(d) as r:  # the old store, as it was
        assert bytes(r.read(1, 2).view("up.weight")) == truth[1, 2][2]
    w._unlock()  # (the dead process's lock goes with it)
    ExpertStoreWriter(d, FP, replace=True).abort()  # the next writer sweeps what the dead one left
    assert sorted(p.name for p in d.iterdir()) == before


def test_a_failed_conversion_removes_what_it_wrote(tmp_path):
    d = tmp_path / "experts"
    with pytest.raises(RuntimeError, match="boom"), ExpertStoreWriter(d, FP) as w:
        with w.layer(1, 3, _layout(1)) as lw:
            for e in range(3):
                lw.write(e, _payload(1, e, _layout(1)))
        with w.layer(3, 2, _layout(3)) as lw:
            lw.write(0, _payload(3, 0, _layout(3)))
            raise RuntimeError("boom")
    assert not d.exists()  # the folder it made, gone with what it wrote
    with pytest.raises(ExpertFileError, match="missing"):
        read_manifest(d)


def test_one_writer_per_folder(tmp_path):
    with ExpertStoreWriter(tmp_path, FP), pytest.raises(ExpertFileError, match="another process is writing"):
        ExpertStoreWriter(tmp_path, FP)
    ExpertStoreWriter(tmp_path, FP).abort()  # free again


def test_experts_are_written_in_order_with_their_layout_sizes(tmp_path):
    w = ExpertStoreWriter(tmp_path, FP)
    with w.layer(1, 3, _layout(1)) as lw:
        with pytest.raises(ValueError, match="in order"):
            lw.write(1, _payload(1, 1, _layout(1)))
        with pytest.raises(ValueError, match="layout says"):
            lw.write(0, [b"x"] * 4)
        for e in range(3):
            lw.write(e, _payload(1, e, _layout(1)))


def test_a_layer_with_missing_experts_is_not_recorded(tmp_path):
    w = ExpertStoreWriter(tmp_path, FP)
    with pytest.raises(ValueError, match="1 of 3 experts"), w.layer(1, 3, _layout(1)) as lw:
        lw.write(0, _payload(1, 0, _layout(1)))
    assert w.layers == {}


def _direct_supported(path: Path) -> bool:
    if not reader_mod.O_DIRECT:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | reader_mod.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def test_o_direct_path_reads_and_verifies(store):
    directory, truth = store
    entry_file = directory / read_manifest(directory).layers[1].file
    if not _direct_supported(entry_file):
        pytest.skip(f"the file system under {directory} refuses O_DIRECT")
    with ExpertReader(directory, FP, direct=True) as r:
        ext = r.read(1, 2)
        assert [bytes(ext.view(t.name)) for t in ext.layout.tensors] == truth[1, 2]
        assert r.uses_direct(1) and r.stats.direct_reads == 1


def test_plain_pread_fallback_reads_and_drops_the_cache(store, monkeypatch):
    directory, truth = store
    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, off, n, adv: (dropped.append((off, n, adv)), real(fd, off, n, adv))
    )
    assert _read_all(directory, direct=False) == truth
    with ExpertReader(directory, FP, direct=False) as r:
        r.read(3, 1)
        entry = r.entry(3)
        assert not r.uses_direct(3) and r.stats.direct_reads == 0
    assert (entry.offset(1), entry.layout.stride, os.POSIX_FADV_DONTNEED) in dropped


def test_o_direct_refused_at_read_time_falls_back_once(store):
    directory, truth = store
    with ExpertReader(directory, FP, direct=None) as r:
        f = r._file(1)
        if f.direct_fd is None:
            pytest.skip("no O_DIRECT here: nothing to fall back from")
        with fs.inject("direct_read", directory, errno.EINVAL) as fault:
            ext = r.read(1, 0)
            assert [bytes(ext.view(t.name)) for t in ext.layout.tensors] == truth[1, 0]
            r.read(1, 1)
        assert fault.hits == 1 and not r.uses_direct(1) and "EINVAL" in r.notes[0]


def test_read_buffers_are_reused_only_once_nothing_views_them(store):
    """A buffer comes back from the pool only when no tensor, extent or view refers to it: an
    expert still in use keeps its bytes however many reads follow; at most SPARE_BUFFERS free
    ones stay mapped."""
    import torch

    from latentkv.experts.reader import SPARE_BUFFERS

    d, truth = store
    with ExpertReader(d, FP) as r:
        ext = r.read(1, 0)
        held = torch.frombuffer(ext.buffer, dtype=torch.uint8)[:64].clone()
        view = torch.frombuffer(ext.buffer, dtype=torch.uint8, count=64)
        del ext
        for _ in range(6):
            for e in (1, 2):
                r.read(1, e)  # dropped at once: their buffers are free for the next read
        assert torch.equal(view, held)  # the viewed buffer was never handed out again
        assert r.buffers.reused >= 10 and r.buffers.mapped <= 3
        del view
        many = [r.read(1, e % 3) for e in range(8)]
        del many
        r.read(1, 0)
        stride = read_manifest(d).layers[1].layout.stride
        assert r.buffers.held_bytes <= (SPARE_BUFFERS + 1) * stride
