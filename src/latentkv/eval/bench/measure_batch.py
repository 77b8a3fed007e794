"""Batched decode speed: B sequences decoding together (`Model.decode_batch`) against one alone.

Each of the B sequences prefills its own random prompt of `context` tokens into its own cache
(distinct prompts, so DSA selects differently per sequence). Then `steps` rounds run; each
round times one single-sequence decode step (`Model.forward` on one token, the non-batched
engine) and one batched step of every batch size, one after the other, so load that comes
and goes on a shared machine hits every row alike. Each row reports the median step time:
aggregate tok/s is B / median step (every sequence's token), per-sequence tok/s 1 / median
step (what one client sees). Float32 caches decode from one `SlotPool` per batch size, as the
server's running sequences do (other tiers from their own buffers).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from latentkv.config import CacheConfig
from latentkv.eval.bench.workload import random_prompt
from latentkv.kv.slots import SlotPool


@dataclass
class BatchRow:
    model: str
    kv_cache_dtype: str
    context: int
    batch: int
    steps: int
    threads: int
    step_seconds: float  # median time of one batched step
    aggregate_tps: float  # batch / step_seconds
    per_sequence_tps: float  # 1 / step_seconds
    speedup: float | None = None  # aggregate_tps / the batch-1 row's
    speedup_vs_single: float | None = None  # aggregate_tps / the single-sequence forward's tok/s

    def as_dict(self) -> dict:
        return asdict(self)


def _prefilled(model, batch: int, context: int, tier) -> tuple[list, list[int]]:
    caches, tokens = [], []
    for b in range(batch):
        cache = model.make_cache(tier)
        logits = model.forward(torch.tensor(random_prompt(model.cfg.vocab_size, context, seed=b)), cache)
        caches.append(cache)
        tokens.append(int(logits[-1].argmax()))
    return caches, tokens


def bench_batches(
    model, name: str, sizes: list[int], context: int, steps: int, cache_config: CacheConfig | None = None
) -> tuple[float, list[BatchRow]]:
    """(single-sequence tok/s, one row per batch size), from `steps` interleaved rounds."""
    tier = model.tier(cache_config)
    single = _prefilled(model, 1, context, tier)
    batches = {size: _prefilled(model, size, context, tier) for size in sizes}
    pools = {size: _pooled(model, size, batches[size][0]) for size in sizes}
    times: dict[int | None, list[float]] = {size: [] for size in [None, *sizes]}  # None: the single sequence
    for _ in range(steps + 1):  # the first round warms up and is not counted
        times[None].append(_single_step(model, single))
        for size in sizes:
            times[size].append(_batched_step(model, batches[size], pools[size]))
    median = {key: statistics.median(values[1:]) for key, values in times.items()}
    rows = [
        BatchRow(
            model=name,
            kv_cache_dtype=tier.name,
            context=context,
            batch=size,
            steps=steps,
            threads=torch.get_num_threads(),
            step_seconds=median[size],
            aggregate_tps=size / median[size],
            per_sequence_tps=1 / median[size],
        )
        for size in sizes
    ]
    return 1 / median[None], rows


def _single_step(model, state: tuple[list, list[int]]) -> float:
    (cache,), tokens = state
    ids = torch.tensor(tokens[-1:], dtype=torch.long)
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    seconds = time.perf_counter() - t0
    tokens[-1] = int(logits[-1].argmax())
    return seconds


def _pooled(model, size: int, caches: list) -> SlotPool | None:
    """The server's slot pool for float32 caches (None for other tiers, which it does not hold)."""
    if not all(c.tier.poolable for c in caches):
        return None
    pool = SlotPool(model.layout, size)
    for cache in caches:
        pool.place(cache)
    return pool


def _batched_step(model, state: tuple[list, list[int]], pool: SlotPool | None) -> float:
    caches, tokens = state
    ids = torch.tensor(tokens, dtype=torch.long)
    t0 = time.perf_counter()
    logits = model.decode_batch(ids, caches, pool)
    seconds = time.perf_counter() - t0
    tokens[:] = logits.argmax(dim=-1).tolist()
    return seconds


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
