"""Logprobs in the two OpenAI formats, from the scheduler's TokenEvents and prompt logprobs.

Completions (what lm-evaluation-harness reads):
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: lp}, ...], "text_offset": [...]}
    With echo the prompt's tokens come first, entry 0 `null` (nothing predicts the first token).
    Each top_logprobs dict holds the k most likely tokens plus the token itself, as vLLM does.
Chat:
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}

A token's string is its text decoded alone; a token that is part of a multi-byte character
decodes to U+FFFD, so two such tokens share a top_logprobs key (the more likely one is kept).
`return_tokens_as_token_ids` (vLLM's flag) names every token "token_id:N" instead, one key per
id. text_offset counts the characters of the token strings before it.
"""

from __future__ import annotations

import math
from functools import lru_cache

from latentkv.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0  # -inf (and NaN) as a finite number: JSON has no infinity


def clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > FLOOR else FLOOR


class TokenStrings:
    """id -> the token's text alone, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids or tokenizer is None
        self._one = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token: int) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def __call__(self, token: int) -> str:
        return self._one(token)


class CompletionLogprobsBuilder:
    """Builds completions logprobs in order (echoed prompt, then generated tokens), piece by piece."""

    def __init__(self, strings: TokenStrings, offset: int = 0):
        self.strings = strings
        self.offset = offset  # text_offset of the next token

    def prompt(self, ids: list[int], prompt_logprobs: list | None) -> CompletionLogprobs:
        entries = prompt_logprobs or [None] * len(ids)
        out = CompletionLogprobs()
        for token, entry in zip(ids, entries, strict=True):
            lp = None if entry is None else clamp(entry["logprob"])
            top = None if entry is None else self._top(token, lp, entry.get("top") or [])
            self._append(out, token, lp, top)
        return out

    def generated(self, events: list) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for e in events:
            lp = clamp(e.logprob) if e.logprob is not None else None
            self._append(out, e.token, lp, self._top(e.token, lp, e.top_logprobs or []))
        return out

    def _top(self, token: int, lp: float | None, top: list[tuple[int, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, tlp in top:
            out.setdefault(self.strings(tid), clamp(tlp))
        if lp is not None:
            out.setdefault(self.strings(token), lp)
        return out

    def _append(self, out: CompletionLogprobs, token: int, lp, top) -> None:
        text = self.strings(token)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(top)
        out.text_offset.append(self.offset)
        self.offset += len(text)


def join(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for p in parts:
        out.tokens += p.tokens
        out.token_logprobs += p.token_logprobs
        out.top_logprobs += p.top_logprobs
        out.text_offset += p.text_offset
    return out


def chat_logprobs(strings: TokenStrings, events: list, top_n: int) -> ChatLogprobs:
    content = []
    for e in events:
        text = strings(e.token)
        top = [_top_entry(strings(tid), tlp) for tid, tlp in (e.top_logprobs or [])[:top_n]]
        lp = clamp(e.logprob) if e.logprob is not None else FLOOR
        content.append(TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_entry(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=clamp(logprob), bytes=list(text.encode()))
