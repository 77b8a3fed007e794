"""Resuming a saved conversation (the KV file) against prefilling it again."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from latentkv.config import CacheConfig
from latentkv.eval.bench.workload import random_prompt, timed_forward
from latentkv.kv.cache import KVTier, LatentCache, PackedLatentCache


@dataclass
class ResumeRow:
    model: str
    kv_cache_dtype: str
    tokens: int
    threads: int
    prefill_seconds: float  # one batched pass over the conversation (fastest of the repeats)
    save_seconds: float  # writing it as one durable turn (records, fsync, commit, fsync)
    resume_seconds: float  # fingerprint + open + verify every record + load into a cache (fastest)
    speedup: float  # prefill_seconds / resume_seconds
    file_bytes: int
    file_bytes_predicted: int  # header area + tokens x (token id + rows + indexer keys + check)
    file_bytes_match: bool
    rows_identical: bool  # the resumed cache holds exactly the prefilled cache's bytes
    next_logits_identical: bool  # one more token gives bit-identical logits on both caches

    def as_dict(self) -> dict:
        return asdict(self)


def predicted_file_bytes(cache: LatentCache | PackedLatentCache, data_offset: int, tokens: int) -> int:
    """What docs/kv-file-format.md says a file of `tokens` records of this cache holds."""
    from latentkv.kv.store_header import CHECK_BYTES, TOKEN_BYTES

    return data_offset + tokens * (TOKEN_BYTES + cache.tier.bytes_per_token + CHECK_BYTES)


def bench_resume(
    model,
    name: str,
    directory: Path,
    tokens: int,
    cache_config: CacheConfig,
    folder: Path,
    repeats: int = 1,
) -> ResumeRow:
    """Prefill `tokens` random tokens and save them as a session file in `folder`; then time what
    a restarted process does to get the same cache back (Session.resume) against the prefill."""
    from latentkv.kv.store import KVFile, header_for
    from latentkv.models.loader import Checkpoint

    tier = model.tier(cache_config)
    prompt = random_prompt(model.cfg.vocab_size, tokens)
    timed_forward(model.forward, prompt[:8], model.make_cache(tier))  # warm up RoPE and codec tables
    prefill, cache = None, None
    for _ in range(repeats):
        fresh = model.make_cache(tier)
        _, seconds = timed_forward(model.forward, prompt, fresh)
        if prefill is None or seconds < prefill:
            prefill, cache = seconds, fresh
    path = folder / f"resume-{cache.tier.name}.kv"
    header = header_for(model.cfg, cache, Checkpoint(directory).fingerprint())
    t0 = time.perf_counter()
    with KVFile.create(path, header, replace=True) as f:
        f.append(prompt, cache, 0, tokens)
        data_offset = f.raw.data_offset
    save = time.perf_counter() - t0
    resume, restored = _timed_resume(model, directory, path, tier, max(repeats, 3))
    identical = _same_state(cache.state(), restored.state()) and restored.length == tokens
    probe = torch.tensor([prompt[-1]], dtype=torch.long)
    same_logits = torch.equal(model.forward(probe, cache), model.forward(probe, restored))
    predicted = predicted_file_bytes(cache, data_offset, tokens)
    size = path.stat().st_size
    return ResumeRow(
        model=name,
        kv_cache_dtype=cache.tier.name,
        tokens=tokens,
        threads=torch.get_num_threads(),
        prefill_seconds=prefill,
        save_seconds=save,
        resume_seconds=resume,
        speedup=prefill / resume,
        file_bytes=size,
        file_bytes_predicted=predicted,
        file_bytes_match=size == predicted,
        rows_identical=identical,
        next_logits_identical=same_logits,
    )


def _timed_resume(model, directory: Path, path: Path, tier: KVTier, repeats: int):
    """(fastest seconds, cache) of what a restarted `--session` run does to get its cache back."""
    from latentkv.kv.store import header_for
    from latentkv.kv.store_session import Session
    from latentkv.models.loader import Checkpoint

    best, restored = None, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        current = header_for(model.cfg, model.make_cache(tier), Checkpoint(directory).fingerprint())
        session, cache = Session.resume(path, current, tier)
        seconds = time.perf_counter() - t0
        session.close()
        if best is None or seconds < best:
            best, restored = seconds, cache
    return best, restored


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Byte for byte (NaN-safe, unlike comparing values)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )
