"""Sampling: greedy, seeded reproducibility, top-k / top-p cuts, and the drawn distribution."""

from __future__ import annotations

import math

import pytest
import torch

from latentkv.engine.sampling import SamplingParams, sample

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
DRAWS = 4000
# Chi-square with 3 degrees of freedom exceeds 25 with probability ~1.6e-5: a loose bound that a
# wrong distribution (even one that is 0.03 off on a single token) blows far past at 4000 draws.
CHI2_BOUND = 25.0


def _logits(seed: int, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    g = params.generator()
    return torch.tensor([sample(logits, params, g) for _ in range(n)])


def _chi2(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    n = counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    e = expected[support] * n
    return float(((counts[support] - e) ** 2 / e).sum())


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = _logits(seed)
    assert sample(logits, SamplingParams()) == int(torch.argmax(logits))
    assert SamplingParams().greedy


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_and_tiny_top_p_are_greedy(seed):
    logits = _logits(seed)
    best = int(torch.argmax(logits))
    for params in (
        SamplingParams(temperature=1.5, top_k=1, seed=seed),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=seed),
    ):
        assert set(_draw(logits, params, 50).tolist()) == {best}, params


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.zeros(1000)
    a = _draw(logits, SamplingParams(temperature=1.0, seed=123), 40)
    b = _draw(logits, SamplingParams(temperature=1.0, seed=123), 40)
    c = _draw(logits, SamplingParams(temperature=1.0, seed=124), 40)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_temperature_1_draws_the_softmax_distribution():
    tokens = _draw(PROBS.log().float(), SamplingParams(temperature=1.0, seed=1), DRAWS)
    assert _chi2(tokens, PROBS) < CHI2_BOUND


def test_temperature_rescales_the_logits():
    t = 2.0
    expected = PROBS ** (1 / t)
    expected /= expected.sum()
    tokens = _draw(PROBS.log().float(), SamplingParams(temperature=t, seed=2), DRAWS)
    assert _chi2(tokens, expected) < CHI2_BOUND
    assert _chi2(tokens, PROBS) > 100  # distinguishable from temperature 1


def _hf_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution transformers' warpers sample from (temperature, then top-k, then top-p)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.double()[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [
        (2, 1.0),  # keeps 0.3, 0.4
        (0, 0.5),  # 0.4 < 0.5 before the second token, 0.7 >= 0.5 before the third: keeps 0.3, 0.4
        (0, 0.95),  # keeps all four
        (3, 0.8),  # keeps 0.2, 0.3, 0.4
        (3, 0.75),  # renormalised over the top 3, keeps 0.3, 0.4
    ],
)
def test_top_k_and_top_p_draw_what_transformers_warpers_keep(top_k, top_p):
    logits = PROBS.log().float()
    expected = _hf_distribution(logits, 1.0, top_k, top_p)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=3 + top_k)
    tokens = _draw(logits, params, DRAWS)
    assert _chi2(tokens, expected) < CHI2_BOUND


def test_sampling_never_picks_a_masked_token():
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    tokens = _draw(logits, SamplingParams(temperature=0.7, seed=6), 500)
    assert set(tokens.tolist()) <= {0, 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_invalid_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
