"""Generation as layered generators.

    generate_step   token ids: one batched prefill pass, then one decode pass per token
    stream_generate text deltas + the final stats
    generate        the whole result at once

Timing follows llama.cpp's convention: prompt tok/s is prompt tokens over the prefill pass;
generation tok/s counts decode passes (the first token comes from the prefill logits).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from latentkv.engine.grammar import Constraint
from latentkv.engine.sampling import SamplingParams, sample
from latentkv.engine.speculative import SpeculativeConfig, SpeculativeStats, speculative_steps
from latentkv.kv.cache import LatentCache, PackedLatentCache
from latentkv.models.model import Model
from latentkv.tokenizer import Detokenizer, Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_passes: int = 0
    decode_tokens: int = 0  # tokens the decode passes produced (more than passes when drafting)
    decode_seconds: float = 0.0
    kv_bytes: int = 0
    kv_bytes_per_token_layer: int = 0
    index_kv_bytes: int = 0
    kv_cache_dtype: str = "f32"
    finish_reason: str = ""
    speculative: SpeculativeStats | None = None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["prompt_tps"] = round(self.prompt_tps, 2)
        out["decode_tps"] = round(self.decode_tps, 2)
        out["speculative"] = self.speculative.as_dict() if self.speculative else None
        return out

    def line(self) -> str:
        spec = f" | {self.speculative.line()}" if self.speculative else ""
        return (
            f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tok/s | "
            f"generated: {self.generated_tokens} tokens, {self.decode_tps:.1f} tok/s | "
            f"KV: {self.kv_bytes:,} bytes ({self.kv_cache_dtype}, "
            f"{self.kv_bytes_per_token_layer} B/token/layer; indexer keys {self.index_kv_bytes:,} bytes)"
            f"{spec}"
        )


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


def generate_step(
    model: Model,
    prompt: list[int],
    cache: LatentCache | PackedLatentCache,
    sampling: SamplingParams,
    stats: GenerationStats,
    constraint: Constraint | None = None,
) -> Iterator[int]:
    """Yield generated token ids forever; the caller decides when to stop. With `constraint`
    (engine.grammar) only tokens its grammar allows are sampled, and each is consumed by it."""
    _check_prompt(model, prompt)
    generator = None if sampling.greedy else sampling.generator()
    t0 = time.perf_counter()
    logits = model.forward(torch.tensor(prompt, dtype=torch.long, device=model.device), cache)[-1]
    stats.prompt_tokens += len(prompt)
    stats.prompt_seconds += time.perf_counter() - t0
    while True:
        if constraint is not None:
            token = sample(constraint.allow(logits), sampling, generator)
            constraint.consume(token)
        else:
            token = sample(logits, sampling, generator)
        yield token
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor([token], dtype=torch.long, device=model.device), cache)[-1]
        stats.decode_seconds += time.perf_counter() - t0
        stats.decode_passes += 1
        stats.decode_tokens += 1


def _speculative_step(
    model: Model,
    prompt: list[int],
    cache: LatentCache | PackedLatentCache,
    sampling: SamplingParams,
    stats: GenerationStats,
    speculative: SpeculativeConfig,
    limit: int,
) -> Iterator[int]:
    """`generate_step` with MTP drafting (`latentkv.engine.speculative`)."""
    _check_prompt(model, prompt)
    stats.speculative = stats.speculative or SpeculativeStats(speculative.draft_tokens)

    def timing(kind: str, seconds: float) -> None:
        if kind == "prompt":
            stats.prompt_tokens += len(prompt)
            stats.prompt_seconds += seconds
        else:
            stats.decode_seconds += seconds
            stats.decode_passes += 1

    for i, token in enumerate(
        speculative_steps(model, prompt, cache, sampling, speculative, limit, timing, stats.speculative)
    ):
        stats.decode_tokens += i > 0
        yield token


def _check_prompt(model: Model, prompt: list[int]) -> None:
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = model.cfg.vocab_size
    if bad := [t for t in prompt if not 0 <= t < vocab]:
        raise ValueError(f"token ids out of range for a vocabulary of {vocab}: {bad[:5]}")


def stream_generate(
    model: Model,
    prompt: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    tokenizer: Tokenizer | None = None,
    cache: LatentCache | PackedLatentCache | None = None,
    stop_ids: tuple[int, ...] | None = None,
    stats: GenerationStats | None = None,
    speculative: SpeculativeConfig | None = None,
    constraint: Constraint | None = None,
) -> Iterator[tuple[int, str, GenerationStats]]:
    """Yield (token, text delta, stats) per generated token; stats are final after the last.

    Pass `stats` to have it filled in even when nothing is generated (max_tokens 0). With
    `speculative`, the MTP layer drafts and the main model verifies: the same tokens (greedy)
    or the same distribution (sampling), and the cache ends as plain decoding leaves it.
    With `constraint` the output follows its grammar and ends (reason "stop") once the grammar
    is complete; it cannot be combined with `speculative`.
    """
    if constraint is not None and speculative is not None:
        raise ValueError("constrained decoding cannot be combined with speculative decoding")
    cache = cache if cache is not None else model.make_cache()
    stop = set(model.cfg.eos_token_ids if stop_ids is None else stop_ids)
    stats = stats if stats is not None else GenerationStats()
    stats.kv_cache_dtype = cache.tier.name
    stats.kv_bytes_per_token_layer = cache.tier.bytes_per_token_layer
    stats.finish_reason = "length"
    context = model.cfg.max_position_embeddings
    if cache.length + len(prompt) > context:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens, {cache.length + len(prompt)} with the cache) exceeds "
            f"the model's context of {context} tokens"
        )
    # The k-th generated token needs k - 1 of them fed back: stop where the context ends.
    max_tokens = min(max_tokens, context - cache.length - len(prompt) + 1)
    decoder = Detokenizer(tokenizer) if tokenizer else None
    if max_tokens <= 0:
        return
    end = cache.length + len(prompt) - 1  # plus one per generated token: what plain decoding caches
    steps = (
        _speculative_step(model, prompt, cache, sampling, stats, speculative, max_tokens)
        if speculative
        else generate_step(model, prompt, cache, sampling, stats, constraint)
    )
    for token in steps:
        stats.generated_tokens += 1
        complete = constraint is not None and constraint.stopped
        done = token in stop or complete or stats.generated_tokens >= max_tokens
        if token in stop or complete:
            stats.finish_reason = "stop"
        delta = decoder.push(token) if decoder and token not in stop else ""
        if done and decoder:
            delta += decoder.flush()
        if done:
            if speculative and cache.length > end + stats.generated_tokens:
                cache.trim(end + stats.generated_tokens)  # verified tokens past the stop
            stats.kv_bytes, stats.index_kv_bytes = cache.nbytes(), cache.index_nbytes()
        yield token, delta, stats
        if done:
            break


def generate(
    model: Model,
    prompt: list[int],
    max_tokens: int,
    sampling: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None,
    cache: LatentCache | PackedLatentCache | None = None,
    stop_ids: tuple[int, ...] | None = None,
    speculative: SpeculativeConfig | None = None,
    constraint: Constraint | None = None,
) -> GenerationResult:
    sampling = sampling or SamplingParams()
    tokens: list[int] = []
    text: list[str] = []
    stats = GenerationStats()
    for token, delta, _ in stream_generate(
        model, prompt, max_tokens, sampling, tokenizer, cache, stop_ids, stats, speculative, constraint
    ):
        tokens.append(token)
        text.append(delta)
    return GenerationResult(tokens, "".join(text) if tokenizer else None, stats)
