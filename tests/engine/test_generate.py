"""Layered generation: greedy tokens against transformers, stop tokens, limits, stats, text deltas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from latentkv.engine.generate import generate, generate_step, stream_generate
from latentkv.engine.sampling import SamplingParams
from latentkv.tokenizer import Tokenizer


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """The slow reference: transformers' full forward over the whole sequence for every token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf_model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny"])
def test_greedy_generation_matches_transformers(name, ours, hf, helpers):
    prompt = helpers.random_ids(10, seed=400).tolist()
    result = generate(ours(name), prompt, 30, SamplingParams(), stop_ids=())
    assert result.tokens == _hf_greedy(hf(name), prompt, 30)
    assert result.stats.finish_reason == "length"


def test_stats_and_kv_bytes_count_the_tokens_actually_cached(ours, helpers):
    model = ours("glm5-tiny-dsa")
    cfg = model.cfg
    prompt = helpers.random_ids(11, seed=401).tolist()
    cache = model.make_cache()
    result = generate(model, prompt, 9, SamplingParams(), cache=cache, stop_ids=())
    stats = result.stats
    assert len(result.tokens) == stats.generated_tokens == 9
    assert stats.prompt_tokens == 11
    assert stats.decode_passes == 8  # the first token comes from the prefill logits
    # The last generated token is returned but never fed back, so it is not in the cache.
    assert cache.length == 11 + 9 - 1
    per_layer = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert stats.kv_bytes_per_token_layer == per_layer
    assert stats.kv_bytes == per_layer * cfg.num_layers * cache.length
    full_layers = sum(t == "full" for t in cfg.dsa.indexer_types)
    assert stats.index_kv_bytes == 4 * cfg.dsa.index_head_dim * full_layers * cache.length
    assert stats.kv_cache_dtype == "f32"
    assert stats.prompt_seconds > 0 and stats.decode_seconds > 0
    d = stats.as_dict()
    assert d["kv_bytes"] == stats.kv_bytes and "prompt_tps" in d and "decode_tps" in d
    assert f"{stats.kv_bytes:,} bytes" in stats.line()


def test_a_stop_token_ends_generation_and_is_returned_but_not_decoded(ours, tiny_dir, helpers):
    model, tok = ours("glm5-tiny"), Tokenizer(tiny_dir)
    prompt = helpers.random_ids(8, seed=402).tolist()
    free = generate(model, prompt, 12, SamplingParams(), stop_ids=()).tokens
    stop = free[4]
    cut = free.index(stop)  # the first occurrence ends it
    result = generate(model, prompt, 12, SamplingParams(), tokenizer=tok, stop_ids=(stop,))
    assert result.tokens == free[: cut + 1]
    assert result.stats.finish_reason == "stop"
    assert result.text == tok.decode(free[:cut])


def test_default_stop_ids_are_the_configs_eos(ours, helpers, monkeypatch):
    model = ours("glm5-tiny")
    prompt = helpers.random_ids(8, seed=403).tolist()
    free = generate(model, prompt, 6, SamplingParams(), stop_ids=()).tokens
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, eos_token_ids=(free[2],)))
    result = generate(model, prompt, 6, SamplingParams())
    assert result.tokens == free[: free.index(free[2]) + 1]
    assert result.stats.finish_reason == "stop"


def test_generation_stops_at_max_position_embeddings(ours, helpers, monkeypatch):
    model = ours("glm5-tiny")
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, max_position_embeddings=20))
    prompt = helpers.random_ids(12, seed=404).tolist()
    cache = model.make_cache()
    result = generate(model, prompt, 50, SamplingParams(), cache=cache, stop_ids=())
    # 12 prompt positions + 8 fed-back tokens fill the 20; the 9th token needs no position.
    assert len(result.tokens) == 9
    assert result.stats.finish_reason == "length"
    assert cache.length <= 20


def test_max_tokens_zero_generates_nothing(ours):
    result = generate(ours("glm5-tiny"), [5, 6, 7], 0, SamplingParams())
    assert result.tokens == []
    assert result.stats.finish_reason == "length"
    assert result.stats.kv_bytes_per_token_layer > 0


@pytest.mark.parametrize(
    ("prompt", "message"), [([], "empty"), ([5, 256], "out of range"), ([-1], "out of range")]
)
def test_bad_prompts_are_refused(prompt, message, ours):
    model = ours("glm5-tiny")
    with pytest.raises(ValueError, match=message):
        next(generate_step(model, prompt, model.make_cache(), SamplingParams(), _stats()))


def _stats():
    from latentkv.engine.generate import GenerationStats

    return GenerationStats()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_deltas_join_to_the_full_decode(seed, ours, tiny_dir):
    """Sampled bytes from a random model: plenty of partial and invalid UTF-8 sequences."""
    model, tok = ours("glm5-tiny"), Tokenizer(tiny_dir)
    prompt = tok.encode("héllo ✓ ")
    params = SamplingParams(temperature=1.5, seed=seed)
    tokens, deltas = [], []
    for token, delta, _ in stream_generate(model, prompt, 24, params, tok, stop_ids=()):
        tokens.append(token)
        deltas.append(delta)
    assert len(tokens) == 24
    assert "".join(deltas) == tok.decode(tokens)


def test_seeded_sampled_generation_is_reproducible(ours, helpers):
    model = ours("glm5-tiny")
    prompt = helpers.random_ids(6, seed=405).tolist()
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    a = generate(model, prompt, 16, params, stop_ids=()).tokens
    b = generate(model, prompt, 16, params, stop_ids=()).tokens
    greedy = generate(model, prompt, 16, SamplingParams(), stop_ids=()).tokens
    assert a == b
    assert a != greedy
