"""Speculative decoding with the model's own MTP draft layer: lossless, in every KV tier.

One round, with the pending token t at position Q (sampled, not yet in the main cache):

    draft   the MTP layer reads what it has not seen yet (the backlog: positions whose main
            hidden state and next token are known), which yields d_1; chained N-1 more times on
            its own hidden state it yields d_2..d_N (`models/mtp.py`)
    verify  one main forward over [t, d_1..d_N] at positions Q..Q+N: logits p_0..p_N
    accept  greedy: the longest prefix with d_j == argmax p_{j-1}, then argmax p_k;
            sampling (temperature > 0): d_j is kept with probability min(1, p(d_j) / q(d_j)),
            and on the first rejection the next token is drawn from norm(max(0, p - q));
            all kept: a bonus token from p_N. Either way the output has exactly the
            distribution of plain decoding (Leviathan et al. 2023; tested statistically).
    rollback the main cache is trimmed to Q + k + 1 (t and the k kept drafts; DSA indexer keys
            and every tier's rows go with it), the MTP cache to Q (its chained rows were
            computed from estimated hidden states); the kept positions become the backlog.

Sampling stays a pure function of (logits, params, generator): `probabilities` is what
`sample` draws from, and the acceptance tests read the same generator.

When drafting stops paying it pauses (`DraftGovernor`): with a = the moving average of tokens
per round (kept drafts + 1) and r = the moving average of a round's seconds over a plain
step's, a round yields a tokens for the price of r plain steps, so rounds run while a >= r.
Paused, a plain step runs instead, and every `probe_every` steps one round runs anyway to
refresh a and r (drafting also takes one plain step every `probe_every` rounds, to keep the
plain cost current). The first decode step is plain: it measures the plain cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from latentkv.engine.sampling import SamplingParams, probabilities

METHODS = ("mtp",)
MAX_DRAFT_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative mtp --draft-tokens N`: how many tokens the MTP layer drafts per round,
    and whether drafting pauses by itself when it measures slower than plain decoding."""

    method: str = "mtp"
    draft_tokens: int = 1
    adaptive: bool = True
    probe_every: int = 16
    smoothing: float = 0.2  # weight of the newest measurement in the moving averages

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} (valid: {', '.join(METHODS)})")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--draft-tokens must be in 1..{MAX_DRAFT_TOKENS} (got {self.draft_tokens})")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 (got {self.probe_every})")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1] (got {self.smoothing})")


def check_model(model) -> None:
    """Refuse, in one line, a model without an MTP layer."""
    if model.mtp is None:
        raise ValueError(
            "--speculative mtp needs a model with an MTP (multi-token prediction) layer: this "
            "checkpoint has none (num_nextn_predict_layers is 0 or its tensors are missing)"
        )


