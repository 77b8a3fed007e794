"""The tier variants on the command line: mixed tiers, grouped radii of tq*/polar*, the recent window.

Byte counts are worked out by hand from the formats in docs/kv-tiers.md (GLM-5: c 512, r 64)."""

from __future__ import annotations

import json

import pytest

from latentkv.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_kv_stats_prints_the_mixed_tiers_exact_bytes(capsys):
    code, out, _ = _run(
        capsys, "kv", "stats", "--kv-cache-dtype", "tq4-r8,tq4-r16,tq3-r8,tq3-r16", "--rows", "8"
    )
    assert code == 0
    # tq4 c: 512 * 4 / 8 + 4 = 260; tq3 c: 192 + 4 = 196; fp8 r: 64 + 4 = 68; bf16 r: 128
    for row in (
        "| tq4-r8 | 328 (260 + 68) |",
        "| tq4-r16 | 388 (260 + 128) |",
        "| tq3-r8 | 264 (196 + 68) |",
    ):
        assert row in out
    assert "| tq3-r16 | 324 (196 + 128) |" in out


def test_kv_stats_with_grouped_radii(capsys):
    code, out, _ = _run(
        capsys, "kv", "stats", "--kv-cache-dtype", "tq4,polar4", "--kv-group-size", "64", "--json"
    )
    assert code == 0
    tiers = {t["kv_cache_dtype"]: t for t in json.loads(out)["tiers"]}
    # tq4 c: 256 code bytes + 8 radii; r (64 = one group): 32 + 4
    assert (tiers["tq4"]["bytes_c"], tiers["tq4"]["bytes_r"]) == (256 + 32, 32 + 4)
    # polar4 c, levels 1..6 of each 64-group: 256 * 4 + (128 + 64 + 32 + 16 + 8) * 3 = 1768 bits -> 221 B
    assert tiers["polar4"]["bytes_c"] == 221 + 8 * 4
    assert tiers["tq4"]["codec"]["c"]["group_size"] == 64 == tiers["tq4"]["codec"]["r"]["group_size"]


def test_generate_with_a_recent_window_and_a_mixed_tier(capsys):
    argv = ["generate", "builtin:tiny", "--prompt-ids", "5,6,7", "--max-tokens", "3", "--ignore-eos"]
    code, out, err = _run(capsys, *argv, "--kv-cache-dtype", "tq4-r8", "--kv-recent-window", "4", "--json")
    assert code == 0, err
    kv = json.loads(out)["kv"]
    assert kv["codec"]["c"]["name"] == "tq4" and kv["codec"]["r"]["name"] == "fp8"
    assert kv["bytes_per_token_per_layer"] == (16 + 4) + (8 + 4)  # builtin:tiny: c 32, r 8
    code, _, err = _run(capsys, *argv, "--kv-cache-dtype", "tq4-r8", "--kv-recent-window", "4")
    assert code == 0
    assert (
        "KV tier: tq4-r8: c 16+4 B, r 8+4 B, rotation_seed 0x9e3779b9, the last 4 tokens read in f32" in err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--kv-cache-dtype", "tq4", "--kv-recent-window", "-1"],
            "--kv-recent-window must be an integer from 0",
        ),
        (
            ["--kv-cache-dtype", "tq4", "--kv-group-size", "5"],
            "tq4 group size 5 must divide the row width 32",
        ),
        (["--kv-cache-dtype", "polar4", "--kv-group-size", "1"], "be at least 2"),
        (["--kv-cache-dtype", "tq4-r4"], "unknown --kv-cache-dtype 'tq4-r4'"),
    ],
)
def test_variant_errors_exit_2(args, message, capsys):
    code, out, err = _run(capsys, "generate", "builtin:tiny", "--prompt-ids", "5", *args)
    assert code == 2 and message in err and "Traceback" not in out + err


def test_a_group_size_applies_to_the_tiers_of_a_list_that_take_groups(capsys):
    code, out, err = _run(
        capsys, "kv", "stats", "--kv-cache-dtype", "f32,bf16,tq4,tq4-r16", "--kv-group-size", "64", "--json"
    )
    assert code == 0, err
    tiers = {t["kv_cache_dtype"]: t for t in json.loads(out)["tiers"]}
    assert tiers["bf16"]["codec"]["c"] == {"name": "bf16", "width": 512}
    assert tiers["tq4"]["codec"]["c"]["group_size"] == 64
    # tq4-r16: c grouped, r bf16 (no scales to group)
    assert (tiers["tq4-r16"]["bytes_c"], tiers["tq4-r16"]["bytes_r"]) == (256 + 8 * 4, 128)
