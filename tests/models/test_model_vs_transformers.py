"""Our logits against live transformers on fresh sequences longer than the oracle's 32 tokens,
on every oracle spec and on variants the oracle does not cover (GLM-4.7-Flash, attention biases,
half-split RoPE in the main attention, tied embeddings)."""

from __future__ import annotations

import pytest
import torch

from latentkv.eval import oracle
from latentkv.models.weights import load_model

SPEC_NAMES = list(oracle.SPECS)
TOLERANCE = 1e-4  # float32 logits, as the oracle


pytestmark = pytest.mark.numerics  # CI runs these under a second CPU capability too


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_prefill_logits_match_transformers_on_80_tokens(name, ours, hf, helpers):
    ids = helpers.random_ids(80, seed=100 + SPEC_NAMES.index(name))
    model = ours(name)
    got = model.forward(ids, model.make_cache(), all_logits=True)
    want = helpers.hf_logits(hf(name), ids)
    assert got.shape == want.shape == (80, model.cfg.vocab_size)
    assert (got - want).abs().max().item() <= TOLERANCE
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_decode_logits_match_transformers(name, ours, hf, helpers):
    """Prefill 30 tokens, then decode 20 one at a time; each step against transformers' full pass."""
    ids = helpers.random_ids(50, seed=200 + SPEC_NAMES.index(name))
    model = ours(name)
    cache = model.make_cache()
    rows = [model.forward(ids[:30], cache, all_logits=True)]
    rows += [model.forward(ids[i : i + 1], cache) for i in range(30, 50)]
    got = torch.cat(rows)
    want = helpers.hf_logits(hf(name), ids)
    assert (got - want).abs().max().item() <= TOLERANCE


# --- families beyond the oracle specs -------------------------------------------------------

_SHAPE = {**oracle._SEED_SHAPE, "n_group": 2, "topk_group": 1}


def _glm4_moe_lite():
    import transformers

    shape = {k: v for k, v in _SHAPE.items() if k != "first_k_dense_replace"}
    return transformers.Glm4MoeLiteConfig(**shape)


def _glm4_moe_lite_without_q_lora():
    import transformers

    shape = {k: v for k, v in _SHAPE.items() if k != "first_k_dense_replace"}
    return transformers.Glm4MoeLiteConfig(**{**shape, "q_lora_rank": None})


def _deepseek_v3_half_rope_bias_tied():
    import transformers

    return transformers.DeepseekV3Config(
        **{**_SHAPE, "rope_interleave": False, "attention_bias": True, "tie_word_embeddings": True}
    )


def _deepseek_v3_bias_without_q_lora():
    import transformers

    return transformers.DeepseekV3Config(**{**_SHAPE, "attention_bias": True, "q_lora_rank": None})


def _glm5_dsa_with_attention_bias():
    import transformers

    return transformers.GlmMoeDsaConfig(
        **{**_SHAPE, "n_group": 1},
        attention_bias=True,
        index_topk=8,
        index_head_dim=32,
        index_n_heads=16,
        indexer_types=["full", "shared", "full", "shared", "shared"],
    )


FAMILY_CONFIGS = {
    "glm4_moe_lite": _glm4_moe_lite,
    "glm4_moe_lite-no-q-lora": _glm4_moe_lite_without_q_lora,
    "deepseek_v3-half-rope-bias-tied": _deepseek_v3_half_rope_bias_tied,
    "deepseek_v3-bias-no-q-lora": _deepseek_v3_bias_without_q_lora,
    "glm_moe_dsa-bias-dsa": _glm5_dsa_with_attention_bias,
}


@pytest.fixture(scope="module")
def family_model(request, tmp_path_factory):
    import transformers

    hf_config = FAMILY_CONFIGS[request.param]()
    torch.manual_seed(7)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    return request.param, hf_model, load_model(directory, device="cpu")


@pytest.mark.parametrize("family_model", list(FAMILY_CONFIGS), indirect=True)
def test_other_families_match_transformers(family_model, helpers):
    name, hf_model, model = family_model
    ids = helpers.random_ids(40, seed=300)
    want = helpers.hf_logits(hf_model, ids)
    got = model.forward(ids, model.make_cache(), all_logits=True)
    assert (got - want).abs().max().item() <= TOLERANCE, name
    cache = model.make_cache()
    stepped = torch.cat(
        [model.forward(ids[:20], cache, all_logits=True)]
        + [model.forward(ids[i : i + 1], cache) for i in range(20, 40)]
    )
    assert (stepped - want).abs().max().item() <= TOLERANCE, name
