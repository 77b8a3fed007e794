"""ModelConfig.from_hf against the configs transformers writes, and the refusals with their reasons."""

from __future__ import annotations

import argparse
import json

import pytest
import transformers

from latentkv.config import (
    FAMILIES,
    KV_CACHE_DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    cache_root,
    env_threads,
)

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    q_lora_rank=48,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=20,
    max_position_embeddings=2048,
    routed_scaling_factor=1.5,
    rms_norm_eps=1e-5,
)


def _hf_dict(config) -> dict:
    """What save_pretrained writes to config.json."""
    return json.loads(config.to_json_string())


def _common_fields_match(ours: ModelConfig, hf) -> None:
    assert ours.model_type == hf.model_type
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.moe_intermediate_size == hf.moe_intermediate_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == hf.num_attention_heads
    assert ours.q_lora_rank == hf.q_lora_rank
    assert ours.kv_lora_rank == hf.kv_lora_rank
    assert ours.qk_nope_head_dim == hf.qk_nope_head_dim
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim
    assert ours.qk_head_dim == hf.qk_nope_head_dim + hf.qk_rope_head_dim
    assert ours.v_head_dim == hf.v_head_dim
    assert ours.n_routed_experts == hf.n_routed_experts
    assert ours.n_shared_experts == hf.n_shared_experts
    assert ours.num_experts_per_tok == hf.num_experts_per_tok
    assert ours.n_group == hf.n_group
    assert ours.topk_group == hf.topk_group
    assert ours.norm_topk_prob == hf.norm_topk_prob
    assert ours.routed_scaling_factor == hf.routed_scaling_factor
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rope.theta == hf.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.kv_row_width == hf.kv_lora_rank + hf.qk_rope_head_dim


def _hf_mlp_layer_types(hf_config) -> tuple[str, ...]:
    """Which layers transformers actually builds as MoE (the model, not a config field)."""
    import torch

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return tuple("sparse" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers)


def test_glm_moe_dsa_config(tmp_path):
    hf = transformers.GlmMoeDsaConfig(
        **{**TINY, "n_group": 1, "topk_group": 1},
        index_topk=32,
        index_head_dim=16,
        index_n_heads=4,
        first_k_dense_replace=2,
        indexer_types=["full", "shared", "shared", "full", "shared", "full"],
    )
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    _common_fields_match(cfg, hf)
    assert cfg.family == "glm5"
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types) == _hf_mlp_layer_types(hf)
    assert cfg.dsa is not None
    assert cfg.dsa.index_topk == 32
    assert cfg.dsa.index_head_dim == 16
    assert cfg.dsa.index_n_heads == 4
    assert cfg.dsa.indexer_types == tuple(hf.indexer_types)
    assert cfg.dsa.rope_interleave is True


def test_deepseek_v3_config_without_mlp_layer_types(tmp_path):
    hf = transformers.DeepseekV3Config(**TINY, first_k_dense_replace=2, num_nextn_predict_layers=1)
    raw = _hf_dict(hf)
    assert "mlp_layer_types" not in raw  # derived from first_k_dense_replace, as transformers does
    cfg = ModelConfig.from_hf(raw)
    _common_fields_match(cfg, hf)
    assert cfg.family == "dsv3"
    assert cfg.dsa is None
    assert cfg.mlp_layer_types == _hf_mlp_layer_types(hf)
    assert cfg.rope_interleave == hf.rope_interleave
    assert cfg.num_mtp_layers == 1
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.eos_token_ids == (hf.eos_token_id,)


def test_deepseek_v32_config():
    hf = transformers.DeepseekV32Config(**TINY, index_topk=64, index_head_dim=16, first_k_dense_replace=1)
    cfg = ModelConfig.from_hf(_hf_dict(hf))
    _common_fields_match(cfg, hf)
    assert cfg.family == "dsv32"
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types) == _hf_mlp_layer_types(hf)
    assert cfg.dsa.index_n_heads == hf.index_n_heads
    assert cfg.dsa.indexer_types == ("full",) * 6
    assert cfg.dsa.rope_interleave is False  # DeepSeek-V3.2's indexer uses the half-split layout


