"""The KV file with real caches: round trips on every tier through the model, exact sizes,
re-encoding, truncation, sessions, inspection, versions and the writer's own refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.engine.generate import generate
from latentkv.kv import store_file
from latentkv.kv.cache import resolve_tier
from latentkv.kv.store import KVFile, KVMismatch, header_for, inspect, layout_of, rewrite
from latentkv.kv.store_file import BLOCK, PREFIX, RecordFile, record_check
from latentkv.kv.store_header import KVFileError
from latentkv.kv.store_session import Session, reusable_prefix
from latentkv.models.loader import Checkpoint

MODELS = [
    "glm5-tiny",
    "glm5-tiny-dsa",
]  # builtin:tiny, and the DSA oracle model (full + shared indexer layers)


@pytest.fixture(scope="module")
def fingerprint(checkpoint):
    return lambda name: Checkpoint(checkpoint(name)).fingerprint()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert _same_bytes(a[key], b[key]), key


def _run_first_turn(model, cfg: CacheConfig, seed: int = 0):
    """Prompt + 8 greedy tokens; returns (cache, the ids of its rows, the last generated token)."""
    prompt = _ids(12, seed)
    cache = model.make_cache(model.tier(cfg))
    out = generate(model, prompt, 8, cache=cache).tokens
    history = prompt + out[:-1]  # the last generated token is not in the cache yet
    assert cache.length == len(history)
    return cache, history, out[-1]


def _predicted_record_bytes(cache) -> int:
    """Bytes per token from the cache's own accounting: id + rows + indexer keys + check."""
    return (
        4
        + cache.layout.num_layers * cache.tier.bytes_per_token_layer
        + cache.layout.index_bytes_per_token
        + 16
    )


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tier", KV_CACHE_DTYPES)
def test_save_restart_resume_is_token_identical(ours, fingerprint, tmp_path, name, tier):
    model, cfg = ours(name), CacheConfig(tier)
    cache, history, last = _run_first_turn(model, cfg)
    header = header_for(model.cfg, cache, fingerprint(name))
    path = tmp_path / "chat.kv"
    with KVFile.create(path, header) as f:
        f.append(history[:12], cache, 0, 12)  # turn 1: the prompt
        f.append(history[12:], cache, 12, len(history))  # turn 2: the answer
        size = f.raw.size_for(len(history))
    saved = cache.state()
    next_prompt = [last, *_ids(5, 1)]
    uninterrupted = generate(model, next_prompt, 8, cache=cache).tokens

    with KVFile.open(path) as f:  # "after a restart": nothing shared but the file
        result = f.load(expected=header)
    assert result.tokens == history and result.notes == [] and result.verdict.action == "same"
    _assert_same_state(result.state, saved)
    restored = result.to_cache(model.tier(cfg))
    _assert_same_state(restored.state(), saved)
    assert generate(model, next_prompt, 8, cache=restored).tokens == uninterrupted

    # file size = header + tokens x (bytes per token the cache predicts)
    assert path.stat().st_size == size == f.raw.data_offset + len(history) * _predicted_record_bytes(cache)
    json_bytes = PREFIX.unpack(path.read_bytes()[: PREFIX.size])[3]
    assert f.raw.data_offset == BLOCK * math.ceil((PREFIX.size + json_bytes + 32) / BLOCK) + 2 * BLOCK


@pytest.mark.parametrize("tier", ["tq4", "fp8", "polar3", "bf16"])
def test_an_f32_file_resumes_reencoded_under_a_quantized_tier(ours, fingerprint, tmp_path, tier):
    model = ours("glm5-tiny")
    cache, history, last = _run_first_turn(model, CacheConfig("f32"))
    path = tmp_path / "chat.kv"
    with KVFile.create(path, header_for(model.cfg, cache, fingerprint("glm5-tiny"))) as f:
        f.append(history, cache, 0, len(history))
    current = header_for(model.cfg, model.make_cache(model.tier(tier)), fingerprint("glm5-tiny"))
    with KVFile.open(path) as f:
        result = f.load(expected=current)
    assert result.verdict.action == "reencode"
    assert any(f"re-encoding it to {tier}" in note for note in result.notes)
    restored = result.to_cache(model.tier(tier))
    # exactly what the tier's cache stores for those f32 rows
    expected = resolve_tier(model.layout, CacheConfig(tier)).make_cache()
    for layer in range(model.cfg.num_layers):
        expected.append(layer, cache.view(layer))
    for layer in model.layout.index_layers:
        expected.append_index_keys(layer, cache.index_keys(layer))
    expected.commit(cache.length)
    _assert_same_state(restored.state(), expected.state())
    assert len(generate(model, [last], 4, cache=restored).tokens) == 4


