"""Does a KV file load here: verdicts (same / reencode / refuse) and their messages, headers as
untrusted JSON, and moving refused files aside."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from latentkv.config import DEFAULT_ROTATION_SEED, KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import CacheLayout, resolve_tier
from latentkv.kv.store import codec_spec, codec_spec_of
from latentkv.kv.store_compat import (
    REENCODE,
    REFUSE,
    SAME,
    cache_config_for,
    compare,
    compare_codec,
    resume_flags,
)
from latentkv.kv.store_file import move_aside
from latentkv.kv.store_header import KVFileError, KVHeader, ModelFingerprint

# builtin:tiny's shape: kv_lora 32, rope 8, 5 layers, every layer a full DSA layer of width 32
LAYOUT = CacheLayout(
    num_layers=5,
    row_width=40,
    kv_lora_rank=32,
    index_layers=(0, 1, 2, 3, 4),
    index_head_dim=32,
    device=torch.device("cpu"),
)
MODEL = ModelFingerprint("glm_moe_dsa", 5, 32, 8, (0, 1, 2, 3, 4), 32, 256, "ab" * 32)


def header(tier: str = "f32", model: ModelFingerprint = MODEL, **cache_kw) -> KVHeader:
    return KVHeader(model, codec_spec(LAYOUT, CacheConfig(tier, **cache_kw)), tuple(range(model.num_layers)))


def test_the_same_model_and_codec_loads_as_is():
    for tier in KV_CACHE_DTYPES:
        verdict = compare(header(tier), header(tier))
        assert verdict.action == SAME and verdict.loads, tier


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("checkpoint", "cd" * 32, "weights fingerprint: file abababababab, current cdcdcdcdcdcd"),
        ("num_layers", 6, "num_layers: file 5, current 6"),
        ("kv_lora_rank", 64, "kv_lora_rank"),
        ("qk_rope_head_dim", 16, "qk_rope_head_dim"),
        ("index_layers", (0, 2), "index_layers: file [0, 1, 2, 3, 4], current [0, 2]"),
        ("index_head_dim", 64, "index_head_dim"),
        ("vocab_size", 512, "vocab_size: file 256, current 512"),
        ("model_type", "deepseek_v32", "model_type: file glm_moe_dsa, current deepseek_v32"),
    ],
)
def test_another_model_is_refused_naming_what_differs(field, value, named):
    other = dataclasses.replace(MODEL, **{field: value})
    current = KVHeader(MODEL, header("tq4").codec, tuple(range(5)))
    current = dataclasses.replace(current, model=other, layers=tuple(range(other.num_layers)))
    verdict = compare(header("tq4"), current)
    assert verdict.action == REFUSE and not verdict.loads
    assert named in verdict.message
    assert "different model" in verdict.message
    assert verdict.resume_flags == ""  # no flag turns one model into another


def test_another_tier_is_refused_with_the_flag_that_resumes_it():
    verdict = compare(header("tq3"), header("tq4"))
    assert verdict.action == REFUSE
    assert verdict.message == (
        "file is tq3 (rotation seed 0x9e3779b9), current is tq4: "
        "a quantized file is never widened; pass --kv-cache-dtype tq3 to resume it"
    )
    narrower = compare(header("tq4"), header("tq3"))
    assert (
        narrower.message
        == "file is tq4 (rotation seed 0x9e3779b9), current is tq3: pass --kv-cache-dtype tq4 to resume it"
    )
    assert verdict.differences == ("tier: file tq3, current tq4",)


@pytest.mark.parametrize(
    "file_tier, current_tier", [("tq4", "tq5"), ("polar3", "tq3"), ("fp8", "bf16"), ("tq6", "polar6")]
)
def test_every_bit_width_and_codec_change_is_refused(file_tier, current_tier):
    verdict = compare(header(file_tier), header(current_tier))
    assert verdict.action == REFUSE
    assert f"--kv-cache-dtype {file_tier}" in verdict.message


def test_another_rotation_seed_is_refused_naming_the_seed_flag():
    verdict = compare(header("tq4", rotation_seed=1), header("tq4"))
    assert verdict.action == REFUSE
    assert verdict.differences == ("rotation seed: file 0x1, current 0x9e3779b9",)
    assert verdict.message.endswith("pass --kv-cache-dtype tq4 --kv-seed 0x1 to resume it")
    assert "current is tq4 (rotation seed 0x9e3779b9)" in verdict.message


def test_another_group_size_is_refused_naming_the_group_flag():
    grouped, per_row = header("fp8", group_size=8), header("fp8")
    verdict = compare(grouped, per_row)
    assert verdict.action == REFUSE
    assert "group size: file 8, current none" in verdict.differences
    assert verdict.resume_flags == "--kv-cache-dtype fp8 --kv-group-size 8"
    back = compare(per_row, grouped)
    assert back.action == REFUSE and back.resume_flags == "--kv-cache-dtype fp8"
    assert "fp8 (one scale per row)" in back.message


@pytest.mark.parametrize("tier", [t for t in KV_CACHE_DTYPES if t != "f32"])
def test_an_f32_file_under_any_other_tier_is_reencoded(tier):
    verdict = compare(header("f32"), header(tier))
    assert verdict.action == REENCODE and verdict.loads
    assert f"re-encoding it to {tier}" in verdict.message


@pytest.mark.parametrize("tier", [t for t in KV_CACHE_DTYPES if t != "f32"])
def test_a_quantized_file_is_never_widened_to_f32(tier):
    verdict = compare(header(tier), header("f32"))
    assert verdict.action == REFUSE
    assert "never widened" in verdict.message
    assert f"--kv-cache-dtype {tier}" in verdict.resume_flags


def test_a_different_codec_revision_is_refused():
    file = header("tq4")
    old = dataclasses.replace(file, codec=dataclasses.replace(file.codec, revision=0))
    verdict = compare(old, file)
    assert verdict.action == REFUSE and "revision" in verdict.message


def test_same_knobs_but_other_sizes_are_refused_not_misread():
    file = header("tq4")
    c = dataclasses.replace(file.codec.c, code_bytes=file.codec.c.code_bytes + 1)
    verdict = compare_codec(dataclasses.replace(file.codec, c=c), file.codec)
    assert verdict.action == REFUSE
    assert verdict.differences and verdict.differences[0].startswith("codec.c:")


@pytest.mark.parametrize("tier", KV_CACHE_DTYPES)
def test_resume_flags_and_cache_config_rebuild_the_files_codec(tier):
    kw = {"rotation_seed": 0x1234} if tier.startswith(("tq", "polar")) else {}
    kw = {"group_size": 8} if tier in ("fp8", "tq4", "polar3", "tq4-r8") else kw
    spec = header(tier, **kw).codec
    assert codec_spec(LAYOUT, cache_config_for(spec)) == spec
    assert codec_spec_of(resolve_tier(LAYOUT, cache_config_for(spec)).make_cache()) == spec
    flags = resume_flags(spec)
    assert flags.startswith(f"--kv-cache-dtype {tier}")
    assert ("--kv-seed 0x1234" in flags) == ("rotation_seed" in kw)
    assert ("--kv-group-size 8" in flags) == ("group_size" in kw)


# --- the variants of issue 5: mixed tiers, grouped radii, the recent window -----------------


@pytest.mark.parametrize("other", ["tq4", "tq4-r16", "tq3-r8", "fp8"])
def test_a_mixed_tier_file_is_refused_under_any_other_tier(other):
    file = header("tq4-r8")
    assert file.codec.c.params["name"] == "tq4" and file.codec.r.params["name"] == "fp8"
    assert KVHeader.from_json(file.to_json()) == file  # the header records both parts
    verdict = compare(file, header(other))
    assert verdict.action == REFUSE
    assert verdict.differences == (f"tier: file tq4-r8, current {other}",)
    assert verdict.resume_flags == "--kv-cache-dtype tq4-r8"
    assert verdict.message.startswith("file is tq4-r8 (rotation seed 0x9e3779b9), current is ")
    assert verdict.message.endswith("pass --kv-cache-dtype tq4-r8 to resume it")
    back = compare(header(other), file)
    assert back.action == REFUSE and back.resume_flags.startswith(f"--kv-cache-dtype {other}")


def test_the_mixed_tiers_are_wider_than_their_base():
    assert "never widened" in compare(header("tq4"), header("tq4-r8")).message
    assert "never widened" in compare(header("tq4-r8"), header("tq4-r16")).message
    assert "never widened" not in compare(header("tq4-r16"), header("tq4")).message


@pytest.mark.parametrize("tier", ["tq4", "polar4", "tq3-r8"])
def test_grouped_radii_are_recorded_and_another_group_size_is_refused(tier):
    grouped, per_row = header(tier, group_size=8), header(tier)
    assert grouped.codec.c.params["group_size"] == 8 and grouped.codec.c.scale_count == 4
    verdict = compare(grouped, per_row)
    assert verdict.action == REFUSE
    assert verdict.differences == ("group size: file 8, current none",)
    assert verdict.resume_flags == f"--kv-cache-dtype {tier} --kv-group-size 8"
    assert (
        f"file is {tier} (rotation seed 0x9e3779b9, group size 8), current is {tier} (rotation"
        in verdict.message
    )
    other = compare(grouped, header(tier, group_size=16))
    assert other.action == REFUSE and "group size: file 8, current 16" in other.differences
    assert compare(per_row, grouped).resume_flags == f"--kv-cache-dtype {tier}"


def test_a_per_row_file_written_before_groups_existed_still_matches():
    """The docs' builtin:tiny tq4 header (docs/kv-file-format.md): params without a group_size key."""
    old_c = {"bits": 4, "name": "tq4", "rotation_seed": 2654435769, "width": 32}
    old_r = {"bits": 4, "name": "tq4", "rotation_seed": 2654435769, "width": 8}
    spec = header("tq4").codec
    assert (spec.c.params, spec.c.code_bytes, spec.c.scale_count) == (old_c, 16, 1)
    assert (spec.r.params, spec.r.code_bytes, spec.r.scale_count) == (old_r, 4, 1)


