"""GET /metrics: the server's Prometheus metrics, through `prometheus_client`.

Two kinds, in one `CollectorRegistry` per server (never the process-global one):

- per-request histograms, observed in the HTTP process as each sequence's events arrive
  (`RequestTimer`): time to first token, inter-token latency, end-to-end latency, queue time,
  prefill and decode time, prompt and generation lengths; and the finished count by reason.
  Names are vLLM's (`vllm:time_to_first_token_seconds` -> `latentkv_time_to_first_token_seconds`);
- the engine's state, read from `SchedulerStats` at each scrape (`_StateCollector`): running and
  waiting sequences, token counters, KV bytes, expert streaming, speculative decoding; plus the
  HTTP answers by route and status. These keep the names they had before prometheus_client.

Counters (`*_total`) are what Prometheus' rate() wants; the `*_per_second` gauges are the same
totals differentiated over the last WINDOW seconds, for a human with curl.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

WINDOW = 10.0  # seconds of history behind the tok/s gauges

# vLLM's buckets, with finer ones below 10 ms: a small model on a CPU emits tokens every few ms.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
ITL_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
REQUEST_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def length_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's `build_1_2_5_buckets`)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(float(b) for b in out)
            out.append(m * scale)
        scale *= 10


class Snapshot(NamedTuple):
    """What the state collector reads at a scrape."""

    loaded: bool
    stats: object | None  # engine.request.SchedulerStats, None while loading
    rates: tuple[float, float]  # (prompt tok/s, generation tok/s) over the last WINDOW seconds


class Metrics:
    """The server's metrics: histograms and counters it observes, and its engine's state."""

    def __init__(
        self,
        model_name: str,
        source: Callable[[], Snapshot] | None = None,
        max_model_len: int = 1 << 20,
    ):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, name = self.registry, ["model_name"]

        def histogram(metric: str, doc: str, buckets) -> Histogram:
            return Histogram(metric, doc, name, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = histogram(
            "latentkv_time_to_first_token_seconds",
            "Seconds from submitting a sequence to its first token",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "latentkv_inter_token_latency_seconds", "Seconds between a sequence's tokens", ITL_BUCKETS
        )
        self.e2e = histogram(
            "latentkv_e2e_request_latency_seconds",
            "Seconds from submitting a sequence to its end",
            REQUEST_BUCKETS,
        )
        self.queue = histogram(
            "latentkv_request_queue_time_seconds",
            "Seconds a sequence waited for a batch slot",
            REQUEST_BUCKETS,
        )
        self.prefill = histogram(
            "latentkv_request_prefill_time_seconds", "Seconds of a sequence's prefill", REQUEST_BUCKETS
        )
        self.decode = histogram(
            "latentkv_request_decode_time_seconds",
            "Seconds of the decode steps a sequence took part in",
            REQUEST_BUCKETS,
        )
        lengths = length_buckets(max_model_len)
        self.prompt_len = histogram(
            "latentkv_request_prompt_tokens", "Prompt tokens per sequence (cached ones included)", lengths
        )
        self.generation_len = histogram(
            "latentkv_request_generation_tokens", "Tokens generated per sequence", lengths
        )
        self._finished = Counter(
            "latentkv_request_success",
            "Sequences finished, by reason (stop, length, cancelled, error)",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self._http = Counter(
            "latentkv_http_requests",
            "HTTP requests answered, by route and status",
            ["model_name", "route", "status"],
            registry=reg,
        )
        reg.register(_StateCollector(model_name, source or (lambda: Snapshot(False, None, (0.0, 0.0)))))

    def count_http(self, route: str, status: int) -> None:
        self._http.labels(self.model_name, route, str(status)).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def timer(self) -> RequestTimer:
        """A timer for one sequence, started now (call it just before submitting)."""
        return RequestTimer(self)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type) for a scrape, in the format its Accept header asks for."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class RequestTimer:
    """One sequence's timings, observed as its events reach the HTTP process.

    Tokens a step delivers together (speculative decoding accepts several) arrive together, so
    the later ones count an inter-token gap near 0, as a client sees them."""

    def __init__(self, metrics: Metrics, now: float | None = None):
        self.metrics = metrics
        self.submitted = time.monotonic() if now is None else now
        self.last: float | None = None
        self.done = False

    def token(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.last is None:
            self.metrics.ttft.observe(now - self.submitted)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finish(self, finished, reason: str, now: float | None = None) -> None:
        """The sequence ended with `reason` (as the client is told); `finished` is the engine's
        Finished (None when the reader left before it came). A refused request is not counted."""
        if self.done or getattr(finished, "refused", None) is not None:
            return
        self.done = True
        now = time.monotonic() if now is None else now
        m = self.metrics
        if finished is not None:
            if self.last is None and finished.completion_tokens:  # its first token was a stop token
                m.ttft.observe(now - self.submitted)
            m.queue.observe(finished.queued_seconds)
            m.prefill.observe(finished.prefill_seconds)
            m.decode.observe(finished.decode_seconds)
            m.prompt_len.observe(finished.prompt_tokens)
            m.generation_len.observe(finished.completion_tokens)
        m.e2e.observe(now - self.submitted)
        m.finished(reason)


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


def render(model: str, loaded: bool, stats, rates: tuple[float, float] = (0.0, 0.0)) -> str:
    """The text exposition of the engine's state alone (`stats` a SchedulerStats or None)."""
    metrics = Metrics(model, lambda: Snapshot(loaded, stats, rates))
    return metrics.render()[0].decode()


