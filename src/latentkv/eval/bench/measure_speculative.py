"""Speculative decoding with the MTP layer: acceptance and decode tok/s, with drafting and without.

One row per (model, concurrency C, draft tokens N; N = 0 is plain decoding). Every row decodes
the same C prompts greedily:

    C = 1   the single-sequence engine (`engine.generate.generate`); decode tok/s is the tokens
            after the first over the decode steps' time (the first comes from the prefill)
    C > 1   the scheduler with C slots, the C requests submitted together; decode tok/s is all
            completion tokens over the longest request's decode time (they run side by side)

Drafting rows run with the pause rule off, so they show what drafting itself costs or saves.
Acceptance does not depend on machine load (greedy tokens are fixed); tok/s does: time on an
idle machine. With experts streamed from disk (`--ram-gb`) each row also reports the expert
cache over the row (the prompt's pass included): hit rate of the main layers and of the MTP
draft layer, and MiB read from disk per generated token. Prompts are windows of the model's
heldout.txt when it ships one (real text, what the draft layer was trained on), else random
token ids (a random model's drafts are random anyway).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from latentkv.config import CacheConfig
from latentkv.engine import sampling
from latentkv.engine.generate import generate
from latentkv.engine.speculative import SpeculativeConfig, SpeculativeStats
from latentkv.kv.cache import KVTier


@dataclass
class SpecRow:
    model: str
    kv_cache_dtype: str
    concurrency: int
    draft_tokens: int  # 0: plain decoding
    prompt_tokens: int
    decode_tokens: int  # per sequence
    threads: int
    decode_tps: float  # all sequences together
    acceptance_per_position: list[float]
    tokens_per_verify: float | None
    verify_steps: int
    same_tokens: bool  # every sequence's tokens equal plain decoding's (greedy is lossless)
    vs_plain: float | None = None  # decode_tps / the plain row's (same model, tier, concurrency)
    experts: dict | None = None  # streamed experts: `expert_delta` over the row

    def as_dict(self) -> dict:
        return asdict(self)


def prompts_for(model, directory: Path, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: heldout.txt windows when the model has one, else random ids."""
    heldout = directory / "heldout.txt"
    if heldout.exists():
        from latentkv.tokenizer import Tokenizer

        ids = Tokenizer(directory).encode(heldout.read_text(encoding="utf-8")[: 400 * length * n])
        stride = max(length, (len(ids) - length) // n)
        return [ids[i * stride : i * stride + length] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, model.cfg.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def run_single(
    model, prompt: list[int], decode_tokens: int, tier: KVTier, spec
) -> tuple[list[int], float, SpeculativeStats | None]:
    """(tokens, decode seconds, drafting stats) of one sequence."""
    out = generate(
        model,
        prompt,
        decode_tokens,
        sampling.SamplingParams(),
        cache=model.make_cache(tier),
        stop_ids=(),
        speculative=spec,
    )
    return out.tokens, out.stats.decode_seconds, out.stats.speculative


def run_batched(
    model, prompts: list[list[int]], decode_tokens: int, tier: KVTier, spec
) -> tuple[list[list[int]], float, dict | None]:
    """(each sequence's tokens, decode seconds, drafting stats) with the scheduler, all at once."""
    from latentkv.engine.scheduler import Finished, Request, SamplingParams, Scheduler

    scheduler = Scheduler(model, tier, max_num_seqs=len(prompts), speculative=spec)
    scheduler.start()
    try:
        handles = [
            scheduler.submit(Request(p, SamplingParams(max_tokens=decode_tokens, temperature=0.0)))
            for p in prompts
        ]
        tokens, seconds = [], 0.0
        for handle in handles:
            events = list(handle)
            finished = events[-1]
            assert isinstance(finished, Finished), finished
            if finished.error:
                raise RuntimeError(finished.error)
            tokens.append([e.token for e in events[:-1]])
            seconds = max(seconds, finished.decode_seconds)
        return tokens, seconds, scheduler.stats().speculative
    finally:
        scheduler.shutdown()


def expert_delta(before: dict, after: dict, tokens: int) -> dict:
    """Two `ExpertStreamer.snapshot()`s around a row of `tokens` generated tokens -> the row's
    hit rates (all layers, the main model's, the MTP draft layer's) and MiB read per token."""
    d = {k: after[k] - before[k] for k in ("asked", "hits", "draft_asked", "draft_hits", "bytes_read")}
    main_asked = d["asked"] - d["draft_asked"]
    return {
        "hit_rate": d["hits"] / d["asked"] if d["asked"] else 0.0,
        "main_hit_rate": (d["hits"] - d["draft_hits"]) / main_asked if main_asked else 0.0,
        "draft_hit_rate": d["draft_hits"] / d["draft_asked"] if d["draft_asked"] else None,
        "mib_read_per_token": d["bytes_read"] / max(1, tokens) / 2**20,
        "budget_bytes": after["budget"],
    }


def bench_speculative(
    model,
    name: str,
    directory: Path,
    concurrency: int,
    draft_tokens: int,
    prompt_tokens: int,
    decode_tokens: int,
    cache: CacheConfig,
    reference: list[list[int]] | None,
    streamer=None,
) -> tuple[SpecRow, list[list[int]]]:
    """One row; `reference`: the plain row's tokens (None for the plain row itself);
    `streamer`: the model's ExpertStreamer when its experts stream from disk."""
    spec = SpeculativeConfig(draft_tokens=draft_tokens, adaptive=False) if draft_tokens else None
    prompts = prompts_for(model, directory, concurrency, prompt_tokens)
    before = streamer.snapshot() if streamer is not None else None
    t0 = time.perf_counter()
    if concurrency == 1:
        tokens, seconds, stats = run_single(model, prompts[0], decode_tokens, model.tier(cache), spec)
        outs, summary = [tokens], (stats.as_dict() if stats else None)
        produced = len(tokens) - 1
    else:
        outs, seconds, summary = run_batched(model, prompts, decode_tokens, model.tier(cache), spec)
        produced = sum(len(t) - 1 for t in outs)
    seconds = seconds or (time.perf_counter() - t0)
    row = SpecRow(
        model=name,
        kv_cache_dtype=cache.kv_cache_dtype,
        concurrency=concurrency,
        draft_tokens=draft_tokens,
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        threads=torch.get_num_threads(),
        decode_tps=produced / seconds,
        acceptance_per_position=summary["acceptance_per_position"] if summary else [],
        tokens_per_verify=summary["tokens_per_verify"] if summary else None,
        verify_steps=summary["verify_steps"] if summary else 0,
        same_tokens=reference is None or outs == reference,
    )
    if streamer is not None:
        row.experts = expert_delta(before, streamer.snapshot(), sum(len(t) for t in outs))
    return row, outs
