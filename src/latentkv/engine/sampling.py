"""Sampling as pure functions of (logits, parameters, generator).

One validation (`check_sampling`) for every surface: the CLI's flags, the server's request
fields and the scheduler's parameters all go through it, so nan, inf and negative values are
refused alike, naming the parameter.

`sample` is numerically safe for every value that passes: the logits are shifted so their
maximum is 0 and divided by the temperature in float64, so any positive temperature, down to
the smallest subnormal, gives finite weights in [0, 1] with the most likely token at exactly 1
(a temperature far below the logits' gaps is greedy, ties shared); top-p compares float64
cumulative mass with top_p, and the most likely token is always kept, so a top_p of 1e-300 is
greedy rather than an empty distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from latentkv.engine.grammar import GrammarSpec


class SamplingError(ValueError):
    """An invalid sampling parameter; `param` names it (the server's `param`, the CLI's flag)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> None:
    """SamplingError unless temperature is finite >= 0, top_p finite in (0, 1], top_k an int >= 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise SamplingError("temperature", f"temperature must be a number (got {temperature!r})")
    if not math.isfinite(temperature) or temperature < 0:
        raise SamplingError("temperature", f"temperature must be a finite number >= 0 (got {temperature})")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise SamplingError("top_p", f"top_p must be a number (got {top_p!r})")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise SamplingError("top_p", f"top_p must be in (0, 1] (got {top_p})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise SamplingError("top_k", f"top_k must be an integer >= 0 (got {top_k!r})")


SEED_SPACE = 1 << 64  # what torch.Generator.manual_seed takes


def check_seed(seed: int | None) -> None:
    """SamplingError unless seed is None or an int in [0, 2**64)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_SPACE:
        raise SamplingError("seed", f"seed must be an integer in [0, 2**64) (got {seed!r})")


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence picks its tokens, and (for the scheduler) how many and what it reports.

    One set for `generate`, the scheduler and the server. `generate` and `stream_generate` take
    their own max_tokens and stop_ids arguments and read only the sampling fields; a scheduler
    request reads them all.
    """

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    max_tokens: int = 16  # scheduler requests: tokens to generate at most (0: score the prompt only)
    stop_token_ids: tuple[int, ...] = ()  # generation ends when one is sampled (not yielded; reason "stop")
    logprobs: int | None = None  # None: none; k >= 0: logprob of each sampled token + top-k alternatives
    prompt_logprobs: bool = False  # logprob of every prompt token given the ones before (entry 0 None)
    grammar: GrammarSpec | None = None  # constrained decoding (engine.grammar): only tokens it allows

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k)
        check_seed(self.seed)
        if self.max_tokens < 0:
            raise SamplingError("max_tokens", f"max_tokens must be >= 0 (got {self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise SamplingError("logprobs", f"logprobs must be >= 0 (got {self.logprobs})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick the next token from logits [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    # drawn on the host, where the generator is: the same draw whatever device the logits are on
    return int(torch.multinomial(weights(logits, params).cpu(), 1, generator=generator))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from (`weights`, normalised), as float32 [vocab] summing
    to 1; for greedy params, one-hot on the argmax."""
    if params.greedy:
        return torch.zeros(logits.shape[-1], device=logits.device).index_fill_(
            0, logits.argmax().view(1), 1.0
        )
    w = weights(logits, params)
    return w / w.sum()


def weights(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The unnormalised float32 distribution `sample` draws from (temperature, then top-k, then
    top-p over what top-k kept); the most likely token always has weight 1."""
    scores = logits.double()
    scores = torch.where(scores.isnan(), -math.inf, scores)  # a nan logit is never drawn
    top = scores.max()
    if not torch.isfinite(top):  # +inf logits share the draw; all -inf: every token alike
        return (scores == top).float() if top > 0 else torch.ones_like(scores, dtype=torch.float32)
    shifted = (scores - top) / params.temperature  # in [-inf, 0], finite t > 0: no nan
    probs = torch.exp(shifted)  # the maximum is exactly 1
    if params.top_k:
        kth = probs.topk(min(params.top_k, probs.shape[-1])).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass = sorted_probs / sorted_probs.sum()  # top_p measures mass among what top-k kept
        before = mass.cumsum(-1) - mass
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = before >= params.top_p
        drop[0] = False
        sorted_probs = torch.where(drop, torch.zeros_like(sorted_probs), sorted_probs)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs.float()
