"""Batched decode speed: B sequences decoding together (`Model.decode_batch`) against one alone.

Each of the B sequences prefills its own random prompt of `context` tokens into its own cache
(distinct prompts, so DSA selects differently per sequence); then `steps` batched decode steps
run over all of them, each step one new token per sequence. Aggregate tok/s counts every
sequence's tokens (B x steps over the time of the steps); per-sequence tok/s is what one client
sees (steps over the same time). The single-sequence baseline is the plain decode
(`Model.forward` on one token) over the same context, timed the same way.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from latentkv.config import CacheConfig
from latentkv.eval.bench.common import random_prompt


@dataclass
class BatchRow:
    model: str
    kv_cache_dtype: str
    context: int
    batch: int
    steps: int
    threads: int
    step_seconds: float  # mean time of one batched step (fastest of the repeats)
    aggregate_tps: float  # batch x steps / their time
    per_sequence_tps: float  # steps / their time
    speedup: float | None = None  # aggregate_tps / the batch-1 row's
    speedup_vs_single: float | None = None  # aggregate_tps / the single-sequence forward's tok/s

    def as_dict(self) -> dict:
        return asdict(self)


def _prefilled(model, batch: int, context: int, cache_config: CacheConfig) -> tuple[list, list[int]]:
    caches, tokens = [], []
    for b in range(batch):
        cache = model.make_cache(cache_config)
        logits = model.forward(torch.tensor(random_prompt(model.cfg.vocab_size, context, seed=b)), cache)
        caches.append(cache)
        tokens.append(int(logits[-1].argmax()))
    return caches, tokens


def single_tps(model, context: int, steps: int, cache_config: CacheConfig, repeats: int = 1) -> float:
    """Greedy decode tok/s of one sequence through `Model.forward` (fastest of `repeats`)."""
    best = 0.0
    for _ in range(repeats):
        (cache,), (token,) = _prefilled(model, 1, context, cache_config)
        model.forward(torch.tensor([token]), cache)  # warm up
        t0 = time.perf_counter()
        for _ in range(steps):
            token = int(model.forward(torch.tensor([token]), cache)[-1].argmax())
        best = max(best, steps / (time.perf_counter() - t0))
    return best


def bench_batch(
    model,
    name: str,
    batch: int,
    context: int,
    steps: int,
    cache_config: CacheConfig | None = None,
    repeats: int = 1,
) -> BatchRow:
    """`steps` greedy batched decode steps of `batch` sequences of `context` tokens (fastest of
    `repeats`, each from freshly prefilled caches)."""
    cache_config = cache_config or CacheConfig()
    best = None
    for _ in range(repeats):
        caches, tokens = _prefilled(model, batch, context, cache_config)
        ids = model.decode_batch(torch.tensor(tokens), caches).argmax(dim=-1)  # warm up
        t0 = time.perf_counter()
        for _ in range(steps):
            ids = model.decode_batch(ids, caches).argmax(dim=-1)
        seconds = time.perf_counter() - t0
        best = seconds if best is None else min(best, seconds)
    return BatchRow(
        model=name,
        kv_cache_dtype=cache_config.kv_cache_dtype,
        context=context,
        batch=batch,
        steps=steps,
        threads=torch.get_num_threads(),
        step_seconds=best / steps,
        aggregate_tps=batch * steps / best,
        per_sequence_tps=steps / best,
    )


def add_speedups(rows: list[BatchRow], single: dict[tuple[str, int], float]) -> None:
    """Fill each row's speedup over the batch-1 row and over the single-sequence forward
    (`single`: (tier, context) -> tok/s) of the same tier and context."""
    base = {(r.kv_cache_dtype, r.context): r.aggregate_tps for r in rows if r.batch == 1}
    for r in rows:
        key = (r.kv_cache_dtype, r.context)
        if key in base:
            r.speedup = r.aggregate_tps / base[key]
        if single.get(key):
            r.speedup_vs_single = r.aggregate_tps / single[key]
