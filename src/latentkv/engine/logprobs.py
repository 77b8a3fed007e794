"""Logprobs of the model's own distribution, log_softmax(logits), whatever the temperature or
top_p a request samples with (as OpenAI and vLLM report them)."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """log_softmax(logits)[token] and the k most likely (id, logprob), from logits [vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float(logprobs[token]), _top(logprobs, k)


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k == 0:
        return []
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def prompt_logprobs(prompt: list[int], logits: torch.Tensor, k: int | None) -> list[dict | None]:
    """Entry i > 0: the logprob of prompt[i] given prompt[:i], from logits [len(prompt), vocab]."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # row i predicts prompt[i + 1]
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    out: list[dict | None] = [None]
    for i, token in enumerate(prompt[1:]):
        out.append({"token": token, "logprob": chosen[i], "top": _top(logprobs[i], k or 0)})
    return out