def test_glm4_moe_lite_config():
    shape = {k: v for k, v in TINY.items() if k not in ("n_group", "topk_group")}
    hf = transformers.Glm4MoeLiteConfig(**{**shape, "q_lora_rank": None})
    cfg = ModelConfig.from_hf(_hf_dict(hf))
    _common_fields_match(cfg, hf)
    assert cfg.family == "dsv3"
    assert cfg.q_lora_rank is None
    assert cfg.dsa is None
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types) == _hf_mlp_layer_types(hf)


def test_glm4_moe_lite_defaults_to_one_dense_layer_like_transformers():
    hf = transformers.Glm4MoeLiteConfig(
        **{k: v for k, v in TINY.items() if k not in ("n_group", "topk_group")}
    )
    raw = _hf_dict(hf)
    del raw["mlp_layer_types"]
    assert ModelConfig.from_hf(raw).mlp_layer_types == tuple(hf.mlp_layer_types)


def test_eos_token_id_may_be_a_list():
    raw = _hf_dict(transformers.DeepseekV3Config(**TINY))
    raw["eos_token_id"] = [1, 7]
    assert ModelConfig.from_hf(raw).eos_token_ids == (1, 7)
    raw["eos_token_id"] = None
    assert ModelConfig.from_hf(raw).eos_token_ids == ()


def test_kimi_k2_model_type_reads_as_deepseek_v3():
    raw = _hf_dict(transformers.DeepseekV3Config(**TINY, first_k_dense_replace=1))
    raw["model_type"] = "kimi_k2"
    cfg = ModelConfig.from_hf(raw)
    assert cfg.family == "dsv3"
    assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * 5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"index_topk_freq": 3, "index_skip_topk_offset": 2},
        {"index_topk_freq": 2, "index_skip_topk_offset": 1},
        {"index_topk_pattern": "FSFFSS"},
        {"index_topk_pattern": ["full", "full", "shared", "full", "shared", "shared"]},
    ],
)
def test_glm5_indexer_schedule_is_derived_like_transformers(kwargs):
    hf = transformers.GlmMoeDsaConfig(**{**TINY, "n_group": 1, "topk_group": 1}, **kwargs)
    raw = _hf_dict(hf)
    del raw["indexer_types"]
    raw.update(kwargs)
    assert ModelConfig.from_hf(raw).dsa.indexer_types == tuple(hf.indexer_types)


def test_from_hf_accepts_a_directory_a_file_and_a_dict(tmp_path):
    raw = _hf_dict(transformers.DeepseekV3Config(**TINY))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    by_dir = ModelConfig.from_hf(tmp_path)
    assert ModelConfig.from_hf(tmp_path / "config.json") == by_dir == ModelConfig.from_hf(raw)
    assert ModelConfig.from_hf(str(tmp_path)) == by_dir


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v2", None])
def test_unknown_model_type_lists_the_supported_ones(model_type):
    raw = _hf_dict(transformers.DeepseekV3Config(**TINY))
    raw["model_type"] = model_type
    with pytest.raises(ConfigError, match="unsupported model_type") as err:
        ModelConfig.from_hf(raw)
    for supported in FAMILIES:
        assert supported in str(err.value)


def _deepseek(**changes) -> dict:
    raw = _hf_dict(transformers.DeepseekV3Config(**TINY, first_k_dense_replace=1))
    raw.update(changes)
    return raw


