"""The benchmark model builder: random checkpoints transformers loads with every tensor accounted for."""

from __future__ import annotations

import json

import pytest
import torch

from latentkv.models.loader import Checkpoint
from latentkv.models.synthetic import SLICE_CONFIG, write_random_checkpoint
from latentkv.models.weights import load_model

SMALL_SLICE = {
    **SLICE_CONFIG,
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 4,
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def small_slice(tmp_path_factory):
    return write_random_checkpoint(
        SMALL_SLICE, tmp_path_factory.mktemp("slice"), seed=3, max_shard_bytes=64 * 1024
    )


def test_written_in_several_shards_with_an_index(small_slice):
    index = json.loads((small_slice / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert set(Checkpoint(small_slice).keys()) == set(index["weight_map"])


def test_transformers_loads_every_tensor_and_agrees_with_us(small_slice, helpers):
    import transformers

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        small_slice, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = helpers.random_ids(24, seed=600, vocab=SMALL_SLICE["vocab_size"])  # > index_topk: DSA selects
    want = helpers.hf_logits(hf_model.eval(), ids)
    model = load_model(small_slice, device="cpu")
    got = model.forward(ids, model.make_cache(), all_logits=True)
    assert (got - want).abs().max().item() <= 1e-4


def test_the_same_seed_writes_the_same_weights(small_slice, tmp_path):
    again = write_random_checkpoint(SMALL_SLICE, tmp_path / "again", seed=3, max_shard_bytes=64 * 1024)
    a, b = Checkpoint(small_slice), Checkpoint(again)
    assert a.fingerprint() == b.fingerprint()
    for name in sorted(a.keys()):
        assert torch.equal(a.get(name), b.get(name)), name