def test_a_quantized_file_never_loads_as_f32(ours, fingerprint, tmp_path):
    model = ours("glm5-tiny")
    cache, history, _ = _run_first_turn(model, CacheConfig("tq4"))
    path = tmp_path / "chat.kv"
    with KVFile.create(path, header_for(model.cfg, cache, fingerprint("glm5-tiny"))) as f:
        f.append(history, cache, 0, len(history))
    current = header_for(model.cfg, model.make_cache(model.tier("f32")), fingerprint("glm5-tiny"))
    with KVFile.open(path) as f, pytest.raises(KVMismatch, match="--kv-cache-dtype tq4") as info:
        f.load(expected=current)
    assert info.value.verdict.action == "refuse"
    with KVFile.open(path) as f, pytest.raises(KVMismatch):
        f.load().to_cache(model.tier("f32"))


def test_truncate_keeps_the_common_prefix_and_appends_after_it(ours, fingerprint, tmp_path):
    model = ours("glm5-tiny")
    cache, history, _ = _run_first_turn(model, CacheConfig("tq4"))
    path = tmp_path / "chat.kv"
    with KVFile.create(path, header_for(model.cfg, cache, fingerprint("glm5-tiny"))) as f:
        f.append(history, cache, 0, len(history))
        saved = cache.state()
        f.truncate(10)
        assert f.committed == 10 and path.stat().st_size == f.raw.size_for(10)
        cache.trim(10)  # a prompt that diverges after 10 tokens
        generate(model, _ids(4, 7), 1, cache=cache)
        f.append(_ids(4, 7), cache, 10, 14)
    with KVFile.open(path) as f:
        result = f.load()
    assert result.tokens == history[:10] + _ids(4, 7)
    for key, value in saved.items():
        assert _same_bytes(result.state[key][:10], value[:10]), key
    _assert_same_state(result.state, cache.state())


def test_session_saves_each_turn_and_resumes(ours, fingerprint, tmp_path):
    model, cfg = ours("glm5-tiny"), CacheConfig("tq4")
    current = header_for(model.cfg, model.make_cache(model.tier(cfg)), fingerprint("glm5-tiny"))
    path = tmp_path / "sessions" / "chat.kv"
    path.parent.mkdir()
    session, cache = Session.resume(path, current, model.tier(cfg))
    assert session.tokens == [] and cache.length == 0 and path.exists()
    out = generate(model, _ids(12, 0), 8, cache=cache).tokens
    tokens = _ids(12, 0) + out[:-1]
    session.save(tokens, cache)
    session.close()

    again, restored = Session.resume(path, current, model.tier(cfg))
    assert again.tokens == tokens and again.notes == []
    _assert_same_state(restored.state(), cache.state())
    prompt = tokens + [out[-1], 9, 10]  # the next turn extends what was saved
    keep = reusable_prefix(again.tokens, prompt)
    assert keep == len(tokens)
    more = generate(model, prompt[keep:], 4, cache=restored).tokens
    again.save(prompt + more[:-1], restored)
    # a diverging prompt: keep the common prefix, cut the rest
    restored.trim(5)
    generate(model, [3, 4], 1, cache=restored)
    again.save(tokens[:5] + [3, 4], restored)
    again.close()
    with KVFile.open(path) as f:
        assert f.load().tokens == tokens[:5] + [3, 4]
    assert reusable_prefix(tokens, tokens) == len(tokens) - 1  # the last token runs again


def test_session_moves_a_refused_file_aside_and_starts_over(ours, fingerprint, tmp_path):
    model = ours("glm5-tiny")
    path = tmp_path / "chat.kv"
    tq3 = header_for(model.cfg, model.make_cache(model.tier("tq3")), fingerprint("glm5-tiny"))
    session, cache = Session.resume(path, tq3, model.tier("tq3"))
    generate(model, _ids(6, 0), 1, cache=cache)
    session.save(_ids(6, 0), cache)
    session.close()
    old = path.read_bytes()

    tq4 = header_for(model.cfg, model.make_cache(model.tier("tq4")), fingerprint("glm5-tiny"))
    session, cache = Session.resume(path, tq4, model.tier("tq4"))
    assert session.tokens == [] and cache.length == 0
    assert session.moved_to is not None and session.moved_to.read_bytes() == old
    (note,) = session.notes
    assert "file is tq3" in note and "--kv-cache-dtype tq3" in note and str(session.moved_to) in note
    session.close()
    assert inspect(path)["tier"] == "tq4"

    path.write_bytes(b"\x89LKV\r\n\x1a\n" + bytes(100))  # a damaged header
    session, _ = Session.resume(path, tq4, model.tier("tq4"))
    assert "cannot be read" in session.notes[0] and session.moved_to.exists()
    session.close()