def _glm5(**changes) -> dict:
    raw = _hf_dict(transformers.GlmMoeDsaConfig(**{**TINY, "n_group": 1, "topk_group": 1}, index_head_dim=16))
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            _deepseek(n_routed_experts=10, n_group=4),
            r"n_routed_experts \(10\) is not divisible by n_group \(4\)",
        ),
        (_deepseek(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types has 2 entries for 6 layers"),
        (_deepseek(mlp_layer_types=["dense"] * 5 + ["moe"]), "unknown mlp layer types"),
        (_deepseek(topk_group=5), "topk_group"),
        (_deepseek(num_experts_per_tok=9), "num_experts_per_tok"),
        (_deepseek(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
        (_deepseek(kv_lora_rank=0), "kv_lora_rank must be positive"),
        (_deepseek(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (_deepseek(kv_lora_rank=None), "lacks 'kv_lora_rank'"),
        (_deepseek(n_routed_experts=0), "MoE layers need n_routed_experts"),
        (_glm5(indexer_types=["full"] * 5), "indexer_types has 5 entries for 6 layers"),
        (_glm5(indexer_types=["shared"] + ["full"] * 5), "first layer's indexer must be 'full'"),
        (_glm5(indexer_types=["full", "sometimes"] + ["full"] * 4), "unknown indexer types"),
        (_glm5(index_head_dim=4), "index_head_dim"),
        (_glm5(index_topk=0), "index_topk must be positive"),
        (_glm5(q_lora_rank=None), "a DSA indexer needs q_lora_rank"),
    ],
)
def test_invalid_configs_are_refused_with_the_reason(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf(_deepseek(qk_rope_head_dim=7, mlp_layer_types=["dense"]))
    assert "qk_rope_head_dim" in str(err.value) and "mlp_layer_types" in str(err.value)


# --- RoPE parameters ------------------------------------------------------------------------

DEEPSEEK_V3_LEGACY_ROPE = {
    # As DeepSeek-V3's own config.json (transformers 4 format).
    "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}


def test_legacy_rope_scaling_and_rope_theta_are_parsed():
    raw = _deepseek()
    del raw["rope_parameters"]
    raw.update(DEEPSEEK_V3_LEGACY_ROPE)
    rope = ModelConfig.from_hf(raw).rope
    assert rope.kind == "yarn"
    assert rope.theta == 10000.0
    assert rope.factor == 40.0
    assert rope.original_max_position_embeddings == 4096
    assert (rope.beta_fast, rope.beta_slow) == (32.0, 1.0)
    assert (rope.mscale, rope.mscale_all_dim) == (1.0, 1.0)
    # transformers reads the same file to the same parameters.
    hf = transformers.DeepseekV3Config.from_dict(raw)
    assert hf.rope_parameters["rope_type"] == "yarn"
    assert hf.rope_parameters["factor"] == rope.factor
    assert hf.rope_parameters["rope_theta"] == rope.theta


def test_legacy_rope_theta_alone_is_a_default_rope():
    raw = _deepseek()
    del raw["rope_parameters"]
    raw["rope_theta"] = 50000.0
    rope = ModelConfig.from_hf(raw).rope
    assert (rope.kind, rope.theta) == ("default", 50000.0)


def test_yarn_without_factor_uses_the_context_ratio():
    raw = _deepseek(max_position_embeddings=8192)
    raw["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 2048,
    }
    assert ModelConfig.from_hf(raw).rope.factor == 4.0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "rope type 'linear' is not supported",
        ),
        ({"rope_type": "yarn", "rope_theta": 10000.0}, "yarn RoPE needs"),
    ],
)
def test_unsupported_rope_is_refused(params, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_deepseek(rope_parameters=params))


# --- runtime configuration ------------------------------------------------------------------


def test_cache_config_lists_the_supported_kv_dtypes():
    assert CacheConfig().kv_cache_dtype == "f32"
    with pytest.raises(ConfigError, match="unknown --kv-cache-dtype 'int3'") as err:
        CacheConfig("int3")
    for name in KV_CACHE_DTYPES:
        assert name in str(err.value)


@pytest.mark.parametrize(("kwargs", "message"), [({"threads": 0}, "threads"), ({"ram_gb": -1.0}, "ram-gb")])
def test_engine_config_is_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("field", ["weight_dtype", "expert_dtype"])
def test_weight_formats_are_the_registrys(field):
    """The format names come from the weights registry alone: the CLI's choices list exactly its
    names, and a load asking for another is refused in one line that lists them."""
    from latentkv.commands.common import add_weight_arguments
    from latentkv.errors import UserError
    from latentkv.runtime import load
    from latentkv.weights import FORMATS, format_names

    assert set(format_names()) == set(FORMATS)
    p = argparse.ArgumentParser()
    add_weight_arguments(p)
    choices = {a.dest: a.choices for a in p._actions}
    assert tuple(choices["expert_dtype"]) == format_names() == tuple(choices["weight_dtype"])
    with pytest.raises(
        UserError, match="unknown weight format 'fp4'; valid formats: " + ", ".join(format_names())
    ):
        load("builtin:tiny", EngineConfig(**{field: "fp4"}), quiet=True)


def test_environment_aliases(monkeypatch, tmp_path):
    monkeypatch.delenv("LATENTKV_THREADS", raising=False)
    assert env_threads() is None
    monkeypatch.setenv("LATENTKV_THREADS", "3")
    assert env_threads() == 3
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("LATENTKV_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "latentkv"
