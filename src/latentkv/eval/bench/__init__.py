"""Benchmarks behind `latentkv bench`: what each one measures (`measure_NAME.py`; the flags,
the checks and the tables of `latentkv bench NAME` are `latentkv.commands.bench.NAME`), and the
workload they share (`workload.py`: random prompts, random cache fill, KV byte accounting).

decode      One row per (engine, weight dtype, KV tier, context). latentkv is timed pass by
            pass: prefill is the one batched prompt pass; decode tok/s is the (tokens - 1)
            decode passes over their total time (the first token comes from the prefill
            logits), each pass one token over a cache that grows from `context`.
            transformers' generate() is timed by a streamer: prefill is the time to the first
            token, decode the time from the first to the last.
            fill "random" skips the prompt: random rows go straight into every layer's cache
            (latent c RMS-normed like the real ones, r and the indexer keys N(0,1)), then the
            same decode passes run over them. Decode speed does not depend on the row values:
            every tier unpacks and multiplies the same number of bytes whatever they hold.
attention   scores + softmax + context of one decode query per head over T cached rows,
            through the same cache readers `MLA.attend` uses; median of several repeats.
resume      a conversation of N tokens saved as a KV file, then brought back the way a restarted
            process does (weights fingerprint, open, verify every record, load into a cache:
            `Session.resume`) against prefilling the same N tokens again.

KV memory is measured from the cache's tensors (`allocated_nbytes()`) and set beside the
prediction `bytes_per_token_layer x layers x tokens`."""

from latentkv.eval.bench.measure_attention import (
    AttentionRow,
    attention_layout,
    bench_attention,
    compare_attention,
)
from latentkv.eval.bench.measure_decode import (
    BenchRow,
    add_ratios,
    bench_latentkv,
    bench_transformers,
    load_transformers,
)
from latentkv.eval.bench.measure_resume import ResumeRow, bench_resume, predicted_file_bytes
from latentkv.eval.bench.workload import (
    FILL_CHUNK,
    FILL_MODES,
    fill_random,
    measured_index_bytes,
    predicted_kv_bytes,
    random_prompt,
)

__all__ = [
    "AttentionRow",
    "BenchRow",
    "FILL_CHUNK",
    "FILL_MODES",
    "ResumeRow",
    "add_ratios",
    "attention_layout",
    "bench_attention",
    "bench_latentkv",
    "bench_resume",
    "bench_transformers",
    "compare_attention",
    "fill_random",
    "load_transformers",
    "measured_index_bytes",
    "predicted_file_bytes",
    "predicted_kv_bytes",
    "random_prompt",
]