class _StateCollector(Collector):
    """The engine's state at scrape time, as gauges and counters."""

    def __init__(self, model_name: str, source: Callable[[], Snapshot]):
        self.model_name = model_name
        self.source = source

    def collect(self) -> Iterator:
        snap = self.source()
        out = _Families(self.model_name)
        out.gauge("latentkv_model_loaded", "1 once the model is loaded and serving", int(snap.loaded))
        stats = snap.stats
        if stats is not None:
            _engine(out, stats, snap.rates)
            if stats.experts is not None:
                _experts(out, stats.experts)
            if stats.device_experts is not None:
                _metrics(out, DEVICE_EXPERT_METRICS, stats.device_experts)
            if stats.speculative:
                _speculative(out, stats.speculative)
            if stats.cluster:
                _cluster(out, stats.cluster)
        return iter(out.families)


class _Families:
    """Metric families with the model_name label on every sample."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.families: list = []

    def _family(self, cls, name: str, doc: str, value: float, labels: dict[str, str] | None):
        labels = labels or {}
        family = cls(name, doc, labels=["model_name", *labels])
        family.add_metric([self.model_name, *labels.values()], value)
        self.families.append(family)

    def gauge(self, name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> None:
        self._family(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> None:
        self._family(CounterMetricFamily, name.removesuffix("_total"), doc, value, labels)

    def gauges(self, name: str, doc: str, label: str, values: dict[str, float]) -> None:
        family = GaugeMetricFamily(name, doc, labels=["model_name", label])
        for key, value in values.items():
            family.add_metric([self.model_name, key], value)
        self.families.append(family)


def _engine(out: _Families, stats, rates: tuple[float, float]) -> None:
    out.gauge("latentkv_requests_running", "Sequences in a batch slot", stats.running)
    out.gauge("latentkv_requests_waiting", "Sequences queued for a slot", stats.waiting)
    out.counter("latentkv_prompt_tokens_total", "Prompt tokens prefilled", stats.prompt_tokens_total)
    out.counter("latentkv_generation_tokens_total", "Tokens generated", stats.generation_tokens_total)
    out.gauge("latentkv_prompt_tokens_per_second", f"Prefill tok/s over {WINDOW:g} s", rates[0])
    out.gauge("latentkv_generation_tokens_per_second", f"Decode tok/s over {WINDOW:g} s", rates[1])
    tier = {"tier": stats.kv_cache_dtype}
    out.gauge("latentkv_kv_cache_bytes", "KV cache bytes in use", stats.kv_bytes_in_use, tier)
    out.gauge(
        "latentkv_kv_cache_capacity_bytes",
        "KV cache bytes the batch slots may hold at most",
        stats.kv_bytes_capacity,
        tier,
    )
    usage = stats.kv_bytes_in_use / stats.kv_bytes_capacity if stats.kv_bytes_capacity else 0.0
    out.gauge("latentkv_kv_cache_usage_perc", "KV cache bytes in use over capacity (0 to 1)", usage)


def _speculative(out: _Families, spec: dict) -> None:
    """MTP drafting: verify steps, tokens per verify step, acceptance per draft position."""
    out.counter(
        "latentkv_speculative_verify_steps_total", "Verify steps (draft rounds)", spec["verify_steps"]
    )
    out.gauge(
        "latentkv_speculative_tokens_per_verify",
        "Tokens produced per verify step (accepted drafts + 1), since start",
        spec["tokens_per_verify"],
    )
    out.gauges(
        "latentkv_speculative_acceptance",
        "Fraction of drafted tokens accepted, per draft position",
        "position",
        {str(j + 1): rate for j, rate in enumerate(spec["acceptance_per_position"])},
    )


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


# (metric, kind, help, key in DeviceCache.snapshot()): the routed experts' cache on the GPU (--vram-gb)
DEVICE_EXPERT_METRICS = (
    (
        "latentkv_device_expert_requests_total",
        "counter",
        "Experts asked of the GPU's expert cache (once per pass each)",
        "asked",
    ),
    ("latentkv_device_expert_hits_total", "counter", "Experts found in a GPU slot", "hits"),
    (
        "latentkv_device_expert_copies_total",
        "counter",
        "Experts copied from host memory to the GPU",
        "copies",
    ),
    (
        "latentkv_device_expert_copied_bytes_total",
        "counter",
        "Bytes copied from host memory to the GPU",
        "bytes_copied",
    ),
    ("latentkv_device_expert_hit_rate", "gauge", "GPU expert cache hits over experts asked for", "hit_rate"),
    ("latentkv_device_expert_slots", "gauge", "Experts the GPU's expert cache holds at most", "slots"),
    ("latentkv_device_expert_cache_bytes", "gauge", "Bytes the GPU's expert slots hold", "bytes"),
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


# (metric, kind, help, key of a rank's record in `Cluster.report`), one sample per rank
CLUSTER_METRICS = (
    ("latentkv_cluster_rank_up", "gauge", "1 while the rank answers, 0 once it is lost", None),
    ("latentkv_cluster_expert_hit_rate", "gauge", "The rank's expert cache hit rate", "hit_rate"),
    ("latentkv_cluster_prefetch_recall", "gauge", "The rank's prefetch recall", "recall"),
    (
        "latentkv_cluster_read_gbps",
        "gauge",
        "The rank's expert read speed in GB/s (inside pread)",
        "read_gbps",
    ),
    (
        "latentkv_cluster_read_bytes_total",
        "counter",
        "Bytes of experts the rank read from disk",
        "bytes_read",
    ),
    ("latentkv_cluster_sent_bytes_total", "counter", "Bytes the rank sent to the others", "bytes_sent"),
    (
        "latentkv_cluster_sent_bytes_per_token",
        "gauge",
        "Bytes the rank sent per token the head ran",
        "bytes_sent_per_token",
    ),
    (
        "latentkv_cluster_network_wait_seconds_total",
        "counter",
        "Time the rank waited on the network (the head: for outputs; a worker: in sends)",
        "net_wait_seconds",
    ),
)


def _cluster(out: _Families, cluster: dict) -> None:
    """A cluster's state (docs/distributed.md) and every rank's telemetry, labelled by rank and role."""
    out.gauge("latentkv_cluster_ranks", "Ranks in the cluster (the head included)", len(cluster["ranks"]))
    out.gauge("latentkv_cluster_degraded", "1 while a rank is lost", int(cluster["status"] != "ok"))
    out.gauge(
        "latentkv_cluster_epoch", "Groups formed so far (a rank's return forms a new one)", cluster["epoch"]
    )
    for name, kind, doc, key in CLUSTER_METRICS:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(
            name.removesuffix("_total") if kind == "counter" else name,
            doc,
            labels=["model_name", "rank", "role"],
        )
        for rec in cluster["ranks"]:
            value = int(rec.get("status") == "ok") if key is None else rec.get(key, 0)
            family.add_metric([out.model_name, str(rec["rank"]), rec.get("role", "worker")], value)
        out.families.append(family)


def _metrics(out: _Families, table: tuple, snapshot: dict) -> None:
    """One sample per (metric, kind, help, key) row of `table`, its value snapshot[key]."""
    for name, kind, help_text, key in table:
        (out.counter if kind == "counter" else out.gauge)(name, help_text, snapshot[key])


def _experts(out: _Families, snapshot: dict) -> None:
    _metrics(out, EXPERT_METRICS + (DRAFT_EXPERT_METRICS if snapshot.get("draft_asked") else ()), snapshot)
    if (store := snapshot.get("store")) is not None:
        out.gauge(
            "latentkv_expert_store_degraded",
            "1 while experts of the store are damaged or unreadable (see /health), else 0",
            int(store["degraded"]),
        )
        out.gauge(
            "latentkv_expert_damaged",
            "Experts found damaged or unreadable and not yet read back whole",
            len(store["damaged"]),
        )
        out.counter(
            "latentkv_expert_read_failures_total",
            "Expert reads that failed (a damaged extent, a layer file gone, an I/O error)",
            store["read_failures"],
        )
