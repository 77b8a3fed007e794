"""The planner: the KV pool at the tier's real bytes (indexer keys included), a tier change moves
exactly its bytes between the KV pool and the expert cache, and the CLI's verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from latentkv.cli import main
from latentkv.config import CacheConfig, ModelConfig
from latentkv.models.registry import resolve
from latentkv.streaming.planner import make_plan

MIB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def fixture_model():
    d = resolve("builtin:fixture")
    return ModelConfig.from_hf(d), d


def test_kv_pool_counts_f32_rows_and_indexer_keys(fixture_model):
    cfg, d = fixture_model
    p = make_plan(cfg, d, 8 << 30, cache=CacheConfig("f32"), max_model_len=1000, max_num_seqs=3)
    index_layers = sum(t == "full" for t in cfg.dsa.indexer_types) if cfg.dsa else 0
    index_dim = cfg.dsa.index_head_dim if cfg.dsa else 0
    per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 + index_layers * index_dim * 4
    assert p.kv_bytes_per_token == per_token
    assert p.kv_bytes == per_token * 1000 * 3


def test_a_smaller_kv_tier_gives_its_bytes_to_the_expert_cache(fixture_model):
    cfg, d = fixture_model
    probe = make_plan(cfg, d, 8 << 30, cache=CacheConfig("f32"), max_model_len=2000)
    fixed = probe.dense_bytes + probe.kv_bytes + probe.activation_bytes + probe.working_bytes
    ram = fixed + 2 * MIB  # f32 leaves 2 MiB for experts
    f32 = make_plan(cfg, d, ram, cache=CacheConfig("f32"), max_model_len=2000)
    tq4 = make_plan(cfg, d, ram, cache=CacheConfig("tq4-r8"), max_model_len=2000)
    assert f32.expert_cache_bytes == 2 * MIB
    assert tq4.kv_bytes < f32.kv_bytes
    assert tq4.expert_cache_bytes - f32.expert_cache_bytes == f32.kv_bytes - tq4.kv_bytes
    assert tq4.cached_experts > f32.cached_experts
    assert f32.cold_bytes_per_token == cfg.num_experts_per_tok * f32.moe_layers * f32.expert_extent_bytes
    assert tq4.expected_bytes_per_token < f32.expected_bytes_per_token < f32.cold_bytes_per_token


def test_plan_cli_json_and_verdicts(capsys):
    assert main(["plan", "builtin:tiny", "--ram-gb", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["all_experts_fit"] and plan["ram_bytes"] == 2 << 30
    assert main(["plan", "builtin:tiny", "--ram-gb", "0.01"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", "builtin:tiny", "--ram-gb", "-1"]) == 2
    assert main(["plan", "no/such/model"]) == 2
    assert "error" in capsys.readouterr().err


def test_a_folder_with_config_json_alone_plans_as_the_checkpoint_does(fixture_model, tmp_path, capsys):
    cfg, d = fixture_model
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    args = dict(cache=CacheConfig("tq4-r8"), max_model_len=512, max_num_seqs=2)
    full = make_plan(cfg, d, 1 << 30, "int8", expert_dtype="int4", **args)
    alone = make_plan(cfg, tmp_path, 1 << 30, "int8", expert_dtype="int4", **args)
    assert (full.sizes_from, alone.sizes_from) == ("the checkpoint", "config.json alone")
    differ = {k for k, v in full.as_dict().items() if alone.as_dict()[k] != v}
    assert differ == {"sizes_from"}
    assert full.mtp_layers == 1  # the fixture ships its MTP layer; the config declares it
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert (
            main(
                ["plan", model, "--ram-gb", "1", "--weight-dtype", "int8", "--expert-dtype", "int4", "--json"]
            )
            == 0
        )
        assert (
            json.loads(capsys.readouterr().out)["dense_bytes"]
            == make_plan(cfg, None, 1 << 30, "int8").dense_bytes
        )


def test_disk_gbps_bounds_tokens_per_second_by_the_reads(fixture_model, capsys):
    cfg, d = fixture_model
    p = make_plan(cfg, d, 1 << 30, disk_gbps=2.0)
    assert p.all_experts_fit and p.expected_bytes_per_token == 0 and p.disk_bound_tok_s is None
    cold = cfg.num_experts_per_tok * sum(t == "sparse" for t in cfg.mlp_layer_types) * p.expert_extent_bytes
    assert p.cold_disk_bound_tok_s == pytest.approx(2e9 / cold)
    fixed = p.dense_bytes + p.kv_bytes + p.activation_bytes + p.working_bytes
    tight = make_plan(cfg, d, fixed + 6 * p.expert_extent_bytes, disk_gbps=2.0)
    assert 0 < tight.expected_bytes_per_token < cold
    assert tight.disk_bound_tok_s == pytest.approx(2e9 / tight.expected_bytes_per_token)
    assert main(["plan", "builtin:fixture", "--ram-gb", "1", "--disk-gbps", "2"]) == 0
    assert "tok/s" in capsys.readouterr().out
    assert main(["plan", "builtin:fixture", "--disk-gbps", "0"]) == 2


# The published totals: DeepSeek-V3 671B parameters (without its MTP module), GLM-5 744B.
@pytest.mark.parametrize("name, billions", [("DeepSeek-V3", 671), ("GLM-5", 744)])
def test_the_worked_example_configs_size_the_published_models(name, billions):
    import math

    from latentkv.models.shapes import checkpoint_shapes

    cfg = ModelConfig.from_hf(DOCS / "configs" / name)
    params = sum(math.prod(s) for s in checkpoint_shapes(cfg, mtp=False).values())
    assert round(params / 1e9) == billions
    plan = make_plan(
        cfg, DOCS / "configs" / name, 128 << 30, "int8", CacheConfig("tq4-r8"), 32768, expert_dtype="int4"
    )
    assert plan.sizes_from == "config.json alone" and plan.fits and plan.mtp_layers == 1


@pytest.mark.parametrize("name", ["builtin:fixture", "builtin:tiny"])
def test_a_config_alone_plans_like_its_checkpoint(tmp_path, name):
    """A folder with only config.json is planned from the shapes the config implies: the same
    plan as the real checkpoint's (dense bytes, MTP layer, experts)."""
    import shutil

    d = resolve(name)
    shutil.copy(d / "config.json", tmp_path / "config.json")
    cfg = ModelConfig.from_hf(d)
    for fmt in ("f32", "int4"):
        real = make_plan(cfg, d, 8 << 30, fmt, store_dir=tmp_path / "none").as_dict()
        alone = make_plan(cfg, tmp_path, 8 << 30, fmt, store_dir=tmp_path / "none").as_dict()
        assert (real.pop("sizes_from"), alone.pop("sizes_from")) == ("the checkpoint", "config.json alone")
        assert alone == real