@pytest.mark.parametrize("tier", ["tq4", "fp8", "tq4-r8"])
def test_the_recent_window_is_not_part_of_the_file(tier):
    """The file holds the tier's rows whatever the window, so a file loads under any window."""
    assert codec_spec(LAYOUT, CacheConfig(tier, recent_window=16)) == codec_spec(LAYOUT, CacheConfig(tier))
    assert compare(header(tier, recent_window=16), header(tier)).action == SAME


def test_the_default_seed_needs_no_flag():
    assert resume_flags(header("tq4", rotation_seed=DEFAULT_ROTATION_SEED).codec) == "--kv-cache-dtype tq4"


# --- headers as untrusted JSON ---------------------------------------------------------------


def test_header_json_round_trips_and_keeps_unknown_keys():
    h = dataclasses.replace(header("tq4"), file_id="00" * 16, created="2025-01-01T00:00:00+00:00", writer="x")
    assert KVHeader.from_json(h.to_json()) == h
    obj = json.loads(h.to_json())
    obj["future_key"] = {"a": 1}
    newer = KVHeader.from_json(json.dumps(obj).encode())
    assert newer.extra == {"future_key": {"a": 1}} and compare(newer, h).action == SAME


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("model", "num_layers"), 0, "model.num_layers"),
        (("model", "num_layers"), True, "model.num_layers"),
        (("model", "kv_lora_rank"), "32", "model.kv_lora_rank"),
        (("model", "index_layers"), [0, 0], "model.index_layers"),
        (("model", "index_layers"), [7], "model.index_layers"),
        (("codec", "c", "code_bytes"), -1, "codec.c.code_bytes"),
        (("codec", "c", "params"), [], "codec.c.params"),
        (("codec", "r", "params", "bits"), {"x": 1}, "codec.r.params.bits"),
        (("layers",), [], "layers"),
        (("layers",), [1, 0], "layers"),
        (("model",), None, "model"),
        (("model", "index_head_dim"), 1 << 21, "model.index_head_dim"),
    ],
)
def test_bad_header_fields_raise_kvfileerror_naming_the_field(path, value, message):
    obj = json.loads(header("tq4").to_json())
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(KVFileError, match=message.replace(".", r"\.")):
        KVHeader.from_json(json.dumps(obj).encode())


