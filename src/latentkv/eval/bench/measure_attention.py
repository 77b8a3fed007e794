"""The attention read alone: one decode query per head over T rows stored in each tier."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from latentkv.attention import readers
from latentkv.config import CacheConfig
from latentkv.eval.bench.workload import fill_random, predicted_kv_bytes
from latentkv.kv.cache import CacheLayout, RowReader, resolve_tier
from latentkv.kv.codecs import get_codec

CPU = torch.device("cpu")  # the attention bench times the CPU's read


@dataclass
class AttentionRow:
    kv_cache_dtype: str
    context: int
    heads: int
    kv_lora_rank: int
    rope_dim: int
    threads: int
    repeats: int
    scores_ms: float  # median of the repeats, each phase on its own
    context_ms: float  # softmax + context
    total_ms: float  # median of the whole scores + softmax + context, as three calls
    attend_ms: float  # median of readers.attend(): the one-pass form the torch backend runs
    speed_vs_f32: float | None  # f32's attend_ms / this attend_ms (0.9 = 10% slower than f32)
    bytes_per_token: int  # one stored row (c + r, codes + scales)
    bytes_read_per_token: int  # scores read c + r, context reads c again
    cache_bytes: int  # measured from the cache's tensors
    cache_bytes_match: bool  # == bytes_per_token x context
    rel_err_vs_f32: float | None  # ||context - f32 context|| / ||f32 context||

    def as_dict(self) -> dict:
        return asdict(self)


def attention_layout(kv_lora_rank: int, rope_dim: int, device: torch.device) -> CacheLayout:
    """One layer of latent rows on `device`, no indexer: what one MLA layer's attention reads."""
    return CacheLayout(
        num_layers=1,
        row_width=kv_lora_rank + rope_dim,
        kv_lora_rank=kv_lora_rank,
        index_layers=(),
        index_head_dim=0,
        device=device,
    )


def bench_attention(
    tier: str, context: int, heads: int, kv_lora_rank: int, rope_dim: int, repeats: int = 5, seed: int = 0
) -> tuple[AttentionRow, torch.Tensor]:
    """Time one decode query per head over `context` random rows stored in `tier`.

    Returns the row (speed_vs_f32 and rel_err_vs_f32 unset) and the context output [H, 1, Lkv],
    so callers can compare tiers; the rows and the query depend only on `seed`.
    """
    cache = resolve_tier(attention_layout(kv_lora_rank, rope_dim, CPU), CacheConfig(tier)).make_cache()
    (reader,) = fill_random(cache, context, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    width = kv_lora_rank + rope_dim
    query = torch.randn(heads, 1, width, generator=g) * width**-0.5  # [H, 1, Lkv+R], q_abs | q_rope
    out = _attend(reader, query)  # warm-up
    phases = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scores = readers.scores(query, reader)  # [H, 1, T]
        t1 = time.perf_counter()
        out = readers.context(torch.softmax(scores, dim=-1), reader)  # [H, 1, Lkv]
        t2 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t2 - t0))
    scores_s, context_s, total_s = (statistics.median(p) for p in zip(*phases, strict=True))
    fused = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        readers.attend(query, reader, None)
        fused.append(time.perf_counter() - t0)
    c_bytes = get_codec(tier, kv_lora_rank).bytes_per_row
    r_bytes = get_codec(tier, rope_dim).bytes_per_row
    measured = cache.allocated_nbytes()
    row = AttentionRow(
        kv_cache_dtype=cache.tier.name,
        context=context,
        heads=heads,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        threads=torch.get_num_threads(),
        repeats=repeats,
        scores_ms=scores_s * 1e3,
        context_ms=context_s * 1e3,
        total_ms=total_s * 1e3,
        attend_ms=statistics.median(fused) * 1e3,
        speed_vs_f32=None,
        bytes_per_token=cache.tier.bytes_per_token_layer,
        bytes_read_per_token=2 * c_bytes + r_bytes,
        cache_bytes=measured,
        cache_bytes_match=measured == predicted_kv_bytes(cache),
        rel_err_vs_f32=None,
    )
    return row, out


def _attend(reader: RowReader, query: torch.Tensor) -> torch.Tensor:
    return readers.context(torch.softmax(readers.scores(query, reader), dim=-1), reader)


def compare_attention(rows: list[AttentionRow], outputs: list[torch.Tensor]) -> None:
    """Fill speed_vs_f32 and rel_err_vs_f32 from the f32 row of the same context, if it ran."""
    base = {r.context: (r, out) for r, out in zip(rows, outputs, strict=True) if r.kv_cache_dtype == "f32"}
    for r, out in zip(rows, outputs, strict=True):
        if r.context not in base:
            continue
        ref, ref_out = base[r.context]
        r.speed_vs_f32 = ref.attend_ms / r.attend_ms
        r.rel_err_vs_f32 = float((out - ref_out).norm() / ref_out.norm())
