"""`latentkv kv stats`: bytes derived from the codecs, rel-L2 errors, the context in a RAM budget."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from latentkv.cli import main
from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.eval import kvstats
from latentkv.kv.cache import CacheLayout, codecs_for
from latentkv.kv.codecs import get_codec

# Issue 3's numbers for GLM-5's 512 + 64 latent (c and r each with one f32 scale or radius).
ISSUE_BYTES = {"f32": 2304, "bf16": 1152, "fp8": 584, "tq4": 296, "tq3": 224}
# Issue 3's ceilings for the mean rel-L2 on Gaussian rows of width 512.
ISSUE_REL_L2 = {"fp8": 0.03, "tq6": 0.03, "tq5": 0.055, "tq4": 0.10, "tq3": 0.19, "tq2": 0.35, "polar4": 0.16}


def _stats(capsys, *argv: str) -> dict:
    code = main(["kv", "stats", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _by_tier(payload: dict) -> dict[str, dict]:
    return {t["kv_cache_dtype"]: t for t in payload["tiers"]}


@pytest.fixture(scope="module")
def glm5() -> dict:
    """`kv stats --json` with GLM-5's default dims, run once for the module."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["kv", "stats", "--rows", "512", "--json"]) == 0
    return json.loads(out.getvalue())


def test_glm5_bytes_are_the_issue_numbers_and_come_from_the_codecs(glm5):
    tiers = _by_tier(glm5)
    assert list(tiers) == list(KV_CACHE_DTYPES)  # `all` by default
    for name, expected in ISSUE_BYTES.items():
        derived = get_codec(name, 512).bytes_per_row + get_codec(name, 64).bytes_per_row
        t = tiers[name]
        assert t["bytes_per_token_per_layer"] == derived == expected, name
        assert (t["bytes_c"], t["bytes_r"]) == (
            get_codec(name, 512).bytes_per_row,
            get_codec(name, 64).bytes_per_row,
        )
    for name, t in tiers.items():  # every tier, not just the issue's five
        c, r = codecs_for(CacheLayout(78, 576, 512, (), 0, device=torch.device("cpu")), CacheConfig(name))
        assert t["bytes_per_token_per_layer"] == c.bytes_per_row + r.bytes_per_row
        assert t["codec"] == {"c": c.params(), "r": r.params()}


def test_glm5_dims_and_the_indexer_assumption_are_reported(glm5):
    assert glm5["model"] == "GLM-5 (default dims)"
    assert glm5["dims"] == {
        "model_type": "glm_moe_dsa",
        "num_layers": 78,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "index_layers": 78,
        "max_position_embeddings": 202752,
    }
    assert any("indexer" in a for a in glm5["assumptions"])
    assert glm5["real_rows"] is None


def test_per_token_bytes_compression_and_max_context_follow_from_the_row_bytes(glm5):
    budget = 16 * 2**30
    index = 78 * 128 * 4
    f32 = _by_tier(glm5)["f32"]["bytes_per_token_per_layer"]
    bf16 = _by_tier(glm5)["bf16"]["bytes_per_token_per_layer"]
    for t in glm5["tiers"]:
        per_layer = t["bytes_per_token_per_layer"]
        assert t["bytes_per_token"] == per_layer * 78
        assert t["index_bytes_per_token"] == index
        assert t["vs_f32"] == pytest.approx(f32 / per_layer, abs=1e-3)
        assert t["vs_bf16"] == pytest.approx(bf16 / per_layer, abs=1e-3)
        assert t["max_context"] == budget // (per_layer * 78 + index)
        assert t["max_context_latent_only"] == budget // (per_layer * 78)
    tq4 = _by_tier(glm5)["tq4"]
    assert tq4["max_context"] == 272_592 and tq4["max_context_latent_only"] == 744_103


def test_gaussian_errors_are_within_the_issue_bounds(glm5):
    tiers = _by_tier(glm5)
    assert tiers["f32"]["gaussian"] == {"row": 0.0, "c": 0.0, "r": 0.0}
    assert 0 < tiers["bf16"]["gaussian"]["row"] < 0.005
    for name, bound in ISSUE_REL_L2.items():
        err = tiers[name]["gaussian"]
        assert 0 < err["row"] <= bound, name
        assert 0 < err["c"] <= bound, name
        # the whole row [c | r] lies between its parts' errors
        assert min(err["c"], err["r"]) - 1e-3 <= err["row"] <= max(err["c"], err["r"]) + 1e-3, name
    bits = [tiers[f"tq{b}"]["gaussian"]["row"] for b in range(2, 7)]
    assert bits == sorted(bits, reverse=True)  # more bits, less error