# --- statistics ---------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """What drafting did: acceptance per draft position, tokens per verify, measured costs."""

    draft_tokens: int = 1
    rounds: int = 0  # verify steps
    plain_steps: int = 0  # decode steps without drafting (paused, probes, the first)
    proposed: list[int] = field(default_factory=list)  # per draft position: times drafted
    accepted: list[int] = field(default_factory=list)  # per draft position: times kept
    round_tokens: int = 0  # tokens the rounds produced (kept drafts + 1 each)
    round_seconds: float = 0.0
    plain_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.proposed = self.proposed or [0] * self.draft_tokens
        self.accepted = self.accepted or [0] * self.draft_tokens

    def record_round(self, drafted: int, kept: int, seconds: float) -> None:
        self.rounds += 1
        for j in range(drafted):
            self.proposed[j] += 1
            self.accepted[j] += j < kept
        self.round_tokens += kept + 1
        self.round_seconds += seconds

    @property
    def acceptance(self) -> list[float]:
        """Per draft position j: the fraction of the drafted tokens at position j that were kept
        (a round's d_j counts as drafted whether or not an earlier draft was rejected, so with N
        drafts every round, tokens per verify = 1 + the sum of these)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed, strict=True)]

    @property
    def tokens_per_verify(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def speedup(self) -> float | None:
        """Measured tokens/s of rounds over tokens/s of plain steps (None until both ran)."""
        if not (self.rounds and self.plain_steps and self.round_seconds and self.plain_seconds):
            return None
        return (self.round_tokens / self.round_seconds) / (self.plain_steps / self.plain_seconds)

    def as_dict(self) -> dict:
        return {
            "method": "mtp",
            "draft_tokens": self.draft_tokens,
            "verify_steps": self.rounds,
            "plain_steps": self.plain_steps,
            "acceptance_per_position": [round(a, 4) for a in self.acceptance],
            "tokens_per_verify": round(self.tokens_per_verify, 4),
            "speedup": None if self.speedup is None else round(self.speedup, 3),
        }

    def line(self) -> str:
        acc = " ".join(f"{a:.2f}" for a in self.acceptance)
        speed = "n/a" if self.speedup is None else f"{self.speedup:.2f}x"
        return (
            f"speculative: mtp x{self.draft_tokens}, acceptance [{acc}], "
            f"{self.tokens_per_verify:.2f} tokens/verify over {self.rounds} verifies "
            f"(+{self.plain_steps} plain steps), speed-up {speed} vs plain steps"
        )


# --- the pause rule -----------------------------------------------------------------------


class DraftGovernor:
    """Decides, step by step, whether to draft (see the module docstring for the rule)."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.tokens_per_round: float | None = None  # a: moving average of tokens per round
        self.round_seconds: float | None = None
        self.plain_seconds: float | None = None
        self.since_other = 0  # steps taken in the current mode since the other one last ran

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.cfg.smoothing * (new - old)

    def record_round(self, tokens: int, seconds: float) -> None:
        self.tokens_per_round = self._average(self.tokens_per_round, tokens)
        self.round_seconds = self._average(self.round_seconds, seconds)

    def record_plain(self, seconds: float) -> None:
        self.plain_seconds = self._average(self.plain_seconds, seconds)

    def pays(self) -> bool:
        """a >= r: a round's tokens are worth its cost in plain steps (True until measured)."""
        if self.tokens_per_round is None or not self.plain_seconds or self.round_seconds is None:
            return True
        return self.tokens_per_round >= self.round_seconds / self.plain_seconds

    def draft_next(self) -> bool:
        """Whether the next step is a round (True) or a plain step (False)."""
        if not self.cfg.adaptive:
            return True
        if self.plain_seconds is None:
            return False  # the first decode step is plain: it measures the plain cost
        preferred = self.pays()
        if self.since_other >= self.cfg.probe_every:  # refresh the other mode's estimate
            self.since_other = 0
            return not preferred
        self.since_other += 1
        return preferred


# --- acceptance ---------------------------------------------------------------------------


def standard_accept(p: float, q: float, u: float) -> bool:
    """Speculative sampling's test: keep a draft drawn from q with probability min(1, p / q)."""
    return u * q < p


AcceptRule = Callable[[float, float, float], bool]


def accept_sampled(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator | None,
    rule: AcceptRule = standard_accept,
) -> tuple[int, int]:
    """p [N+1, vocab] the main model's distributions at the verified positions, q [N, vocab] the
    drafts' (each d_j drawn from q[j]) -> (k drafts kept, the next token). Drawn on the host,
    where the generator is."""
    for j, d in enumerate(drafts):
        u = float(torch.rand(1, generator=generator, device=torch.device("cpu")))
        if rule(float(p[j, d]), float(q[j, d]), u):
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]  # p == q: the residual is empty, sample p
        return j, int(torch.multinomial(dist.cpu(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)].cpu(), 1, generator=generator))


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """logits [N+1, vocab] of the verified positions -> (k drafts kept, the next token): the
    longest prefix the main model's argmax agrees with, then its own argmax."""
    best = logits.argmax(dim=-1).tolist()
    for j, d in enumerate(drafts):
        if best[j] != d:
            return j, best[j]
    return len(drafts), best[len(drafts)]


# --- one sequence -------------------------------------------------------------------------