def test_session_rewrites_an_f32_file_in_the_current_tier_at_the_next_save(ours, fingerprint, tmp_path):
    model = ours("glm5-tiny")
    path = tmp_path / "chat.kv"
    f32 = header_for(model.cfg, model.make_cache(model.tier("f32")), fingerprint("glm5-tiny"))
    session, cache = Session.resume(path, f32, model.tier("f32"))
    generate(model, _ids(6, 0), 1, cache=cache)
    session.save(_ids(6, 0), cache)
    session.close()

    tq4 = header_for(model.cfg, model.make_cache(model.tier("tq4")), fingerprint("glm5-tiny"))
    session, cache = Session.resume(path, tq4, model.tier("tq4"))
    assert session.rewrite_pending and session.tokens == _ids(6, 0)
    assert inspect(path)["tier"] == "f32"  # untouched until the next save
    generate(model, [5], 1, cache=cache)
    session.save([*_ids(6, 0), 5], cache)
    session.close()
    assert inspect(path)["tier"] == "tq4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]  # no temporary left behind
    with KVFile.open(path) as f:
        _assert_same_state(f.load(expected=tq4).to_cache(model.tier("tq4")).state(), cache.state())


# --- the writer's refusals, locks, versions, inspection ----------------------------------------


@pytest.fixture
def small(ours, fingerprint, tmp_path):
    """A tq4 file of builtin:tiny holding one turn, plus its cache and header."""
    model = ours("glm5-tiny")
    cache, history, _ = _run_first_turn(model, CacheConfig("tq4"))
    header = header_for(model.cfg, cache, fingerprint("glm5-tiny"))
    path = tmp_path / "chat.kv"
    with KVFile.create(path, header) as f:
        f.append(history[:12], cache, 0, 12)
    return path, cache, header, history


def test_append_refuses_what_it_could_not_read_back(small, ours):
    path, cache, header, history = small
    before = path.read_bytes()
    with KVFile.open(path, writable=True) as f:
        with pytest.raises(ValueError, match="start == 12"):
            f.append(history[13:15], cache, 13, 15)
        with pytest.raises(ValueError, match="one token per row"):
            f.append(history[12:14], cache, 12, 15)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            f.append([999, 1], cache, 12, 14)
        with pytest.raises(ValueError, match="does not match the file"):
            other = ours("glm5-tiny").make_cache(ours("glm5-tiny").tier("tq3"))
            f.append([], other, 12, 12)
        with torch.inference_mode():  # the cache's storage is inference tensors
            cache.view(0).c.scales[12, 0] = float("nan")  # a scale we would never trust on reading
        with pytest.raises(ValueError, match="negative or not finite"):
            f.append(history[12:14], cache, 12, 14)
    assert path.read_bytes() == before


def test_a_checksummed_but_out_of_range_scale_is_cut_back_not_trusted(small):
    """A writer other than ours could checksum a bad radius: the reader still refuses the record."""
    path, _, _, _ = small
    with RecordFile.open(path, writable=True) as f:
        D, R, P = f.data_offset, f.layout.size, f.layout.payload_size
        data = bytearray(path.read_bytes())
        a, _ = f.layout.scales
        prev = bytes(data[D + 9 * R + P : D + 10 * R])
        payload = bytearray(data[D + 10 * R : D + 10 * R + P])
        payload[a : a + 4] = struct.pack("<f", -1.0)
        data[D + 10 * R : D + 11 * R] = payload + record_check(f.digest, 10, prev, payload)
        path.write_bytes(data[: D + 11 * R])
    with KVFile.open(path) as f:
        result = f.load()
    assert len(result.tokens) == 10
    assert any("negative or not finite" in note for note in result.notes)
    assert not inspect(path)["verifies"]


def test_one_writer_at_a_time_any_number_of_readers(small):
    path = small[0]
    with KVFile.open(path, writable=True) as f:
        f.recover()
        with pytest.raises(KVFileError, match="open for writing by another"):
            KVFile.open(path, writable=True)
        with KVFile.open(path) as reader:
            assert len(reader.load().tokens) == 12
            with pytest.raises(KVFileError, match="reading only"):
                reader.truncate(0)
    KVFile.open(path, writable=True).close()  # the lock went with the writer


def test_create_never_replaces_an_existing_file_unless_asked(small):
    path, cache, header, _ = small
    with pytest.raises(FileExistsError):
        KVFile.create(path, header)
    assert len(KVFile.open(path).load().tokens) == 12
    KVFile.create(path, header, replace=True).close()
    assert KVFile.open(path).load().tokens == []


def test_rewrite_replaces_the_file_in_one_step(small):
    path, cache, header, history = small
    with rewrite(path, header, history, cache) as f:
        assert f.committed == len(history) and f.path == path
    assert KVFile.open(path).load().tokens == history
    assert [p.name for p in path.parent.iterdir()] == ["chat.kv"]


