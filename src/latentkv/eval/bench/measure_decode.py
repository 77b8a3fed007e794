"""Decode speed: latentkv per KV tier, and transformers' generate() on the same checkpoint."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from latentkv.config import CacheConfig
from latentkv.engine.sampling import SamplingParams
from latentkv.eval.bench.workload import (
    FILL_MODES,
    fill_random,
    measured_index_bytes,
    predicted_kv_bytes,
    random_prompt,
    timed_forward,
)
from latentkv.weights import dense_dtype

if TYPE_CHECKING:
    from latentkv.models.compiled import DecodeStep

_GREEDY = SamplingParams()


@dataclass
class BenchRow:
    engine: str
    model: str
    weight_dtype: str
    kv_cache_dtype: str
    context: int
    decode_tokens: int
    threads: int
    fill: str
    prefill_tps: float | None  # None with fill "random": there is no prompt pass
    decode_tps: float  # decode passes / their total time
    decode_tps_median: float | None  # 1 / median pass time (latentkv only)
    kv_tokens: int  # cached tokens per layer at the end
    kv_bytes_per_token: float  # latent rows + indexer keys, all layers
    kv_bytes_per_token_layer: float  # latent rows only
    kv_bytes_measured: int  # latent rows, from the cache's tensors
    kv_bytes_predicted: int | None  # bytes_per_token_layer x layers x kv_tokens (latentkv only)
    kv_bytes_match: bool | None
    index_kv_bytes: int = 0
    decode_vs_f32: float | None = None  # decode_tps / the f32-KV row's (same weights, context, fill)
    decode_vs_transformers: float | None = None
    speculative: dict | None = None  # `SpeculativeStats.as_dict()` of an MTP-drafting row
    decode_tps_runs: list[float] | None = None  # every --repeats run's decode_tps (bench decode)

    def as_dict(self) -> dict:
        return asdict(self)


def _decode_passes(step, cache, token: int, passes: int) -> list[float]:
    """`passes` greedy one-token passes of `step` (`Model.forward` or a compiled step) from
    `token`; returns each pass's seconds."""
    times = []
    for _ in range(passes):
        token, seconds = timed_forward(step, [token], cache)
        times.append(seconds)
    return times


def bench_latentkv(
    model,
    name: str,
    weight_dtype: str,
    context: int,
    decode_tokens: int,
    cache_config: CacheConfig | None = None,
    fill: str = "prefill",
    speculative=None,
    compiled: DecodeStep | None = None,
) -> BenchRow:
    """Prefill (or random-fill) `context` tokens, then time decode_tokens - 1 decode passes:
    eager, or through `compiled` (the model's decode step compiled and warmed up for this tier;
    the prefill stays eager). With `speculative`, a `SpeculativeConfig`: MTP drafting instead
    (see `bench_speculative`)."""
    if fill not in FILL_MODES:
        raise ValueError(f"unknown fill {fill!r}; choose from {', '.join(FILL_MODES)}")
    if speculative is not None:
        return bench_speculative(model, name, weight_dtype, context, decode_tokens, cache_config, speculative)
    tier = model.tier(cache_config)
    step = compiled if compiled is not None else model.forward
    prompt = random_prompt(model.cfg.vocab_size, context)
    warm = model.make_cache(tier)  # warm up the allocator, RoPE and codec tables
    token, _ = timed_forward(model.forward, prompt[:8], warm)
    _decode_passes(step, warm, token, 1)
    del warm

    cache = model.make_cache(tier)
    if fill == "prefill":
        token, seconds = timed_forward(model.forward, prompt, cache)
        prefill_tps = context / seconds
    else:
        fill_random(cache, context)
        token, prefill_tps = prompt[-1], None
    times = _decode_passes(step, cache, token, decode_tokens - 1)
    return BenchRow(
        engine="latentkv+compile" if compiled is not None else "latentkv",
        model=name,
        weight_dtype=weight_dtype,
        kv_cache_dtype=cache.tier.name,
        context=context,
        decode_tokens=decode_tokens,
        threads=torch.get_num_threads(),
        fill=fill,
        prefill_tps=prefill_tps,
        decode_tps=len(times) / sum(times),
        decode_tps_median=1 / statistics.median(times),
        **_kv_fields(cache),
    )