def test_ram_budget_and_tier_list(capsys):
    payload = _stats(capsys, "--kv-cache-dtype", "fp8,tq4", "--ram-gb", "1", "--rows", "8")
    tiers = _by_tier(payload)
    assert list(tiers) == ["fp8", "tq4"]
    assert payload["ram_gib"] == 1
    assert tiers["tq4"]["max_context"] == 2**30 // (296 * 78 + 78 * 128 * 4)


def test_the_environment_alias_picks_the_tier_without_the_flag(monkeypatch, capsys):
    monkeypatch.setenv("KV8", "1")
    assert list(_by_tier(_stats(capsys, "--rows", "8"))) == ["fp8"]


def test_real_rows_from_a_forward_pass_of_builtin_tiny(capsys, ours):
    payload = _stats(
        capsys, "--model", "builtin:tiny", "--kv-cache-dtype", "f32,fp8,tq4", "--rows", "64", "--tokens", "16"
    )
    assert payload["dims"]["kv_lora_rank"] == 32 and payload["dims"]["num_layers"] == 5
    assert payload["real_rows"] == 16 * 5
    tiers = _by_tier(payload)
    assert tiers["f32"]["real"] == {"row": 0.0, "c": 0.0, "r": 0.0}
    assert tiers["fp8"]["bytes_per_token_per_layer"] == (32 + 4) + (8 + 4) == 48
    assert 0 < tiers["fp8"]["real"]["row"] < 0.04
    assert 0 < tiers["tq4"]["real"]["row"] < 0.15
    # the same numbers from the library: the rows are the f32 cache of one forward pass
    model = ours("glm5-tiny")
    rows = kvstats.real_rows(model, kvstats.prompt_tokens(model.cfg, None, 16))
    assert rows.shape == (5 * 16, 40)
    cache = model.make_cache()
    model.forward(torch.tensor(kvstats.prompt_tokens(model.cfg, None, 16)), cache)
    assert torch.equal(rows[16:32], cache.view(1))


def test_a_model_the_rotated_tiers_cannot_store_gets_refused_rows(lora24_dir, capsys):
    payload = _stats(
        capsys,
        "--model",
        str(lora24_dir),
        "--kv-cache-dtype",
        "fp8,tq4,polar4",
        "--rows",
        "8",
        "--tokens",
        "4",
    )
    tiers = _by_tier(payload)
    assert tiers["fp8"]["bytes_per_token_per_layer"] == (24 + 4) + (8 + 4)
    for name in ("tq4", "polar4"):
        assert "24" in tiers[name]["error"] and "fp8" in tiers[name]["error"]
        assert "bytes_per_token_per_layer" not in tiers[name]


def test_the_table(capsys):
    code = main(["kv", "stats", "--kv-cache-dtype", "f32,tq4", "--rows", "8", "--ram-gb", "8"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "GLM-5" in out and "78 layers" in out
    assert "| tq4 | 296 (260 + 36) | 23,088 | 7.78x | 3.89x |" in out
    assert "max context in 8 GiB" in out
    assert "assumed:" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ram-gb", "0"], "--ram-gb must be a number above 0"),
        (["--rows", "0"], "--rows must be an integer from 1"),
        (["--kv-cache-dtype", "int4"], "unknown --kv-cache-dtype 'int4'"),
        (["--kv-group-size", "8", "--kv-cache-dtype", "bf16"], "applies to fp8, tq* and polar* tiers"),
    ],
)
def test_user_errors(args, message, capsys):
    code = main(["kv", "stats", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err


def test_roundtrip_error_of_the_identity_is_zero_and_of_a_known_change_is_exact():
    c, r = get_codec("f32", 4), get_codec("f32", 2)
    rows = torch.tensor([[3.0, 0.0, 0.0, 0.0, 4.0, 0.0]])
    assert kvstats.roundtrip_error(c, r, rows) == kvstats.RelL2(0.0, 0.0, 0.0)
    bf = kvstats.roundtrip_error(get_codec("bf16", 4), get_codec("bf16", 2), rows)
    assert bf == kvstats.RelL2(0.0, 0.0, 0.0)  # 3 and 4 are exact in bf16
