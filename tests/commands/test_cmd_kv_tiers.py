"""Choosing a KV tier on the command line: the flag, its environment aliases, the refusal of a
rotated tier on a model with non-power-of-two latent widths, and what generate/demo report."""

from __future__ import annotations

import json

import pytest

from latentkv.cli import main
from latentkv.commands.common import kv_cache_dtype_text
from latentkv.config import KV_CACHE_DTYPES
from latentkv.kv.codecs import TIERS, get_codec
from latentkv.models.registry import BUILTIN_DIR

TINY = json.loads((BUILTIN_DIR / "tiny" / "config.json").read_text())
LKV, ROPE, LAYERS = TINY["kv_lora_rank"], TINY["qk_rope_head_dim"], TINY["num_hidden_layers"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _generate_json(capsys, *extra: str, prompt: str = "5,6,7", n: int = 4) -> tuple[dict, str]:
    argv = ["generate", "builtin:tiny", "--prompt-ids", prompt, "--max-tokens", str(n), "--ignore-eos"]
    code, out, err = _run(capsys, *argv, *extra, "--json")
    assert code == 0, err
    return json.loads(out), err


def _row_bytes(tier: str, **kwargs) -> int:
    """Bytes per token per layer, derived from the codecs themselves (c and r, each with scales)."""
    group = kwargs.pop("group_size", None)
    parts = TIERS[tier]  # c's codec and r's (they differ for the mixed tiers, e.g. tq4-r8: tq4 + fp8)
    c = get_codec(parts.c, LKV, group_size=group, **kwargs)
    r = get_codec(parts.r, ROPE, group_size=group if group and ROPE % group == 0 else None, **kwargs)
    return c.bytes_per_row + r.bytes_per_row


# --- the environment aliases ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "tier", "notice"),
    [
        ({}, "f32", None),
        ({"KV8": "1"}, "fp8", None),
        ({"KV_TQ": "4"}, "tq4", None),
        ({"KV_TQ": "1"}, "tq4", "no 1-bit tier"),
        ({"KV_TQ": "9"}, "tq6", "clamped to 6"),
        ({"KV_TQ_POLAR": "1"}, "polar4", None),
        ({"KV_TQ_POLAR": "1", "KV_TQ": "3"}, "polar3", None),
        ({"KV8": "1", "KV_TQ": "4"}, "tq4", "both KV8 and KV_TQ are set"),
        ({"KV8": "0", "KV_TQ": "0"}, "f32", None),
    ],
)
def test_environment_aliases_choose_the_tier_when_no_flag_is_given(env, tier, notice, capsys):
    assert kv_cache_dtype_text(None, "f32", env) == tier
    err = capsys.readouterr().err
    if notice:
        assert notice in err
    if env and tier != "f32":
        assert f"KV tier {tier}, from the environment" in err
    if tier == "f32":
        assert err == ""


def test_the_flag_beats_the_environment_and_says_so(capsys):
    assert kv_cache_dtype_text("fp8", "f32", {"KV_TQ": "4"}) == "fp8"
    err = capsys.readouterr().err
    assert "--kv-cache-dtype fp8 overrides the environment's tq4" in err
    assert kv_cache_dtype_text("bf16", "f32", {"KV_TQ": "junk"}) == "bf16"  # a bad alias is moot
    assert "ignored" in capsys.readouterr().err
    assert kv_cache_dtype_text("tq3", "f32", {}) == "tq3"
    assert capsys.readouterr().err == ""