def bench_speculative(
    model, name: str, weight_dtype: str, context: int, decode_tokens: int, cache_config, speculative
) -> BenchRow:
    """Prefill a random prompt of `context` tokens, then generate decode_tokens greedily with MTP
    drafting on every step (the pause rule off, so the row shows what drafting costs or saves);
    decode tok/s is the tokens after the first over the decode steps' time."""
    from latentkv.engine.speculative import SpeculativeStats, speculative_steps

    tier = model.tier(cache_config)
    prompt = random_prompt(model.cfg.vocab_size, context)
    times: dict[str, float] = {"prompt": 0.0, "decode": 0.0}

    def timing(kind: str, seconds: float) -> None:
        times[kind] += seconds

    warm = model.make_cache(tier)  # warm up the allocator, RoPE and codec tables
    for _ in speculative_steps(model, prompt[:8], warm, _GREEDY, speculative, 3):
        pass
    cache = model.make_cache(tier)
    stats = SpeculativeStats(speculative.draft_tokens)
    n = sum(
        1 for _ in speculative_steps(model, prompt, cache, _GREEDY, speculative, decode_tokens, timing, stats)
    )
    return BenchRow(
        engine=f"latentkv+mtp{speculative.draft_tokens}",
        model=name,
        weight_dtype=weight_dtype,
        kv_cache_dtype=cache.tier.name,
        context=context,
        decode_tokens=decode_tokens,
        threads=torch.get_num_threads(),
        fill="prefill",
        prefill_tps=context / times["prompt"],
        decode_tps=(n - 1) / times["decode"] if times["decode"] else 0.0,
        decode_tps_median=None,
        **_kv_fields(cache),
        speculative=stats.as_dict(),
    )


def add_ratios(rows: list[BenchRow]) -> None:
    """Fill decode_vs_f32 (against the same engine's f32 row) and decode_vs_transformers of every
    latentkv row, where the base ran."""
    f32 = {
        (r.engine, r.weight_dtype, r.context, r.fill): r
        for r in rows
        if r.engine.startswith("latentkv") and r.kv_cache_dtype == "f32"
    }
    hf = {(r.weight_dtype, r.context): r for r in rows if r.engine == "transformers"}
    for r in rows:
        if not r.engine.startswith("latentkv"):
            continue
        if (base := f32.get((r.engine, r.weight_dtype, r.context, r.fill))) and base.decode_tps:
            r.decode_vs_f32 = r.decode_tps / base.decode_tps
        if (ref := hf.get((r.weight_dtype, r.context))) and ref.decode_tps:
            r.decode_vs_transformers = r.decode_tps / ref.decode_tps


class _Clock:
    """A transformers streamer that timestamps every generated token."""

    def __init__(self):
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_transformers(directory: Path, weight_dtype: str):
    import transformers

    dtype = dense_dtype(weight_dtype)  # transformers runs the plain-tensor formats only
    assert dtype is not None, weight_dtype
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def bench_transformers(hf_model, name: str, weight_dtype: str, context: int, decode_tokens: int) -> BenchRow:
    cfg = hf_model.config
    prompt = torch.tensor([random_prompt(cfg.vocab_size, context)])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    with torch.no_grad():
        hf_model.generate(prompt[:, :8], max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm up
        clock = _Clock()
        out = hf_model.generate(
            prompt, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, streamer=clock, **kwargs
        )
    first, last = clock.stamps[0], clock.stamps[-1]
    cache_bytes = _cache_bytes(out.past_key_values)
    cache_tokens = context + decode_tokens - 1
    return BenchRow(
        engine="transformers",
        model=name,
        weight_dtype=weight_dtype,
        kv_cache_dtype=str(hf_model.dtype).removeprefix("torch."),
        context=context,
        decode_tokens=decode_tokens,
        threads=torch.get_num_threads(),
        fill="prefill",
        prefill_tps=context / (first - clock.start),
        decode_tps=(len(clock.stamps) - 1) / (last - first) if last > first else 0.0,
        decode_tps_median=None,
        kv_tokens=cache_tokens,
        kv_bytes_per_token=cache_bytes / cache_tokens,
        kv_bytes_per_token_layer=cache_bytes / cache_tokens / cfg.num_hidden_layers,
        kv_bytes_measured=cache_bytes,
        kv_bytes_predicted=None,
        kv_bytes_match=None,
    )


def _cache_bytes(cache) -> int:
    """Bytes held by every tensor of a transformers cache object (keys, values, indexer keys)."""
    seen: set[int] = set()
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
    return total


def _kv_fields(cache) -> dict:
    """A row's KV memory fields: bytes measured from the cache's tensors beside the prediction."""
    measured, predicted = cache.allocated_nbytes(), predicted_kv_bytes(cache)
    index_bytes = measured_index_bytes(cache)
    return {
        "kv_tokens": cache.length,
        "kv_bytes_per_token": (measured + index_bytes) / cache.length,
        "kv_bytes_per_token_layer": cache.tier.bytes_per_token_layer,
        "kv_bytes_measured": measured,
        "kv_bytes_predicted": predicted,
        "kv_bytes_match": measured == predicted,
        "index_kv_bytes": index_bytes,
    }