def test_headers_whose_records_would_be_huge_are_refused():
    obj = json.loads(header("tq4").to_json())
    obj["model"]["num_layers"] = 4096
    obj["layers"] = list(range(4096))
    obj["codec"]["c"]["code_bytes"] = 1 << 20
    with pytest.raises(KVFileError, match="records of"):
        KVHeader.from_json(json.dumps(obj).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b"\xff\xfe",
        b"{" * 100000,
        b'{"model": 1}',
        b"null",
        b'{"model": {"num_layers": ' + b"9" * 5000 + b"}}",
    ],
    ids=["empty", "list", "utf16", "deep", "model-int", "null", "huge-int"],
)
def test_garbage_header_json_raises_kvfileerror(data):
    with pytest.raises(KVFileError):
        KVHeader.from_json(data)


# --- moving refused files aside ----------------------------------------------------------------


def test_move_aside_keeps_the_file_and_never_overwrites(tmp_path):
    path = tmp_path / "chat.kv"
    path.write_bytes(b"first")
    first = move_aside(path)
    assert not path.exists() and first.read_bytes() == b"first"
    assert first.name.startswith("chat.kv.refused-") and first.parent == tmp_path
    path.write_bytes(b"second")
    second = move_aside(path)  # same second: a new name, the first one kept
    assert second != first and second.read_bytes() == b"second" and first.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