def test_a_newer_minor_version_loads_and_a_newer_major_one_is_refused(small, monkeypatch):
    path, cache, header, history = small
    newer = dataclasses.replace(header, extra={"added_in_1_7": {"x": 1}})  # a key this reader ignores
    monkeypatch.setattr(store_file, "FORMAT_MINOR", 7)
    with KVFile.create(path, newer, replace=True) as f:
        f.append(history, cache, 0, len(history))
    monkeypatch.undo()
    with KVFile.open(path) as f:
        assert f.load(expected=header).tokens == history
        assert f.header.extra == {"added_in_1_7": {"x": 1}}
    with KVFile.open(path, writable=True) as f:  # an older minor appends to a newer one
        f.truncate(12)
    assert inspect(path)["format_version"] == "1.7" and inspect(path)["tokens"] == 12

    data = bytearray(path.read_bytes())
    magic, _, _, json_bytes, record = PREFIX.unpack(data[: PREFIX.size])
    data[: PREFIX.size] = PREFIX.pack(magic, 2, 0, json_bytes, record)
    end = PREFIX.size + json_bytes
    data[end : end + 32] = hashlib.sha256(data[:end]).digest()
    path.write_bytes(data)
    with pytest.raises(KVFileError, match=r"newer format version \(2\.0\).*upgrade latentkv"):
        KVFile.open(path)
    assert "newer format" in inspect(path)["error"]


def test_inspect_reports_what_the_file_holds(small, ours, fingerprint):
    path, cache, header, _ = small
    info = inspect(path, current=header)
    assert info["verifies"] and info["tokens"] == 12 and info["tier"] == "tq4"
    assert info["format_version"] == "1.0" and info["bytes"] == info["expected_bytes"] == path.stat().st_size
    assert info["model"]["checkpoint"] == fingerprint("glm5-tiny") and info["model"]["num_layers"] == 5
    assert (
        info["codec"]["c"]["rotation_seed"] == 0x9E3779B9 and info["resume_flags"] == "--kv-cache-dtype tq4"
    )
    assert info["record_bytes"] == _predicted_record_bytes(cache)
    assert info["loads_here"]["action"] == "same"
    f32 = header_for(ours("glm5-tiny").cfg, ours("glm5-tiny").make_cache(), fingerprint("glm5-tiny"))
    assert inspect(path, current=f32)["loads_here"]["action"] == "refuse"

    with path.open("r+b") as fh:  # a torn last record: still inspectable, does not verify
        fh.truncate(path.stat().st_size - 5)
    info = inspect(path)
    assert not info["verifies"] and info["tokens"] == 11 and info["committed_tokens"] == 12
    assert inspect(path.with_name("missing.kv"))["error"]
    assert "too short to be a latentkv KV file" in inspect(_write(path, b"hello"))["error"]
    assert "not a latentkv KV file" in inspect(_write(path, b"hello" * 10))["error"]


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_layout_of_refuses_a_partial_layer_set(small):
    _, _, header, _ = small
    with pytest.raises(KVFileError, match="layers"):
        layout_of(dataclasses.replace(header, layers=(0, 1)), torch.device("cpu"))


@pytest.mark.parametrize("tier", ["tq4", "tq4-r8"])
def test_resume_with_a_recent_window(ours, fingerprint, tmp_path, tier):
    """The file stores the tier's rows only; on resume the window is refilled from them (decoded).
    The tier bytes come back exactly, and the rows the window held exactly before the restart are
    now decoded ones, so the continuation is not bit-identical to the uninterrupted run."""
    model, window = ours("glm5-tiny"), 6
    cfg = CacheConfig(tier, recent_window=window)
    cache, history, last = _run_first_turn(model, cfg)
    header = header_for(model.cfg, cache, fingerprint("glm5-tiny"))
    assert header == header_for(model.cfg, model.make_cache(model.tier(tier)), fingerprint("glm5-tiny"))
    path = tmp_path / "chat.kv"
    with KVFile.create(path, header) as f:
        f.append(history, cache, 0, len(history))
    with KVFile.open(path) as f:
        result = f.load(expected=header)
    restored = result.to_cache(model.tier(cfg))
    assert restored.tier.name == tier and restored.tier.recent_window == window
    _assert_same_state(restored.state(), cache.state())
    assert restored.window_nbytes() == cache.window_nbytes() > 0
    # the same next step over both: the resumed window rows are decoded, the uninterrupted exact
    token = torch.tensor([last])
    resumed, uninterrupted = model.forward(token, restored), model.forward(token, cache)
    assert 0 < float((resumed - uninterrupted).abs().max()) < 1.0
