"""Perplexity of held-out text per KV tier, scored through each tier's real cache.

The text is tokenized once and cut into non-overlapping windows of N tokens (evenly spaced
ones when --max-windows keeps fewer than the text holds). Each window is scored by one call

    logits = model.forward(window, model.make_cache(tier), all_logits=True)    # [N, vocab]

which appends the window's latent rows to an empty cache of that tier first and then attends
through the tier's reader: every query sees the quantized rows exactly as decode would
(tests/eval/test_ppl.py checks it against token-by-token decode). Position t predicts token
t+1, so a window scores N-1 tokens; with `score_from` S only the positions t >= S are scored
(N-1-S tokens), each still seeing the whole window before it: llama-perplexity scores the
second half of each chunk, S = N/2.

Per window, against the f32 cache's logits of the same window (f32 runs once and is the
reference; a window's f32 logits are dropped before the next window, so memory stays bounded):

    nll    sum_t -log q(x_{t+1})                     q = softmax(tier logits)
    kl     sum_t sum_v p_v (log p_v - log q_v)       p = softmax(f32 logits)   KL(f32 || tier)
    agree  #t with argmax q = argmax p                top-1 agreement

Per tier, over windows: ppl = exp(sum nll / tokens), delta ppl % vs f32, mean KL per token and
top-1 agreement, each with a 95% percentile bootstrap interval that resamples whole windows
(tokens within a window are correlated), with the same resamples for every tier (paired).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from latentkv.config import CacheConfig
from latentkv.eval import stats
from latentkv.kv.cache import CacheLayout, KVTier, resolve_tier

SHORT_CONTEXT, LONG_CONTEXT = 256, 1024
ROW_CHUNK = 256  # logits rows compared at a time (float64 working set: ROW_CHUNK x vocab)
MIN_WINDOWS_FOR_INTERVALS = 2


def default_contexts(max_positions: int) -> list[int]:
    """Short (256) and long (1024, or the model's maximum if smaller) windows."""
    return sorted({min(SHORT_CONTEXT, max_positions), min(LONG_CONTEXT, max_positions)})


def make_windows(ids: Sequence[int], context: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [W, context] of the token stream; the tail shorter than a window is
    dropped. With max_windows, that many windows spread evenly over the text."""
    if context < 2:
        raise ValueError(f"a window needs at least 2 tokens (got --context {context})")
    available = len(ids) // context
    if available < 1:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than one window of {context}; use a longer "
            "text or a shorter --context"
        )
    picked = np.arange(available)
    if max_windows is not None and max_windows < available:
        if max_windows < 1:
            raise ValueError(f"--max-windows must be positive (got {max_windows})")
        picked = np.unique(np.linspace(0, available - 1, max_windows).round().astype(np.int64))
    stream = torch.as_tensor(list(ids[: available * context]), dtype=torch.long).view(available, context)
    return stream[torch.from_numpy(picked)]


def score_window(model, window: torch.Tensor, tier: KVTier) -> torch.Tensor:
    """window [N] -> logits [N, vocab], one pass over an empty cache of `tier` (the model's)."""
    return model.forward(window, model.make_cache(tier), all_logits=True)


@dataclass(frozen=True)
class WindowScore:
    nll: float  # summed over the window's scored tokens
    kl: float
    agree: int


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> WindowScore:
    """reference, logits [T, vocab] (f32 cache, tier) at the positions predicting targets [T]."""
    nll = kl = 0.0
    agree = 0
    for start in range(0, targets.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        log_p = torch.log_softmax(reference[rows].double(), dim=-1)  # [t, vocab]
        log_q = torch.log_softmax(logits[rows].double(), dim=-1)
        nll -= float(log_q.gather(1, targets[rows, None]).sum())
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        agree += int((reference[rows].argmax(-1) == logits[rows].argmax(-1)).sum())
    return WindowScore(nll, kl, agree)


@dataclass(frozen=True)
class Variant:
    """One scored configuration: a model (its weights in some format) and a KV tier."""

    model: object
    cache: CacheConfig
    weights: str = "f32"  # the weight format's name, for the report


@dataclass
class ContextScores:
    """Per-window sums for every variant (weights x KV tier) at one context length; arrays
    [variants, windows]. Row 0 is the reference (f32 weights, f32 cache)."""

    context: int
    tiers: list[CacheConfig]
    windows: int
    nll: np.ndarray
    kl: np.ndarray
    agree: np.ndarray
    seconds: np.ndarray  # [tiers]: time spent scoring
    targets: list[torch.Tensor] = field(default_factory=list)  # per window [N-1-S], for the unigram
    score_from: int = 0  # S: the first scored position
    weights: list[str] = field(default_factory=list)  # per row: the weight format ("f32" if empty)

    @classmethod
    def empty(
        cls,
        context: int,
        tiers: list[CacheConfig],
        windows: int,
        score_from: int = 0,
        weights: list[str] | None = None,
    ) -> ContextScores:
        def zeros():
            return np.zeros((len(tiers), windows))

        z = np.zeros(len(tiers))
        return cls(
            context,
            tiers,
            windows,
            zeros(),
            zeros(),
            zeros(),
            z,
            score_from=score_from,
            weights=weights or [],
        )

    @property
    def tokens_per_window(self) -> int:
        return self.context - 1 - self.score_from


def score_context(
    model,
    windows: torch.Tensor,
    tiers: Sequence[CacheConfig],
    progress: Callable[[str], None] | None = None,
    score_from: int = 0,
) -> ContextScores:
    """Score windows [W, N] under f32 (the reference) and every tier, window by window; only the
    positions t >= score_from (predicting tokens score_from + 1 .. N - 1) count."""
    return score_variants(windows, [Variant(model, t) for t in _with_reference(tiers)], progress, score_from)


def score_variants(
    windows: torch.Tensor,
    variants: Sequence[Variant],
    progress: Callable[[str], None] | None = None,
    score_from: int = 0,
) -> ContextScores:
    """Score windows [W, N] under every variant, window by window; variants[0] is the reference
    (f32 weights and cache) the others are compared with. Only positions t >= score_from count."""
    W, N = windows.shape
    if not 0 <= score_from <= N - 2:
        raise ValueError(f"--score-from {score_from}: must be 0 .. {N - 2} for windows of {N} tokens")
    out = ContextScores.empty(N, [v.cache for v in variants], W, score_from, [v.weights for v in variants])
    tiers = [v.model.tier(v.cache) for v in variants]
    t0 = last = time.perf_counter()
    for w in range(W):
        window, targets = windows[w], windows[w, score_from + 1 :]
        reference = None
        for i, v in enumerate(variants):
            t = time.perf_counter()
            logits = score_window(v.model, window, tiers[i])[
                score_from:-1
            ]  # [N-1-S, vocab]: the scored positions
            out.seconds[i] += time.perf_counter() - t
            reference = logits if reference is None else reference
            s = compare(reference, logits, targets)
            out.nll[i, w], out.kl[i, w], out.agree[i, w] = s.nll, s.kl, s.agree
        out.targets.append(targets)
        now = time.perf_counter()
        if progress is not None and (now - last > 2.0 or w == W - 1):
            last = now
            eta = (now - t0) / (w + 1) * (W - w - 1)
            progress(f"context {N}: window {w + 1}/{W}, {now - t0:.0f} s, ~{eta:.0f} s left")
    return out


def _with_reference(tiers: Sequence[CacheConfig]) -> list[CacheConfig]:
    """f32 first (the reference), then the other tiers in the order given."""
    rest = [t for t in tiers if t.kv_cache_dtype != "f32"]
    return [CacheConfig("f32"), *rest]


def summarize(
    scores: ContextScores, layout: CacheLayout, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> dict:
    """Per tier: ppl, delta ppl % vs f32, mean KL per token, top-1 agreement, each with its
    bootstrap interval over windows (paired across tiers); bytes per token per layer."""
    counts = np.full(scores.windows, float(scores.tokens_per_window))
    index = None  # [resamples, windows], shared by every statistic of every tier
    if scores.windows >= MIN_WINDOWS_FOR_INTERVALS and resamples > 0:
        index = stats.resample_indices(scores.windows, resamples, seed)
    rows = [_tier_row(scores, i, counts, index, level) for i in range(len(scores.tiers))]
    for row, tier in zip(rows, scores.tiers, strict=True):
        row["bytes_per_token_layer"] = resolve_tier(layout, tier).bytes_per_token_layer
    return {
        "context": scores.context,
        "score_from": scores.score_from,
        "windows": scores.windows,
        "tokens_scored": int(counts.sum()),
        "tiers": rows,
    }


def _tier_row(
    scores: ContextScores, i: int, counts: np.ndarray, index: np.ndarray | None, level: float
) -> dict:
    """Tier i's statistics; row 0 is f32, the reference of the paired delta."""
    total = counts.sum()
    nll, ref_nll = scores.nll[i].sum() / total, scores.nll[0].sum() / total
    row = {
        "weights": scores.weights[i] if scores.weights else "f32",
        "tier": scores.tiers[i].kv_cache_dtype,
        "tokens": int(total),
        "nll": float(nll),
        "ppl": math.exp(nll),
        "delta_ppl_pct": 100 * math.expm1(nll - ref_nll),
        "kld": float(scores.kl[i].sum() / total),
        "top1": float(scores.agree[i].sum() / total),
        "seconds": round(float(scores.seconds[i]), 3),
    }
    if index is None:
        return {**row, "ppl_ci": None, "delta_ppl_pct_ci": None, "kld_ci": None, "top1_ci": None}
    boot_nll = stats.resampled_ratio(scores.nll[i], counts, index)
    boot_ref = stats.resampled_ratio(scores.nll[0], counts, index)
    intervals = {
        "ppl_ci": np.exp(boot_nll),
        "delta_ppl_pct_ci": 100 * np.expm1(boot_nll - boot_ref),
        "kld_ci": stats.resampled_ratio(scores.kl[i], counts, index),
        "top1_ci": stats.resampled_ratio(scores.agree[i], counts, index),
    }
    return {**row, **{k: list(stats.percentile_interval(v, level)) for k, v in intervals.items()}}


# --- the unigram baseline ----------------------------------------------------------------


def load_token_counts(path: Path, vocab_size: int) -> np.ndarray:
    """Training-split token counts: a JSON list (count of id i at index i) -> float64 [vocab]."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read token counts from {path}: {exc}") from None
    if not isinstance(raw, list) or not all(isinstance(c, int) and c >= 0 for c in raw):
        raise ValueError(f"{path}: expected a JSON list of non-negative integer counts, one per token id")
    if len(raw) > vocab_size:
        raise ValueError(f"{path} has {len(raw)} counts for a vocabulary of {vocab_size}")
    counts = np.zeros(vocab_size)
    counts[: len(raw)] = raw
    return counts


def unigram_ppl(counts: np.ndarray, targets: Sequence[torch.Tensor]) -> float:
    """Perplexity of the targets under the add-one smoothed unigram (c_i + 1) / (C + V)."""
    log_p = np.log(counts + 1) - np.log(counts.sum() + len(counts))
    ids = torch.cat(list(targets)).numpy()
    return float(np.exp(-log_p[ids].mean()))