def test_a_malformed_alias_without_the_flag_is_a_user_error(monkeypatch, capsys):
    monkeypatch.setenv("KV_TQ", "four")
    code, out, err = _run(capsys, "generate", "builtin:tiny", "--prompt-ids", "5", "--max-tokens", "1")
    assert code == 2
    assert "KV_TQ must be a bit width 1..6, got 'four'" in err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("env", "flag", "tier", "notice"),
    [
        ({"KV8": "1"}, None, "fp8", "from the environment"),
        ({"KV_TQ": "1"}, None, "tq4", "no 1-bit tier"),
        ({"KV_TQ": "9"}, None, "tq6", "clamped to 6"),
        ({"KV_TQ_POLAR": "1"}, None, "polar4", "from the environment"),
        ({"KV8": "1", "KV_TQ": "4"}, None, "tq4", "the 4-bit tier wins"),
        ({"KV_TQ": "4"}, "fp8", "fp8", "overrides the environment's tq4"),
    ],
)
def test_generate_runs_the_tier_the_aliases_pick(env, flag, tier, notice, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out, err = _generate_json(capsys, *(["--kv-cache-dtype", flag] if flag else []), n=2)
    assert out["kv"]["kv_cache_dtype"] == out["stats"]["kv_cache_dtype"] == tier
    assert out["kv"]["bytes_per_token_per_layer"] == _row_bytes(tier)
    assert notice in err


# --- generate and demo report the tier they ran ----------------------------------------------


def test_generate_fp8_reports_the_codec_bytes(capsys):
    out, _ = _generate_json(capsys, "--kv-cache-dtype", "fp8", prompt="5,6,7,8,9", n=6)
    per_layer = _row_bytes("fp8")
    assert per_layer == (LKV + 4) + (ROPE + 4) == 48  # e4m3 codes + one f32 scale, for c and for r
    kv, stats = out["kv"], out["stats"]
    assert kv["bytes_per_token_per_layer"] == stats["kv_bytes_per_token_layer"] == per_layer
    assert kv["bytes_per_token"] == per_layer * LAYERS
    assert stats["kv_bytes"] == per_layer * LAYERS * (5 + 6 - 1)  # the last token is never fed back
    assert kv["codec"]["c"] == {"name": "fp8", "width": LKV, "bits": 8, "group_size": None}
    assert kv["codec"]["r"]["width"] == ROPE
    assert kv["smaller_than_expanded"] == pytest.approx(
        kv["expanded_per_head_kv_bytes_per_token_per_layer"] / per_layer, abs=0.01
    )


def test_group_size_and_seed_reach_the_cache(capsys):
    out, _ = _generate_json(capsys, "--kv-cache-dtype", "fp8", "--kv-group-size", "8", n=2)
    assert out["kv"]["codec"]["c"]["group_size"] == 8
    assert out["kv"]["codec"]["r"]["group_size"] == 8
    assert out["kv"]["bytes_per_token_per_layer"] == _row_bytes("fp8", group_size=8) == (32 + 16) + (8 + 4)
    out, _ = _generate_json(capsys, "--kv-cache-dtype", "tq4", "--kv-seed", "0x1234", n=2)
    assert out["kv"]["codec"]["c"]["rotation_seed"] == 0x1234 == out["kv"]["codec"]["r"]["rotation_seed"]


@pytest.mark.parametrize("tier", KV_CACHE_DTYPES)
def test_generation_runs_over_every_tier(tier, capsys):
    out, _ = _generate_json(capsys, "--kv-cache-dtype", tier, n=4)
    per_layer = _row_bytes(tier)
    assert len(out["tokens"]) == 4
    assert out["kv"]["kv_cache_dtype"] == out["stats"]["kv_cache_dtype"] == tier
    assert out["kv"]["bytes_per_token_per_layer"] == per_layer
    assert out["stats"]["kv_bytes"] == per_layer * LAYERS * (3 + 4 - 1)
    assert all(0 <= t < TINY["vocab_size"] for t in out["tokens"])


def test_f32_flag_is_the_default_path(capsys):
    default, _ = _generate_json(capsys, n=6)
    flagged, _ = _generate_json(capsys, "--kv-cache-dtype", "auto", n=6)
    assert flagged["tokens"] == default["tokens"]
    assert flagged["kv"] == default["kv"]
    assert default["kv"]["codec"] == {"name": "f32"}


def test_generate_stats_line_names_the_tier(capsys):
    argv = ("generate", "builtin:tiny", "--prompt-ids", "5,6", "--max-tokens", "2", "--kv-cache-dtype", "tq3")
    code, _, err = _run(capsys, *argv)
    assert code == 0
    assert f"(tq3, {_row_bytes('tq3')} B/token/layer" in err
    assert "KV tier: tq3" in err and "rotation_seed 0x9e3779b9" in err


def test_demo_takes_a_tier(capsys):
    code, out, _ = _run(
        capsys, "demo", "--model", "builtin:tiny", "--max-tokens", "3", "--kv-cache-dtype", "tq4"
    )
    assert code == 0
    assert f"KV cache    {_row_bytes('tq4'):>6} B/token/layer (tq4:" in out
    assert "generated" in out and "DSA keys" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--kv-cache-dtype", "bf16", "--kv-group-size", "8"],
            "--kv-group-size applies to fp8, tq* and polar* tiers",
        ),
        (["--kv-cache-dtype", "fp8", "--kv-group-size", "5"], "must divide the row width 32"),
        (["--kv-cache-dtype", "fp8", "--kv-group-size", "0"], "--kv-group-size must be an integer from 1 to"),
        (["--kv-cache-dtype", "tq9"], "unknown --kv-cache-dtype 'tq9'; choose from f32"),
    ],
)
def test_tier_option_errors_exit_2(args, message, capsys):
    code, out, err = _run(capsys, "generate", "builtin:tiny", "--prompt-ids", "5", *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in out + err


def test_a_bad_seed_is_an_argparse_error(capsys):
    for seed in ("-1", "x", str(1 << 64)):
        with pytest.raises(SystemExit) as exit_:
            main(["generate", "builtin:tiny", "--prompt-ids", "5", "--kv-seed", seed])
        assert exit_.value.code == 2
        assert "--kv-seed" in capsys.readouterr().err


# --- refusal before any weight is read ------------------------------------------------------


@pytest.mark.parametrize("tier", ["tq4", "polar3"])
def test_a_rotated_tier_on_a_24_wide_latent_is_refused_before_loading(tier, lora24_dir, monkeypatch, capsys):
    import latentkv.models.weights as weights

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the tier was checked")

    monkeypatch.setattr(weights, "load_model", must_not_load)
    argv = ["generate", str(lora24_dir), "--prompt-ids", "5,6", "--kv-cache-dtype", tier]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert "latentkv generate: error:" in err
    assert "kv_lora_rank 24" in err and "24 wide" in err
    assert "fp8" in err
    assert "Traceback" not in out + err
    assert "loaded" not in err  # no weights, no load line


def test_the_refused_model_runs_under_the_suggested_fp8(lora24_dir, capsys):
    code, out, err = _run(
        capsys, "generate", str(lora24_dir), "--prompt-ids", "5,6", "--max-tokens", "2", "--json",
        "--kv-cache-dtype", "fp8",
    )  # fmt: skip
    assert code == 0, err
    kv = json.loads(out)["kv"]
    assert kv["bytes_per_token_per_layer"] == (24 + 4) + (ROPE + 4)


def test_the_environment_alias_is_refused_the_same_way(lora24_dir, monkeypatch, capsys):
    monkeypatch.setenv("KV_TQ", "4")
    code, _, err = _run(capsys, "demo", "--model", str(lora24_dir), "--max-tokens", "1")
    assert code == 2
    assert "kv_lora_rank 24" in err and "fp8" in err
