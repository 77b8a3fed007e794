"""GET /metrics: Prometheus text exposition of the scheduler's state and the HTTP traffic.

Counters (`*_total`) are what Prometheus' rate() wants; the `*_per_second` gauges are the same
totals differentiated over the last WINDOW seconds, for a human with curl.
"""

from __future__ import annotations

import time
from collections import Counter, deque

WINDOW = 10.0  # seconds of history behind the tok/s gauges


class Throughput:
    """tok/s from samples of the cumulative (prompt, generation) token totals."""

    def __init__(self, window: float = WINDOW):
        self.window = window
        self.samples: deque[tuple[float, int, int]] = deque()

    def sample(self, prompt_total: int, generation_total: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, prompt_total, generation_total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def rates(self) -> tuple[float, float]:
        """(prompt tok/s, generation tok/s) between the oldest and newest sample."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        (t0, p0, g0), (t1, p1, g1) = self.samples[0], self.samples[-1]
        dt = t1 - t0
        return ((p1 - p0) / dt, (g1 - g0) / dt) if dt > 0 else (0.0, 0.0)


class Registry:
    """What the server itself counts: finished HTTP requests by route and status."""

    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()

    def count(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1


def render(model: str, loaded: bool, stats, rates: tuple[float, float], registry: Registry) -> str:
    """The exposition text. `stats` is the scheduler's SchedulerStats (None while loading)."""
    out = _Writer({"model_name": model})
    out.metric("latentkv_model_loaded", "gauge", "1 once the model is loaded and serving", int(loaded))
    if stats is not None:
        out.metric("latentkv_requests_running", "gauge", "Sequences in a batch slot", stats.running)
        out.metric("latentkv_requests_waiting", "gauge", "Requests queued for a slot", stats.waiting)
        out.metric(
            "latentkv_prompt_tokens_total", "counter", "Prompt tokens prefilled", stats.prompt_tokens_total
        )
        out.metric(
            "latentkv_generation_tokens_total", "counter", "Tokens generated", stats.generation_tokens_total
        )
        out.metric("latentkv_prompt_tokens_per_second", "gauge", f"Prefill tok/s over {WINDOW:g} s", rates[0])
        out.metric(
            "latentkv_generation_tokens_per_second", "gauge", f"Decode tok/s over {WINDOW:g} s", rates[1]
        )
        tier = {"tier": stats.kv_cache_dtype}
        out.metric("latentkv_kv_cache_bytes", "gauge", "KV cache bytes in use", stats.kv_bytes_in_use, tier)
        out.metric(
            "latentkv_kv_cache_capacity_bytes",
            "gauge",
            "KV cache bytes the batch slots may hold at most",
            stats.kv_bytes_capacity,
            tier,
        )
        if stats.experts is not None:
            _experts(out, stats.experts)
        if stats.speculative:
            _speculative(out, stats.speculative)
    out.header("latentkv_http_requests_total", "counter", "HTTP requests answered, by route and status")
    for (route, status), n in sorted(registry.requests.items()):
        out.sample("latentkv_http_requests_total", n, {"route": route, "status": str(status)})
    return out.text()


def _speculative(out: _Writer, spec: dict) -> None:
    """MTP drafting: verify steps, tokens per verify step, acceptance per draft position."""
    out.metric(
        "latentkv_speculative_verify_steps_total",
        "counter",
        "Verify steps (draft rounds)",
        spec["verify_steps"],
    )
    out.metric(
        "latentkv_speculative_tokens_per_verify",
        "gauge",
        "Tokens produced per verify step (accepted drafts + 1), since start",
        spec["tokens_per_verify"],
    )
    out.header(
        "latentkv_speculative_acceptance", "gauge", "Fraction of drafted tokens accepted, per draft position"
    )
    for j, rate in enumerate(spec["acceptance_per_position"]):
        out.sample("latentkv_speculative_acceptance", rate, {"position": str(j + 1)})


class _Writer:
    def __init__(self, common: dict[str, str]):
        self.common = common
        self.lines: list[str] = []

    def header(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        merged = {**self.common, **(labels or {})}
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items())
        self.lines.append(f"{name}{{{text}}} {_number(value)}")

    def metric(self, name: str, kind: str, help_text: str, value: float, labels=None) -> None:
        self.header(name, kind, help_text)
        self.sample(name, value, labels)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# (metric, kind, help, key in ExpertStreamer.snapshot())
EXPERT_METRICS = (
    (
        "latentkv_expert_requests_total",
        "counter",
        "Experts asked for by MoE layers (once per pass each)",
        "asked",
    ),
    ("latentkv_expert_hits_total", "counter", "Experts found in the expert cache", "hits"),
    ("latentkv_expert_misses_total", "counter", "Experts read from disk on demand", "misses"),
    ("latentkv_expert_prefetched_total", "counter", "Experts read ahead by prefetch and used", "prefetched"),
    ("latentkv_expert_read_bytes_total", "counter", "Bytes of experts read from disk", "bytes_read"),
    ("latentkv_expert_hit_rate", "gauge", "Expert cache hits over experts asked for", "hit_rate"),
    ("latentkv_expert_prefetch_recall", "gauge", "Experts asked for that the prefetch predicted", "recall"),
    ("latentkv_expert_read_gbps", "gauge", "Expert read speed in GB/s (inside pread)", "read_gbps"),
    ("latentkv_expert_cache_bytes", "gauge", "Bytes the expert cache holds", "resident_bytes"),
    ("latentkv_expert_cache_budget_bytes", "gauge", "The expert cache's byte budget", "budget"),
)


# With --speculative mtp: the MTP draft layer's share (its experts are asked for every step).
DRAFT_EXPERT_METRICS = (
    (
        "latentkv_expert_draft_requests_total",
        "counter",
        "Experts asked for by the MTP draft layer (included in latentkv_expert_requests_total)",
        "draft_asked",
    ),
    (
        "latentkv_expert_draft_hit_rate",
        "gauge",
        "Expert cache hits of the MTP draft layer over its experts asked for",
        "draft_hit_rate",
    ),
    (
        "latentkv_expert_main_hit_rate",
        "gauge",
        "Expert cache hit rate of the main model's layers (the draft layer's left out)",
        "main_hit_rate",
    ),
)


def _experts(out, snapshot: dict) -> None:
    for name, kind, help_text, key in EXPERT_METRICS:
        out.metric(name, kind, help_text, snapshot[key])
    if (store := snapshot.get("store")) is not None:
        out.metric(
            "latentkv_expert_store_degraded",
            "gauge",
            "1 while experts of the store are damaged or unreadable (see /health), else 0",
            int(store["degraded"]),
        )
        out.metric(
            "latentkv_expert_damaged",
            "gauge",
            "Experts found damaged or unreadable and not yet read back whole",
            len(store["damaged"]),
        )
        out.metric(
            "latentkv_expert_read_failures_total",
            "counter",
            "Expert reads that failed (a damaged extent, a layer file gone, an I/O error)",
            store["read_failures"],
        )
    if snapshot.get("draft_asked"):
        for name, kind, help_text, key in DRAFT_EXPERT_METRICS:
            out.metric(name, kind, help_text, snapshot[key])


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"