class SpeculativeDecoder:
    """One sequence's drafting state over its main cache: `start` prefills, `step` decodes."""

    def __init__(
        self,
        model,
        cache,
        sampling: SamplingParams,
        cfg: SpeculativeConfig,
        stats: SpeculativeStats | None = None,
        generator: torch.Generator | None = None,
        clock: Callable[[], float] = time.perf_counter,
        rule: AcceptRule = standard_accept,
    ):
        check_model(model)
        self.model, self.cache, self.sampling, self.cfg = model, cache, sampling, cfg
        self.stats = stats if stats is not None else SpeculativeStats(cfg.draft_tokens)
        self.generator, self.clock, self.rule = generator, clock, rule
        self.governor = DraftGovernor(cfg)
        self.draft_cache = model.mtp.cache_like(cache)
        cache.hold_for_rollback(cfg.draft_tokens)  # a recent window stays exact across rollbacks
        self.draft_cache.hold_for_rollback(cfg.draft_tokens)
        self.draft_start = cache.length  # the position of the MTP cache's first row
        self.back_tokens: list[int] = []  # backlog: the token after each position not yet drafted from
        self.back_hidden: list[torch.Tensor] = []  # and the main model's hidden states there
        self.pending = -1  # the last token produced, not yet in the main cache
        self._drafts: list[int] = []  # this step's drafts
        self._qs: list[torch.Tensor] = []  # the distributions they were drawn from (sampling)
        self._draft_h: torch.Tensor | None = None  # the draft layer's last state, to chain from
        self._verify_start = self._chained = 0

    def _pick(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(probabilities(logits, self.sampling).cpu(), 1, generator=self.generator))

    def start(self, prompt: list[int]) -> int:
        """Prefill the prompt; returns the first generated token."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
        logits, h = self.model.forward(ids, self.cache, hidden=True)
        first = self._pick(logits[-1])
        self.begin(prompt, h, first)
        return first

    def begin(self, prompt: list[int], hidden: torch.Tensor, first: int) -> None:
        """After a prefill of `prompt` done elsewhere (a server's batched pass): its hidden
        states [S, D] and the first sampled token seed the draft layer."""
        self.draft_start = self.cache.length - len(prompt)
        self.pending = first
        self.back_tokens = prompt[1:] + [first]
        self.back_hidden = [hidden]

    def step(self, remaining: int) -> list[int]:
        """Decode the next tokens (at most `remaining`, >= 1): one round or one plain step."""
        t0 = self.clock()
        feed = self.plan(remaining)
        logits, h = self.model.verify(torch.tensor(feed, device=self.model.device), self.cache)
        tokens = self.settle(logits, h)
        self.record(len(feed) - 1, len(tokens), self.clock() - t0)
        return tokens

    def plan(self, remaining: int) -> list[int]:
        """The tokens this step feeds the main model: [pending] for a plain step, or [pending,
        d_1..d_n] for a round (drafted now). `settle` takes the verify pass's output."""
        draft_together(self.model, [self], [self.decide(remaining)])
        return self.feed()

    def decide(self, remaining: int) -> int:
        """How many tokens to draft this step (0: a plain step), at most `remaining` - 1."""
        room = self.model.cfg.max_position_embeddings - self.cache.length - 1
        n = min(self.cfg.draft_tokens, room, remaining - 1)
        self._verify_start = self.cache.length
        self._drafts, self._qs = [], []
        self._chained = self.draft_cache.length
        return n if n >= 1 and self.governor.draft_next() else 0

    def feed(self) -> list[int]:
        """[pending, *drafts] once `draft_together` has drafted."""
        return [self.pending, *self._drafts]

    def settle(self, logits: torch.Tensor, hidden: torch.Tensor) -> list[int]:
        """logits [n+1, vocab] and hidden [n+1, D] of the fed positions -> the tokens produced
        (the kept drafts and one more); caches rolled back past the rejected drafts."""
        drafts = self._drafts
        if self.sampling.greedy:
            kept, token = accept_greedy(logits, drafts)
        elif drafts:
            p = torch.stack([probabilities(row, self.sampling) for row in logits])
            kept, token = accept_sampled(p, torch.stack(self._qs), drafts, self.generator, self.rule)
        else:
            kept, token = 0, self._pick(logits[0])
        if drafts:
            self.cache.trim(self._verify_start + kept + 1)
            self.draft_cache.trim(self._chained)
        self.pending = token
        self.back_tokens += [*drafts[:kept], token]
        self.back_hidden.append(hidden[: kept + 1])
        return [*drafts[:kept], token]

    def record(self, drafted: int, produced: int, seconds: float) -> None:
        """Account a step of `seconds` (the pause rule and the statistics)."""
        if drafted:
            self.governor.record_round(produced, seconds)
            self.stats.record_round(drafted, produced - 1, seconds)
        else:
            self.governor.record_plain(seconds)
            self.stats.plain_steps += 1
            self.stats.plain_seconds += seconds

    def _backlog(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions the draft layer has not read: (next tokens [S], hidden states [S, D])."""
        tokens = torch.tensor(self.back_tokens, dtype=torch.long, device=self.model.device)
        hidden = torch.cat(self.back_hidden)
        self.back_tokens, self.back_hidden = [], []
        return tokens, hidden

    def _take_draft(self, logits: torch.Tensor) -> None:
        """Draw the next draft from logits [vocab] (keeping q when sampling)."""
        if self.sampling.greedy:
            self._drafts.append(int(logits.argmax()))
            return
        self._qs.append(probabilities(logits, self.sampling))
        self._drafts.append(int(torch.multinomial(self._qs[-1].cpu(), 1, generator=self.generator)))

    def _draft_position(self) -> int:
        return self.draft_start + self.draft_cache.length


def draft_together(model, decoders: list[SpeculativeDecoder], counts: list[int]) -> None:
    """Draft counts[b] tokens for decoders[b] (0: none), the B sequences' draft-layer passes
    batched: one over every backlog, then one per further draft position; a single sequence
    uses the one-sequence pass. Each decoder's drafts are then in `feed()`."""
    active = [(dec, n) for dec, n in zip(decoders, counts, strict=True) if n >= 1]
    for j in range(max((n for _, n in active), default=0)):
        group = [dec for dec, n in active if n > j]
        if j == 0:
            tokens, hidden = zip(*(dec._backlog() for dec in group), strict=True)
        else:
            tokens = [torch.tensor(dec._drafts[-1:], device=model.device) for dec in group]
            hidden = [dec._draft_h for dec in group]
        positions = [dec._draft_position() for dec in group]
        caches = [dec.draft_cache for dec in group]
        if len(group) == 1:
            logits, h = model.draft(tokens[0], hidden[0], caches[0], positions[0], last_only=True)
        else:
            logits, h = model.draft_batch(list(tokens), list(hidden), caches, positions)
        for b, dec in enumerate(group):
            if j == 0:
                dec._chained = dec.draft_cache.length  # rows past here come from estimated states
            dec._draft_h = h[b : b + 1]
            dec._take_draft(logits[b])


def speculative_steps(
    model,
    prompt: list[int],
    cache,
    sampling: SamplingParams,
    cfg: SpeculativeConfig,
    limit: int,
    timing: Callable[[str, float], None] | None = None,
    stats: SpeculativeStats | None = None,
    **decoder_options,
) -> Iterator[int]:
    """Yield up to `limit` generated token ids (the caller may stop early); `timing(kind,
    seconds)` hears of the prefill ("prompt") and of each decode step ("decode")."""
    generator = None if sampling.greedy else sampling.generator()
    dec = SpeculativeDecoder(model, cache, sampling, cfg, stats, generator, **decoder_options)
    t0 = time.perf_counter()
    token = dec.start(prompt)
    if timing:
        timing("prompt", time.perf_counter() - t0)
    yield token
    produced = 1
    while produced < limit:
        t0 = time.perf_counter()
        tokens = dec.step(limit - produced)
        if timing:
            timing("decode", time.perf_counter() - t0)
        for token in tokens:
            produced += 1
            yield token
