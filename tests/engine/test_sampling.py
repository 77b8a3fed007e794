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


# --- extreme values: one validation, a sampler that never produces nan ---------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from latentkv.engine.sampling import SamplingError, check_sampling, weights  # noqa: E402

_LOGIT = st.one_of(
    st.floats(-1e4, 1e4, allow_nan=False, width=32),
    st.just(float("-inf")),
    st.sampled_from([0.0, 1e-30, -1e-30, 3.0]),  # ties and near-ties
)
_TEMPERATURE = st.one_of(
    st.floats(0, 1e6, allow_subnormal=True),
    st.sampled_from([5e-324, 1e-308, 1e-39, 1e-300, 1e-46, 1e-7]),
)
_TOP_P = st.one_of(
    st.floats(0, 1, exclude_min=True, allow_subnormal=True),
    st.sampled_from([5e-324, 1e-46, 1e-300, 1.0]),
)


def _above(v: float, w: float, temperature: float) -> bool:
    """v more likely than w beyond float64 rounding of exp((v - w) / temperature)."""
    return (v - w) / temperature > 1e-12


def _reference_top(logits: list[float], temperature: float, top_k: int) -> tuple[float, float]:
    """(the largest logit, its probability among what top-k keeps), in plain Python floats."""
    finite = [x for x in logits if x != float("-inf")]
    best = max(finite)
    kept = sorted(finite, reverse=True)[: top_k or None]
    kept = [x for x in finite if not _above(kept[-1], x, temperature)]  # ties at the k-th are kept
    total = 0.0
    for x in kept:
        gap = (best - x) / temperature
        total += 0.0 if gap > 1000 else math.exp(-gap)
    return best, 1.0 / total


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_LOGIT, min_size=1, max_size=12).filter(lambda xs: any(x != float("-inf") for x in xs)),
    _TEMPERATURE,
    _TOP_P,
    st.integers(0, 14),
    st.integers(0, 2**32),
)
def test_extreme_values_sample_a_token_the_reference_allows(logits, temperature, top_p, top_k, seed):
    """Any valid temperature / top_p / top_k, subnormals included: finite weights, and the token
    drawn is one the plain-Python reference allows (a finite logit, within top-k, the most
    likely one when top_p is below its mass or the temperature is far below every gap)."""
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    tensor = torch.tensor(logits, dtype=torch.float32)
    w = weights(tensor, params) if not params.greedy else None
    if w is not None:
        assert torch.isfinite(w).all() and (w >= 0).all() and float(w.max()) == 1.0
    token = sample(tensor, params, params.generator())
    values = tensor.tolist()
    assert 0 <= token < len(values) and values[token] != float("-inf")
    if params.greedy:
        assert values[token] == max(values)
        return
    best, p_best = _reference_top(values, temperature, top_k)

    def above(v: float, w: float) -> bool:
        return _above(v, w, temperature)

    if top_k:
        assert sum(above(v, values[token]) for v in values) < top_k  # within the k most likely
    gaps = [best - v for v in values if v != best and v != float("-inf")]
    if top_p < p_best * (1 - 1e-9) or all(g / temperature > 1000 for g in gaps):
        assert not above(best, values[token])


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -math.inf}, "temperature"),
        ({"temperature": -5e-324}, "temperature"),
        ({"top_p": math.inf}, "top_p"),
        ({"top_p": -0.0}, "top_p"),
        ({"top_p": 1.0000000000000002}, "top_p"),
        ({"top_k": True}, "top_k"),
        ({"temperature": "1"}, "temperature"),
    ],
)
def test_the_shared_check_names_the_parameter(kwargs, param):
    with pytest.raises(SamplingError) as info:
        check_sampling(**kwargs)
    assert info.value.param == param
    with pytest.raises(SamplingError):  # generate's params and the scheduler's requests are one class
        SamplingParams(**kwargs)
    with pytest.raises(SamplingError):
        SamplingParams(max_tokens=1, **kwargs)


@pytest.mark.parametrize("seed", [-1, 2**64, True])
def test_seeds_outside_what_torch_takes_are_refused(seed):
    with pytest.raises(SamplingError, match="seed"):
        SamplingParams(temperature=1.0, seed=seed)
