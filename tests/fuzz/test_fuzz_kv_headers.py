"""KV files with valid checksums and impossible contents (issue 13, class 7), by hand and by
hypothesis: header fields set to anything (types, ranges, codec params that contradict the
tier, widths that contradict the model), commit counts up to 2**64 - 1, sparse tails, every
checksum recomputed (kvcraft). Whatever the header says:

- opening and loading returns a verified prefix or raises KVFileError, nothing else, and never
  allocates from a count the records do not back (peak traced memory bounded);
- what opens also becomes a cache (`kv inspect` never calls loadable what `generate` refuses);
- `inspect` never raises; a session resume refuses the file by moving it aside byte for byte;
- each case ends within seconds (no hang).
"""

from __future__ import annotations

import copy
import os
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from budget import long, quick
from hypothesis import given
from hypothesis import strategies as st
from kvcraft import craft, payloads_of, split

from latentkv.config import CacheConfig
from latentkv.kv.cache import CacheLayout, resolve_tier
from latentkv.kv.store import KVFile, KVMismatch, codec_spec_of, inspect
from latentkv.kv.store_header import KVFileError, KVHeader, ModelFingerprint
from latentkv.kv.store_session import Session

LAYOUT = CacheLayout(
    num_layers=2,
    row_width=40,
    kv_lora_rank=32,
    index_layers=(0,),
    index_head_dim=8,
    device=torch.device("cpu"),
)
MODEL = ModelFingerprint("glm_moe_dsa", 2, 32, 8, (0,), 8, 256, "ab" * 32)
TOKENS = 12
SECONDS_PER_CASE = 20  # generous for a loaded 2-core machine; a hang takes forever
PEAK_BYTES = 64 << 20  # what loading may allocate at most, whatever the header claims


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[bytes, KVHeader]:
    """A tq4 file of 12 records (two appends) and the header that writes it."""
    cache = resolve_tier(LAYOUT, CacheConfig("tq4")).make_cache()
    header = KVHeader(MODEL, codec_spec_of(cache), (0, 1))
    path = tmp_path_factory.mktemp("craft") / "original.kv"
    g = torch.Generator().manual_seed(0)
    with KVFile.create(path, header) as f:
        for n in (7, 5):
            start = cache.length
            for layer in range(2):
                cache.append(layer, torch.randn(n, 40, generator=g))
            cache.append_index_keys(0, torch.randn(n, 8, generator=g))
            cache.commit(start + n)
            f.append([(3 * i + 5) % 256 for i in range(start, start + n)], cache, start, start + n)
    return path.read_bytes(), header


def _rebuild(data: bytes, edit=None, count: int | None = None, record: int | None = None) -> bytes:
    header, R, D, committed = split(data)
    header = copy.deepcopy(header)
    if edit is not None:
        edit(header)
    return craft(header, payloads_of(data, R, D), record or R, committed if count is None else count)


def test_the_crafting_itself_round_trips(original, tmp_path):
    """Unchanged, a crafted file loads exactly as the original (the checksums are right)."""
    data, _ = original
    path = tmp_path / "same.kv"
    path.write_bytes(_rebuild(data))
    with KVFile.open(path) as f:
        assert len(f.load().tokens) == TOKENS


def test_a_tq4_file_whose_params_name_f32_is_refused_everywhere_and_kept(original, tmp_path):
    """The issue's example: `kv inspect` called it loadable, then `generate` raised."""
    data, header = original

    def f32_params(h):
        h["codec"]["c"]["params"]["name"] = "f32"

    crafted = _rebuild(data, f32_params)
    path = tmp_path / "s.kv"
    path.write_bytes(crafted)
    with pytest.raises(KVFileError, match="header field codec.c"):
        KVFile.open(path)
    info = inspect(path)
    assert info["verifies"] is False and info["error"].startswith("not loadable: header field codec.c")
    session, cache = Session.resume(path, header, resolve_tier(LAYOUT, CacheConfig("tq4")))
    session.close()
    assert session.moved_to is not None and session.moved_to.read_bytes() == crafted  # kept aside
    assert cache.length == 0 and "cannot be read" in session.notes[0]


