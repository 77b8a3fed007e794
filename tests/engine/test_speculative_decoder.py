"""Speculative decoding's rules on a fake order-1 model (fast, exact distributions), and the
pause rule with drafts that are always wrong.

The fake's main logits at a position depend only on the token there (table `main`); its draft
layer predicts the token after next from the next token alone (table `draft`). Caches are token
lists, so rollback is checked exactly: after generation the main cache must hold what plain
decoding leaves (the prompt and every generated token but the last).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from latentkv.engine.sampling import SamplingParams
from latentkv.engine.speculative import (
    DraftGovernor,
    SpeculativeConfig,
    SpeculativeDecoder,
    SpeculativeStats,
    accept_sampled,
    check_model,
)

# chi-square critical values at significance 0.001 (26 and 8 degrees of freedom)
CHI2_CRIT_26_0001 = 54.052
CHI2_CRIT_8_0001 = 26.124


class TokenCache:
    def __init__(self):
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def hold_for_rollback(self, n: int) -> None:
        pass

    def trim(self, n: int) -> None:
        assert 0 <= n <= self.length
        del self.tokens[n:]


class MarkovModel:
    """main[t]: logits of the token after t; draft[t]: the draft's logits of the token after t's successor."""

    def __init__(self, main: torch.Tensor, draft: torch.Tensor, clock: list[float] | None = None):
        self.main, self.draft_table = main, draft
        self.device = main.device
        V = main.shape[0]
        self.cfg = SimpleNamespace(max_position_embeddings=100_000, vocab_size=V, eos_token_ids=())
        self.mtp = SimpleNamespace(cache_like=lambda cache: TokenCache())
        self.clock = clock  # a fake clock: forward costs 1 + 0.1 per token, a draft call 0.2

    def forward(self, tokens, cache, all_logits=False, hidden=False):
        cache.tokens.extend(tokens.tolist())
        if self.clock is not None:
            self.clock[0] += 1.0 + 0.1 * len(tokens)
        logits = self.main[tokens]
        logits = logits if all_logits or len(tokens) == 1 else logits[-1:]
        return (logits, torch.zeros(len(tokens), 1)) if hidden else logits

    def verify(self, tokens, cache):
        return self.forward(tokens, cache, all_logits=True, hidden=True)

    def draft(self, next_tokens, hidden, cache, position, last_only=False):
        assert position == len(cache.tokens)  # the draft cache starts at position 0 here
        cache.tokens.extend(next_tokens.tolist())
        if self.clock is not None:
            self.clock[0] += 0.2
        logits = self.draft_table[next_tokens]
        return (logits[-1:], hidden[-1:]) if last_only else (logits, hidden)


def _run(model, prompt, n_tokens, sampling, cfg, generator=None, rule=None, clock=None):
    cache = TokenCache()
    options = {"rule": rule} if rule else {}
    if clock is not None:
        options["clock"] = lambda: clock[0]
    dec = SpeculativeDecoder(model, cache, sampling, cfg, generator=generator, **options)
    out = [dec.start(prompt)]
    while len(out) < n_tokens:
        out += dec.step(n_tokens - len(out))
    return out, cache, dec


def _greedy_plain(main: torch.Tensor, last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = int(main[last].argmax())
        out.append(last)
    return out


@pytest.mark.parametrize("draft_tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("quality", ["random", "perfect"])
def test_greedy_equals_plain_and_rolls_back(draft_tokens, quality):
    g = torch.Generator().manual_seed(draft_tokens)
    V = 11
    main = torch.randn(V, V, generator=g)
    if quality == "perfect":  # the draft predicts the main model's token after next
        nxt = main.argmax(-1)
        draft = torch.full((V, V), -5.0)
        draft[torch.arange(V), nxt] = 5.0
    else:
        draft = torch.randn(V, V, generator=g)
    cfg = SpeculativeConfig(draft_tokens=draft_tokens, adaptive=False)
    out, cache, dec = _run(MarkovModel(main, draft), [3, 4], 40, SamplingParams(), cfg)
    assert out == _greedy_plain(main, 4, 40)
    assert cache.tokens == [3, 4] + out[:-1][: cache.length - 2]
    assert cache.length <= 2 + 40
    if quality == "perfect":
        assert dec.stats.acceptance == [1.0] * draft_tokens
    # the draft cache holds, at each position i, the token at i + 1: no rejected or chained draft
    seq = [3, 4] + out
    n = dec.draft_cache.length
    assert n >= 2 and dec.draft_cache.tokens == seq[1 : 1 + n]


def _joint_counts(model, prompt, cfg, samples, temperature, rule=None) -> torch.Tensor:
    V = model.main.shape[0]
    counts = torch.zeros(V, V, V)
    g = torch.Generator().manual_seed(20261201)
    sampling = SamplingParams(temperature=temperature)
    for _ in range(samples):
        out, _, _ = _run(model, prompt, 4, sampling, cfg, generator=g, rule=rule)
        counts[out[0], out[1], out[2]] += 1
    return counts


def _exact_joint(main: torch.Tensor, last: int, temperature: float) -> torch.Tensor:
    p = torch.softmax(main.double() / temperature, dim=-1)
    return p[last][:, None, None] * p[:, :, None] * p[None, :, :]  # x1 | last, x2 | x1, x3 | x2


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten() * counts.sum()
    return float(((counts.flatten().double() - expected) ** 2 / expected).sum())


def _markov_pair():
    g = torch.Generator().manual_seed(7)
    main = torch.randn(3, 3, generator=g) * 0.8
    draft = torch.tensor([[2.0, -1.0, 0.0], [-1.0, 0.0, 2.0], [0.0, 2.0, -1.0]])  # confidently different
    return main, draft


# Draws of the joint-distribution test: the default suite runs the cheap form (the same rule,
# seed and critical value, fewer draws), `-m slow` the full one.
SAMPLE_SIZES = [600, pytest.param(3000, marks=pytest.mark.slow)]


@pytest.mark.parametrize("samples", SAMPLE_SIZES)
def test_sampling_distribution_is_unchanged(samples):
    """The first 3 tokens' joint distribution (27 cells) over `samples` runs with 2 drafts per
    round, against the exact one of plain sampling: chi-square at significance 0.001 (26 d.o.f.).
    The generator is seeded, so the outcome is fixed; a correct rule fails one seed in a thousand."""
    main, draft = _markov_pair()
    counts = _joint_counts(
        MarkovModel(main, draft), [0, 1], SpeculativeConfig(draft_tokens=2, adaptive=False), samples, 0.9
    )
    assert _chi_square(counts, _exact_joint(main, 1, 0.9)) < CHI2_CRIT_26_0001


@pytest.mark.parametrize("samples", SAMPLE_SIZES)
def test_the_distribution_test_catches_a_wrong_acceptance_rule(samples):
    """The same test with drafts always accepted (the draft's distribution leaks into the output)
    must fail at the same number of draws: the statistic past the critical value."""
    main, draft = _markov_pair()
    counts = _joint_counts(
        MarkovModel(main, draft),
        [0, 1],
        SpeculativeConfig(draft_tokens=2, adaptive=False),
        samples,
        0.9,
        rule=lambda p, q, u: True,
    )
    assert _chi_square(counts, _exact_joint(main, 1, 0.9)) > CHI2_CRIT_26_0001


def test_accept_sampled_marginal_is_p():
    """One position, many draws: token frequencies from draft-then-accept match p (8 d.o.f.)."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(9, generator=g), 0)
    q = torch.softmax(torch.randn(9, generator=g) * 2, 0)
    counts = torch.zeros(9)
    for _ in range(4000):
        d = int(torch.multinomial(q, 1, generator=g))
        kept, token = accept_sampled(torch.stack([p, p]), q[None], [d], g)
        counts[d if kept else token] += 1
    assert _chi_square(counts, p.double()) < CHI2_CRIT_8_0001


def test_drafting_pauses_when_drafts_are_always_wrong():
    """Drafts never match (a = 1 token per round) and a round costs more than a plain step:
    after the first round drafting pauses, and only probes run (one per probe_every steps)."""
    V = 7
    main = torch.zeros(V, V)
    main[torch.arange(V), (torch.arange(V) + 1) % V] = 5.0  # after t comes t + 1
    draft = torch.zeros(V, V)
    draft[torch.arange(V), (torch.arange(V) + 2) % V] = 5.0  # given t next, says t + 2: always wrong
    clock = [0.0]
    cfg = SpeculativeConfig(draft_tokens=2, probe_every=16)
    out, _, dec = _run(MarkovModel(main, draft, clock), [0], 200, SamplingParams(), cfg, clock=clock)
    assert out == _greedy_plain(main, 0, 200)
    assert dec.stats.acceptance == [0.0, 0.0]
    steps = dec.stats.rounds + dec.stats.plain_steps
    assert dec.stats.rounds <= steps // 16 + 2  # the first round, then one probe per 16 steps
    assert dec.stats.rounds >= 2  # probing goes on


def test_drafting_continues_when_it_pays():
    V = 7
    main = torch.zeros(V, V)
    main[torch.arange(V), (torch.arange(V) + 1) % V] = 5.0
    draft = torch.zeros(V, V)
    draft[torch.arange(V), (torch.arange(V) + 1) % V] = 5.0  # given t next, the token after is t + 1: right
    clock = [0.0]
    cfg = SpeculativeConfig(draft_tokens=2, probe_every=16)
    out, _, dec = _run(MarkovModel(main, draft, clock), [0], 200, SamplingParams(), cfg, clock=clock)
    assert out == _greedy_plain(main, 0, 200)
    assert dec.stats.acceptance == [1.0, 1.0]
    assert dec.stats.plain_steps <= dec.stats.rounds // 16 + 2  # the first, then refreshes
    assert dec.stats.speedup is not None and dec.stats.speedup > 1.5


def test_governor_rule():
    gov = DraftGovernor(SpeculativeConfig(draft_tokens=2, probe_every=4, smoothing=1.0))
    assert not gov.draft_next()  # the first step is plain
    gov.record_plain(1.0)
    assert gov.draft_next()
    gov.record_round(tokens=1, seconds=1.5)  # 1 token for 1.5 plain steps: does not pay
    assert not gov.pays()
    decisions = [gov.draft_next() for _ in range(10)]
    assert decisions.count(True) == 2  # a probe after 4 plain steps, twice in 10
    gov.record_round(tokens=2, seconds=1.5)
    assert gov.pays()


def test_stats_per_position():
    stats = SpeculativeStats(3)
    stats.record_round(3, 1, 1.0)  # d1 kept, d2 rejected
    stats.record_round(3, 3, 1.0)
    assert stats.acceptance == [1.0, 0.5, 0.5]
    assert stats.tokens_per_verify == 3.0


def test_a_model_without_mtp_is_refused():
    with pytest.raises(ValueError, match="MTP"):
        check_model(SimpleNamespace(mtp=None))


@pytest.mark.parametrize("bad", [0, 9])
def test_draft_tokens_range(bad):
    with pytest.raises(ValueError, match="draft-tokens"):
        SpeculativeConfig(draft_tokens=bad)
