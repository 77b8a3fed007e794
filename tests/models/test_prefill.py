"""Batched prefill (`Model.prefill_batch`) against one `Model.forward` per prompt.

Every prompt gets two caches; one is prefilled alone, the other in a batch. The last-token
logits must agree within float32 rounding (1e-5 relative to the largest logit) and so must the
rows each cache gained, with ragged prompt lengths on both sides of the DSA models' index_topk
(8), caches that already hold tokens (a resumed session's), and every model family.
"""

from __future__ import annotations

import pytest
import torch

from latentkv.kv.cache import LatentCache

TOLERANCE = 1e-5
PROMPTS = [1, 3, 7, 8, 9, 17, 33, 2]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _prompts(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, model.cfg.vocab_size, (n,), generator=g) for n in lengths]


def _compare(model, lengths, seed, history=None):
    """Prefill alone and batched from caches that already hold `history[b]` tokens."""
    history = history or [0] * len(lengths)
    alone, batched = [], []
    for b, prompt in enumerate(_prompts(model, history, seed + 1)):
        cache = model.make_cache()
        if history[b]:
            model.forward(prompt, cache)
        alone.append(cache)
        batched.append(LatentCache.from_state(cache.tier, cache.state()))
    prompts = _prompts(model, lengths, seed)
    expected = torch.cat([model.forward(p, c) for p, c in zip(prompts, alone, strict=True)])
    got = model.prefill_batch(prompts, batched)
    assert got.shape == expected.shape
    for b in range(len(prompts)):
        assert _relative(got[b], expected[b]) <= TOLERANCE, b
    for a, c in zip(alone, batched, strict=True):
        assert c.length == a.length
        for layer in range(model.cfg.num_layers):
            assert _relative(c.view(layer), a.view(layer)) <= TOLERANCE
        for layer in model.layout.index_layers:
            assert _relative(c.index_keys(layer), a.index_keys(layer)) <= TOLERANCE
    # and the caches decode on alike
    tokens = expected.argmax(dim=-1)
    after = model.decode_batch(tokens, batched)
    reference = torch.cat([model.forward(t[None], c) for t, c in zip(tokens, alone, strict=True)])
    assert _relative(after, reference) <= TOLERANCE


@pytest.mark.parametrize(
    "name", ["glm5-tiny-dsa", "dsv3-tiny", "glm5-tiny", "dsv32-tiny-dsa", "dsv3-tiny-noqlora"]
)
def test_ragged_prompts_match_forward(ours, name):
    _compare(ours(name), PROMPTS, seed=31)


def test_continuing_caches_match_forward(ours):
    """Caches already holding 0..20 tokens (positions and DSA selection continue from there)."""
    _compare(ours("glm5-tiny-dsa"), [4, 1, 6, 12, 3], seed=32, history=[20, 5, 0, 9, 2])


def test_one_prompt_is_forward_itself(ours):
    model = ours("glm5-tiny-dsa")
    (prompt,) = _prompts(model, [13], seed=33)
    a, b = model.make_cache(), model.make_cache()
    assert torch.equal(model.prefill_batch([prompt], [b]), model.forward(prompt, a))
    assert all(torch.equal(v, b.state()[k]) for k, v in a.state().items())


def test_rejects_bad_batches_and_commits_nothing(ours):
    model = ours("glm5-tiny-dsa")
    good = _prompts(model, [3], seed=34)[0]
    cache = model.make_cache()
    with pytest.raises(ValueError, match="one each"):
        model.prefill_batch([good], [cache, model.make_cache()])
    with pytest.raises(ValueError, match="twice"):
        model.prefill_batch([good, good], [cache, cache])
    with pytest.raises(ValueError, match="non-empty int64"):
        model.prefill_batch([good, torch.tensor([], dtype=torch.long)], [cache, model.make_cache()])
    with pytest.raises(ValueError, match="out of range"):
        model.prefill_batch([good, torch.tensor([model.cfg.vocab_size])], [cache, model.make_cache()])
    too_long = torch.ones(model.cfg.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds"):
        model.prefill_batch([good, too_long], [cache, model.make_cache()])
    assert cache.length == 0