def test_kv_inspect_says_not_loadable_with_exit_1(original, tmp_path, capsys):
    from latentkv.cli import main

    data, _ = original
    path = tmp_path / "w.kv"
    path.write_bytes(_rebuild(data, lambda h: h["codec"]["r"]["params"].update(width=9)))
    assert main(["kv", "inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert "not loadable: header field codec.r" in out and "Traceback" not in out


def test_a_commit_count_of_2_40_over_a_sparse_tail_allocates_nothing(original, tmp_path):
    data, _ = original
    path = tmp_path / "sparse.kv"
    path.write_bytes(_rebuild(data, count=1 << 40))
    os.truncate(path, len(data) + (8 << 30))  # 8 GiB of holes after the records
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with KVFile.open(path) as f:
            result = f.load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(result.tokens) == TOKENS  # the real records, then the holes fail their check
    assert any("fails its checksum" in note for note in result.notes)
    assert peak < PEAK_BYTES and time.monotonic() - t0 < SECONDS_PER_CASE


# --- the fuzzer ------------------------------------------------------------------------------------

FIELDS = [
    ("codec", "tier"),
    ("codec", "revision"),
    ("codec", "c", "params", "name"),
    ("codec", "c", "params", "width"),
    ("codec", "c", "params", "bits"),
    ("codec", "c", "params", "rotation_seed"),
    ("codec", "c", "params", "group_size"),
    ("codec", "c", "code_bytes"),
    ("codec", "c", "scale_count"),
    ("codec", "r", "params", "name"),
    ("codec", "r", "params", "width"),
    ("codec", "r", "code_bytes"),
    ("codec", "r", "scale_count"),
    ("model", "num_layers"),
    ("model", "kv_lora_rank"),
    ("model", "qk_rope_head_dim"),
    ("model", "index_layers"),
    ("model", "index_head_dim"),
    ("model", "vocab_size"),
    ("layers",),
]
TIERS = ["f32", "bf16", "fp8", "tq2", "tq4", "tq6", "polar3", "polar4", "tq4-r8", "tq3-r16", "int3", ""]
VALUES = st.one_of(
    st.sampled_from(
        [0, 1, -1, 2, 3, 4, 7, 8, 9, 16, 20, 31, 32, 33, 40, 64, 255, 256, 2**31, 2**32, 2**63, 2**64]
    ),
    st.integers(-(2**70), 2**70),
    st.sampled_from(TIERS),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(-1, 5), max_size=5),
    st.dictionaries(st.sampled_from(["name", "width", "bits"]), st.integers(0, 64), max_size=2),
)
COUNTS = st.one_of(
    st.none(), st.sampled_from([0, 1, 11, 12, 13, 1 << 40, 2**64 - 1]), st.integers(0, 2**64 - 1)
)


def _set(header: dict, path: tuple[str, ...], value) -> None:
    node = header
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@st.composite
def crafts(draw):
    """(edits, commit count or None, whether records take the new header's size): small, so a
    failing case prints readably; the bytes are built from it (`_build`)."""
    edits = draw(st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=3))
    return edits, draw(COUNTS), draw(st.booleans())


def _build(data: bytes, edits, count, resize: bool) -> bytes:
    import json

    header, R, _, _ = split(data)

    def edit(h):
        for path, value in edits:
            _set(h, path, value)

    new_header = copy.deepcopy(header)
    edit(new_header)
    record = R
    if resize:  # the size the new header's fields give, when they give one
        try:
            record = KVHeader.from_json(json.dumps(new_header).encode()).record_layout().size
        except Exception:  # noqa: BLE001 - a header the reader refuses: keep R
            record = R
    return _rebuild(data, edit, count, record)


def _one_case(original, tmp: Path, crafted: bytes, sparse: int) -> None:
    data, header = original
    path = tmp / "f.kv"
    path.write_bytes(crafted)
    if sparse:
        os.truncate(path, len(crafted) + sparse)
    t0 = time.monotonic()
    tracemalloc.start()
    try:
        try:
            with KVFile.open(path) as f:
                result = f.load()
                cache = result.to_cache(result.own_tier(torch.device("cpu")))  # what opens also loads
                assert cache.length == len(result.tokens) <= TOKENS
                assert all(0 <= t < f.header.model.vocab_size for t in result.tokens)
        except KVFileError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, peak
    info = inspect(path)  # never raises
    if "error" not in info:  # what inspect calls readable loads, or is refused by a named verdict
        with KVFile.open(path) as f:
            try:
                result = f.load()
                result.to_cache(result.own_tier(torch.device("cpu")))
            except KVMismatch as exc:  # another codec revision: a verdict that names it
                assert "revision" in exc.verdict.message
    size = path.stat().st_size
    session, _ = Session.resume(
        path, header, resolve_tier(LAYOUT, CacheConfig("tq4"))
    )  # never raises on a bad file
    session.close()
    if session.moved_to is not None:  # refused files are kept aside byte for byte
        moved = session.moved_to
        assert moved.stat().st_size == size and moved.open("rb").read(len(crafted)) == crafted
        moved.unlink()
    path.unlink()
    assert time.monotonic() - t0 < SECONDS_PER_CASE


def _fuzz(original, tmp_path_factory, data) -> None:
    crafted = _build(original[0], *data.draw(crafts()))
    sparse = data.draw(st.sampled_from([0, 0, 0, 1 << 20, 1 << 33]))  # holes: 1 MiB, 8 GiB
    _one_case(original, tmp_path_factory.mktemp("case"), crafted, sparse)


@quick()
@given(data=st.data())
def test_crafted_headers_load_a_verified_prefix_or_refuse(original, tmp_path_factory, data):
    _fuzz(original, tmp_path_factory, data)


@pytest.mark.slow
@long()
@given(data=st.data())
def test_crafted_headers_long(original, tmp_path_factory, data):
    _fuzz(original, tmp_path_factory, data)
