"""Decode benchmark: latentkv and transformers' generate() on the same checkpoint, same threads.

Both are timed the same way: prefill is the time to the first generated token; decode tok/s
is (tokens - 1) over the time from the first to the last generated token, i.e. one forward
pass per token over a cache that grows from `context`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class BenchRow:
    engine: str
    model: str
    weight_dtype: str
    kv_cache_dtype: str
    context: int
    decode_tokens: int
    threads: int
    prefill_tps: float
    decode_tps: float
    kv_bytes_per_token: float
    kv_bytes_per_token_layer: float

    def as_dict(self) -> dict:
        return asdict(self)


def random_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def bench_latentkv(model, name: str, weight_dtype: str, context: int, decode_tokens: int) -> BenchRow:
    from latentkv.engine.generate import generate
    from latentkv.engine.sampling import SamplingParams

    prompt = random_prompt(model.cfg.vocab_size, context)
    generate(model, prompt[:8], 2, SamplingParams(), stop_ids=())  # warm up allocator and tables
    result = generate(model, prompt, decode_tokens, SamplingParams(), stop_ids=())
    stats = result.stats
    cache_tokens = context + decode_tokens - 1
    per_layer = stats.kv_bytes_per_token_layer
    return BenchRow(
        engine="latentkv",
        model=name,
        weight_dtype=weight_dtype,
        kv_cache_dtype=stats.kv_cache_dtype,
        context=context,
        decode_tokens=decode_tokens,
        threads=torch.get_num_threads(),
        prefill_tps=stats.prompt_tps,
        decode_tps=stats.decode_tps,
        kv_bytes_per_token=(stats.kv_bytes + stats.index_kv_bytes) / cache_tokens,
        kv_bytes_per_token_layer=per_layer,
    )


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

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[weight_dtype]
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
    n_layers = cfg.num_hidden_layers
    return BenchRow(
        engine="transformers",
        model=name,
        weight_dtype=weight_dtype,
        kv_cache_dtype=str(hf_model.dtype).removeprefix("torch."),
        context=context,
        decode_tokens=decode_tokens,
        threads=torch.get_num_threads(),
        prefill_tps=context / (first - clock.start),
        decode_tps=(len(clock.stamps) - 1) / (last - first) if last > first else 0.0,
        kv_bytes_per_token=cache_bytes / cache_tokens,
        kv_bytes_per_token_layer=cache_bytes / cache_tokens / n_layers,
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
