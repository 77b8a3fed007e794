"""Sampling as pure functions of (logits, parameters, generator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")

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


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from (temperature, then top-k, then top-p), as float32
    [vocab] summing to 1; for greedy params, one-hot on the argmax."""
    if params.greedy:
        return torch.zeros(logits.shape[-1]).index_fill_(0, logits.argmax().view(1), 1.0)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k:
        kth = probs.topk(min(params.top_k, probs.shape[-1])).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
        probs = probs / probs.sum()  # top_p then measures mass among the top-k, as other engines do
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick the next token from logits [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))
