"""Shared by the benchmarks: random prompts, random cache fill, KV byte accounting."""

from __future__ import annotations

import time

import torch

from latentkv.kv.cache import LatentCache, PackedLatentCache, RowReader

FILL_MODES = ("prefill", "random")


FILL_CHUNK = 1024  # rows appended per layer at a time by fill_random


def random_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def predicted_kv_bytes(cache: LatentCache | PackedLatentCache) -> int:
    return cache.tier.bytes_per_token_layer * cache.layout.num_layers * cache.length


def measured_index_bytes(cache: LatentCache | PackedLatentCache) -> int:
    return sum(_nbytes(cache.index_keys(layer)) for layer in cache.layout.index_layers)


def fill_random(
    cache: LatentCache | PackedLatentCache, tokens: int, seed: int = 0, chunk: int = FILL_CHUNK
) -> list[RowReader]:
    """Append `tokens` random rows to every layer (and indexer keys to every indexer layer),
    `chunk` tokens at a time; returns each layer's reader over all its rows."""
    layout = cache.layout
    g = torch.Generator().manual_seed(seed)
    n = layout.kv_lora_rank
    readers: list[RowReader] = []
    for start in range(0, tokens, chunk):
        size = min(chunk, tokens - start)
        readers = []
        for layer in range(layout.num_layers):
            rows = torch.randn(size, layout.row_width, generator=g)  # [s, Lkv+R]
            c = rows[:, :n]
            c.mul_(torch.rsqrt(c.square().mean(-1, keepdim=True) + 1e-6))  # RMS 1, as RMSNorm makes c
            readers.append(cache.append(layer, rows))
        for layer in layout.index_layers:
            cache.append_index_keys(layer, torch.randn(size, layout.index_head_dim, generator=g))
        cache.commit(size)
    return readers


def timed_forward(forward, tokens: list[int], cache) -> tuple[int, float]:
    """One pass of `forward` (`Model.forward`, or a compiled decode step for one token);
    returns (greedy next token, seconds)."""
    ids = torch.tensor(tokens, dtype=torch.long)
    t0 = time.perf_counter()
    logits = forward(ids, cache)[-1]
    seconds = time.perf_counter() - t0
    return int(logits.argmax()), seconds