# --- the refusal names every differing parameter and the exact flags that resume the file ------


def _config_from_flags(flags: str) -> CacheConfig:
    """What a run with exactly these flags (and no others) uses, through the CLI's own parser."""
    import argparse

    from latentkv.commands.common import add_cache_arguments, cache_config

    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return cache_config(parser.parse_args(flags.split()))


@pytest.mark.parametrize(
    ("file_kw", "current_kw", "named"),
    [
        # the examples: a flag the user passed must be undone by the note
        (
            {"tier": "tq4"},
            {"tier": "tq4", "rotation_seed": 7},
            ["rotation seed: file 0x9e3779b9, current 0x7"],
        ),
        ({"tier": "fp8"}, {"tier": "fp8", "group_size": 8}, ["group size: file none, current 8"]),
        (
            {"tier": "fp8", "group_size": 8},
            {"tier": "fp8", "group_size": 16},
            ["group size: file 8, current 16"],
        ),
        ({"tier": "fp8", "group_size": 8}, {"tier": "fp8"}, ["group size: file 8, current none"]),
        (
            {"tier": "tq4", "rotation_seed": 1},
            {"tier": "tq4"},
            ["rotation seed: file 0x1, current 0x9e3779b9"],
        ),
        (
            {"tier": "tq4", "rotation_seed": 1},
            {"tier": "tq3", "rotation_seed": 7},
            ["tier: file tq4, current tq3", "rotation seed: file 0x1, current 0x7"],
        ),
        (
            {"tier": "tq4", "group_size": 8},
            {"tier": "polar4", "rotation_seed": 5},
            ["tier: file tq4, current polar4", "rotation seed: file 0x9e3779b9, current 0x5"],
        ),
        ({"tier": "tq4-r8", "group_size": 8}, {"tier": "tq4-r8"}, ["group size: file 8, current none"]),
        (
            {"tier": "tq4-r8"},
            {"tier": "tq4-r8", "rotation_seed": 3},
            ["rotation seed: file 0x9e3779b9, current 0x3"],
        ),
        ({"tier": "polar3"}, {"tier": "polar3", "group_size": 8, "rotation_seed": 2}, None),
        ({"tier": "tq2"}, {"tier": "fp8", "group_size": 8}, ["tier: file tq2, current fp8"]),
    ],
)
def test_the_refusal_names_every_difference_and_flags_that_resume_the_file(file_kw, current_kw, named):
    """The flags in the note, given alone to the CLI's parser, rebuild the file's codec exactly."""
    file_tier, current_tier = file_kw.pop("tier"), current_kw.pop("tier")
    file, current = header(file_tier, **file_kw), header(current_tier, **current_kw)
    verdict = compare(file, current)
    assert verdict.action == REFUSE
    if named is not None:
        assert list(verdict.differences) == named
    else:  # two knobs changed at once: both named
        assert {d.split(":")[0] for d in verdict.differences} == {"rotation seed", "group size"}
    for difference in verdict.differences:  # each side of each difference is in the message
        label = difference.split(":")[0]
        assert label in verdict.message or label == "tier", verdict.message
    flags = verdict.resume_flags
    assert f"pass {flags}" in verdict.message
    config = _config_from_flags(flags)
    assert codec_spec(LAYOUT, config) == file.codec, (flags, verdict.message)
    assert compare(file, KVHeader(MODEL, codec_spec(LAYOUT, config), file.layers)).action == SAME
    if "group_size" in current_kw and "group_size" not in file_kw and file_tier == current_tier:
        assert "(without --kv-group-size)" in verdict.message
