"""Damage, by hypothesis: truncations, byte flips and trailing garbage anywhere in a KV file.

Whatever is done to the bytes, opening and loading either returns a verified prefix (every
returned record, token and cache tensor equal to what was written) or raises KVFileError
with a message; never another exception, never a wrong row. When the header and commit area
are intact the prefix is exact: everything before the first damaged record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings  # a dev dependency: missing must fail
from hypothesis import strategies as st

from latentkv.config import CacheConfig
from latentkv.kv.cache import CacheLayout, resolve_tier
from latentkv.kv.store import KVFile, codec_spec_of
from latentkv.kv.store_file import BLOCK, PREFIX, RecordFile
from latentkv.kv.store_header import KVFileError, KVHeader, ModelFingerprint

LAYOUT = CacheLayout(
    num_layers=2,
    row_width=40,
    kv_lora_rank=32,
    index_layers=(0,),
    index_head_dim=8,
    device=torch.device("cpu"),
)
TURNS = (4, 5, 3)  # records per append: three commits, so the older commit slot holds 9
CASES = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Original:
    data: bytes  # the file's bytes
    tokens: list[int]
    state: dict[str, torch.Tensor]
    header_end: int  # bytes covered by the header checksum
    data_offset: int
    record: int  # R
    payload: int  # R minus the check


def _fill(cache, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYOUT.num_layers):
        cache.append(layer, torch.randn(n, LAYOUT.row_width, generator=g))
    for layer in LAYOUT.index_layers:
        cache.append_index_keys(layer, torch.randn(n, LAYOUT.index_head_dim, generator=g))
    cache.commit(n)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Original:
    cache = resolve_tier(LAYOUT, CacheConfig("tq4")).make_cache()
    model = ModelFingerprint("glm_moe_dsa", 2, 32, 8, (0,), 8, 256, "ab" * 32)
    header = KVHeader(model, codec_spec_of(cache), (0, 1))
    path = tmp_path_factory.mktemp("corruption") / "original.kv"
    tokens = [(7 * i + 5) % 256 for i in range(sum(TURNS))]
    with KVFile.create(path, header) as f:
        for seed, n in enumerate(TURNS):
            start = cache.length
            _fill(cache, n, seed)
            f.append(tokens[start : start + n], cache, start, start + n)
        json_bytes = PREFIX.unpack(path.read_bytes()[: PREFIX.size])[3]
        return Original(
            path.read_bytes(),
            tokens,
            cache.state(),
            PREFIX.size + json_bytes + 32,
            f.raw.data_offset,
            f.raw.layout.size,
            f.raw.layout.payload_size,
        )


def _damage(data: bytes, flips, cut, garbage) -> bytes:
    out = bytearray(data)
    for pos, mask in flips:
        out[pos % len(out)] ^= mask
    if cut is not None:
        del out[cut:]
    return bytes(out + garbage)


def _intact_prefix(orig: Original, data: bytes) -> int:
    """Records at the start of `data` identical to the original's (what an exact reader returns)."""
    D, R = orig.data_offset, orig.record
    k = 0
    while (
        k < len(orig.tokens) and data[D + k * R : D + (k + 1) * R] == orig.data[D + k * R : D + (k + 1) * R]
    ):
        if len(data) < D + (k + 1) * R:
            break
        k += 1
    return k


@st.composite
def damage(draw, size: int, header_end: int, data_offset: int):
    slots = data_offset - 2 * BLOCK
    position = st.one_of(
        st.integers(0, size - 1),
        st.integers(0, header_end - 1),
        st.integers(slots, slots + 31),
        st.integers(slots + BLOCK, slots + BLOCK + 31),
        st.integers(data_offset, size - 1),
        st.integers(data_offset, size - 1),
    )
    flips = draw(st.lists(st.tuples(position, st.integers(1, 255)), max_size=4))
    in_data = st.integers(data_offset, size)
    cut = draw(st.one_of(st.none(), st.none(), st.integers(0, size), in_data, in_data))
    garbage = draw(st.binary(max_size=300))
    return flips, cut, garbage


def _check_loaded(orig: Original, path: Path) -> int:
    """Load through every reader; assert what they return is the original's prefix; its length."""
    with RecordFile.open(path) as raw:
        scan = raw.read()
        P, R = orig.payload, orig.record
        for i in range(scan.count):
            assert scan.data[i * R : i * R + P] == orig.data[orig.data_offset + i * R :][:P]
    with KVFile.open(path) as f:
        result = f.load()
    n = len(result.tokens)
    assert n == scan.count and result.tokens == orig.tokens[:n]
    for key, value in orig.state.items():
        assert torch.equal(result.state[key], value[:n]), key
    assert result.to_cache(result.own_tier(torch.device("cpu"))).length == n
    return n


def _check_writer_resumes(orig: Original, path: Path, n: int) -> None:
    """A writer cuts the damage away and appends after the verified prefix."""
    with RecordFile.open(path, writable=True) as f:
        assert f.recover() == n
        assert path.stat().st_size == f.size_for(n)
        # re-append the original records from n on: the file becomes the original again
        D, R, P = orig.data_offset, orig.record, orig.payload
        rest = len(orig.tokens) - n
        payload = b"".join(orig.data[D + i * R : D + i * R + P] for i in range(n, len(orig.tokens)))
        f.append(payload, rest)
    assert path.read_bytes()[D:] == orig.data[D:]


@CASES
@given(data=st.data())
def test_damaged_files_load_a_verified_prefix_or_refuse(original, tmp_path, data):
    flips, cut, garbage = data.draw(damage(len(original.data), original.header_end, original.data_offset))
    damaged = _damage(original.data, flips, cut, garbage)
    path = tmp_path / "damaged.kv"
    path.write_bytes(damaged)
    header_intact = damaged[: original.header_end] == original.data[: original.header_end]
    commit_intact = damaged[: original.data_offset] == original.data[: original.data_offset]
    try:
        n = _check_loaded(original, path)
    except KVFileError as exc:
        assert str(exc)  # a message, and only for a damaged header or commit area
        assert not commit_intact
        event("refused")
        return
    assert header_intact  # a damaged header never loads
    if commit_intact:
        assert n == _intact_prefix(original, damaged)
    event(
        f"loaded {'all' if n == len(original.tokens) else 'a prefix'} ({'intact' if commit_intact else 'damaged'} commit area)"
    )
    _check_writer_resumes(original, path, n)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=20000))
def test_arbitrary_bytes_are_refused_with_kvfileerror(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("garbage") / "garbage.kv"
    path.write_bytes(blob)
    with pytest.raises(KVFileError):
        KVFile.open(path).load()


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 13000), st.binary(min_size=1, max_size=64))
def test_a_valid_header_followed_by_garbage_never_misreads(original, tmp_path_factory, keep, blob):
    path = tmp_path_factory.mktemp("tail") / "tail.kv"
    path.write_bytes(original.data[:keep] + blob)
    try:
        _check_loaded(original, path)
    except KVFileError as exc:
        assert str(exc)
