"""Experts streamed from disk under a RAM budget: the `ExpertStore` of a model bigger than RAM.

One `ExpertStreamer` per model owns the reader (pread / O_DIRECT on a thread pool), one cache
of decoded-ready experts for all layers (a byte budget it never exceeds, a policy, a pinned hot
set from the usage history) and the telemetry; each MoE layer gets a `StreamedExperts` view.

    get(ids)       the experts one forward pass of a layer needs (the batch's union, distinct):
                   hits from the cache, prefetched reads collected, misses read in parallel;
                   each read expert is kept if the cache can make room, else used once and dropped
    arrivals(ids)  the same, handed over one by one as each becomes ready (the MoE layer
                   computes on the first while the others are still being read)
    prefetch(ids)  the next layer's router, run early on the current hidden state, predicts ids:
                   their reads start now (bounded by `prefetch_bytes` in flight), behind any
                   read a pass waits for; a pass asking for one whose read has not started
                   yet reads it at once instead. A layer whose predictions recall less than
                   PREFETCH_MIN_RECALL of its asks is predicted but not read until they do

Memory: resident = cache (<= budget) + the experts of the current `get` that did not fit
(at most the batch's union for one layer) + prefetch reads in flight (<= prefetch_bytes).
The planner (`latentkv plan`) reserves the last two beside the cache.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from latentkv import fs
from latentkv.experts.base import Expert, LocalStore
from latentkv.experts.cache import ExpertCache
from latentkv.experts.extent import expert_from_extent
from latentkv.experts.health import StoreHealth
from latentkv.experts.history import FILE_NAME as HISTORY_FILE
from latentkv.experts.history import UsageHistory
from latentkv.experts.reader import ExpertReader, Extent
from latentkv.experts.store_file import ExpertFileError

HISTORY_SAVE_EVERY = 256  # forward passes between usage-history saves
# Prefetch for a layer only while its predictions recall at least this share of what it then
# asks for (a moving average over passes, weight RECALL_WEIGHT for the newest). A wrong guess
# costs a whole expert's read on the disk the pass waits for: on the experts benchmark, the
# next MoE layer's router recalled 67% and paid; the first MoE layer's, predicted from the dense
# layer before it, recalled 10% (chance: 8 of 64) and cost 8% of the speed.
PREFETCH_MIN_RECALL = 0.3
RECALL_WEIGHT = 0.2


@dataclass
class StreamConfig:
    budget: int  # bytes of experts kept resident (the cache)
    policy: str = "lru"
    threads: int = 4
    direct: bool | None = None  # O_DIRECT: None = where the file system takes it
    pin_fraction: float = 0.5  # at most this share of the budget pinned from the usage history
    prefetch_bytes: int | None = None  # bytes of prefetch reads in flight (None: 8 experts' worth)
    history: bool = True  # keep and use DIR/usage.json
    # the experts this streamer serves (a cluster rank's share of a full store): only these are
    # pinned from the usage history; None: every expert of the store
    experts: dict[int, frozenset[int]] | None = None


@dataclass
class Telemetry:
    """Counters since the store opened (or the last `reset`)."""

    asked: int = 0  # experts asked for by get (each pass counts each distinct expert once)
    hits: int = 0  # found in the cache
    prefetched: int = 0  # read ahead by prefetch, arrived or being read when asked
    misses: int = 0  # read on demand
    predicted: int = 0  # experts asked for in layers that had a prediction
    recalled: int = 0  # of those, how many the prediction named
    prefetch_reads: int = 0  # predicted reads queued (some are dropped before they start)
    wasted_prefetch: int = 0  # read ahead (or being read) but not asked for
    unread_predictions: int = 0  # predictions not read: their layer's recall was too low
    bytes_read: int = 0  # every read: on demand, prefetch, hot set
    read_seconds: float = 0.0  # time inside pread, summed over reader threads
    wait_seconds: float = 0.0  # time the forward pass waited for reads
    resident_bytes: int = 0
    budget: int = 0
    passes: int = 0
    draft_asked: int = 0  # of `asked`, the MTP draft layer's (drafting touches it every step)
    draft_hits: int = 0  # of `hits`, the MTP draft layer's

    @property
    def hit_rate(self) -> float:
        return self.hits / self.asked if self.asked else 0.0

    @property
    def main_hit_rate(self) -> float:
        """The hit rate of the main model's layers alone (the draft layer's asks left out)."""
        asked = self.asked - self.draft_asked
        return (self.hits - self.draft_hits) / asked if asked else 0.0

    @property
    def draft_hit_rate(self) -> float:
        return self.draft_hits / self.draft_asked if self.draft_asked else 0.0

    @property
    def recall(self) -> float:
        return self.recalled / self.predicted if self.predicted else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate,
            main_hit_rate=self.main_hit_rate,
            draft_hit_rate=self.draft_hit_rate,
            recall=self.recall,
            read_gbps=self.read_gbps,
        )
        return d


MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_frees() -> bool:
    """Have glibc give every allocation of 1 MiB or more its own mapping, returned to the OS on
    free. By default glibc raises that threshold as big blocks are freed (up to 32 MiB), and an
    expert cache that reads, builds and evicts 10-20 MiB experts then leaves their freed
    buffers in its heap, resident: on the experts benchmark 1.1 GB of them, past the cgroup
    limit. Process-wide, set once a streamer opens; False where the C library is not glibc."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


class ExpertStreamer:
    """The expert store directory of one model, streamed into a budgeted cache."""

    def __init__(self, directory: str | Path, fingerprint: str | None, config: StreamConfig):
        self.directory = Path(directory)
        self.config = config
        return_large_frees()
        self.reader = ExpertReader(directory, fingerprint, direct=config.direct, threads=config.threads)
        self.manifest = self.reader.manifest
        self.health = StoreHealth(self.directory, self.manifest)  # damage found while running
        self.cache = ExpertCache(config.budget, config.policy)
        self.telemetry = Telemetry(budget=config.budget)
        self.notes: list[str] = []
        layers = self.manifest.layers
        self.expert_bytes = {i: e.layout.stride for i, e in layers.items()}
        self.first_layer = min(layers) if layers else 0
        self.draft_layer: int | None = None  # the MTP layer's index, once attached (telemetry)
        largest = max(self.expert_bytes.values(), default=0)
        self.prefetch_bytes = config.prefetch_bytes if config.prefetch_bytes is not None else 8 * largest
        self._inflight: dict[tuple[int, int], Future[Extent]] = {}
        self._inflight_bytes = 0
        self._predicted: dict[int, set[int]] = {}
        self._recall: dict[int, float] = {}  # per layer: moving average of its predictions' recall
        self._lock = threading.Lock()
        self.history: UsageHistory | None = None
        if config.history:
            self._load_history()

    def layer(self, layer: int, at_once: int | None = None) -> StreamedExperts:
        """Layer `layer`'s store, asked for at most `at_once` experts at a time (a MoE layer's
        k: a long prompt's pass must not hold most of a layer beside the cache)."""
        return StreamedExperts(self, layer, at_once)

    # --- the hot set ------------------------------------------------------------------------

    def _load_history(self) -> None:
        counts = {i: e.n_experts for i, e in self.manifest.layers.items()}
        self.history, note = UsageHistory.load(
            self.directory / HISTORY_FILE, self.manifest.fingerprint, counts
        )
        if note:
            self.notes.append(note)

    def pin_hot_set(self) -> list[tuple[int, int]]:
        """Read and pin the most used experts, up to pin_fraction of the budget. The MTP draft
        layer's are left out: a run that does not draft would hold them for nothing, and a
        drafting run asks for them every round, so the cache keeps them by its policy."""
        if self.history is None:
            return []
        sizes = {i: n for i, n in self.expert_bytes.items() if i != self.draft_layer}
        hot = self.history.hot_set(
            int(self.config.budget * self.config.pin_fraction), sizes, self.config.experts
        )
        futures = [(key, self.reader.submit(*key)) for key in hot]
        pinned = []
        for key, f in futures:
            try:
                ext = f.result()
            except ExpertFileError as exc:  # not pinned; the pass that needs it says so
                self.notes.append(str(self.health.failed(*key, exc)))
                continue
            expert = expert_from_extent(ext)
            self.cache.put(key, expert, _charge(ext, expert), pin=True)
            pinned.append(key)
        return pinned

    def save_history(self) -> None:
        """Save the usage history; a disk that refuses is a note (the history only speeds
        later runs up), said once."""
        if self.history is None:
            return
        try:
            self.history.save(self.directory / HISTORY_FILE)
        except fs.DiskError as exc:
            self.history = None  # stop trying
            note = f"{exc}; running on without saving the usage history"
            self.notes.append(note)
            print(f"latentkv: {note}", file=sys.stderr)

    # --- reads ------------------------------------------------------------------------------

    def get(self, layer: int, ids: Sequence[int], first: bool = True) -> dict[int, Expert]:
        """The experts `ids` of `layer` (distinct ids): cached, prefetched or read now. `first`:
        the pass's first `get` on this layer (a new pass starts at the first layer's)."""
        return dict(self.arrivals(layer, ids, first))

    def arrivals(self, layer: int, ids: Sequence[int], first: bool = True) -> Iterator[tuple[int, Expert]]:
        """What `get` returns, as (id, expert) pairs the moment each is ready: cached ones at once,
        read ones in the order their reads finish, so a pass computes on the first while the
        rest are read. Every read has started when this returns. The cache takes the read ones
        in `ids` order once all have arrived (the same cache as `get`'s, whatever the order);
        until the iterator is exhausted or closed the pass's experts are held (not evicted)."""
        hits, pending = self._begin(layer, ids, first)
        self.cache.protect((layer, e) for e in ids)
        return self._arrive(layer, ids, hits, pending)

    def _begin(
        self, layer: int, ids: Sequence[int], first: bool
    ) -> tuple[dict[int, Expert], list[tuple[int, Future[Extent]]]]:
        """Count the asks, take the cached experts, start (or take over) the reads of the rest."""
        if layer == self.first_layer and first:
            self._next_pass()
        t = self.telemetry
        t.asked += len(ids)
        hits_before = t.hits
        predicted = self._predicted.pop(layer, None)
        if predicted is not None and ids:
            recalled = len(predicted.intersection(ids))
            t.predicted += len(ids)
            t.recalled += recalled
            avg = self._recall.get(layer, 1.0)
            self._recall[layer] = avg + RECALL_WEIGHT * (recalled / len(ids) - avg)
        hits: dict[int, Expert] = {}
        pending: list[tuple[int, Future[Extent]]] = []
        for e in ids:
            cached = self.cache.get((layer, e))
            if cached is not None:
                t.hits += 1
                hits[e] = cached
                continue
            future = self._take_inflight(layer, e)
            if future is not None and not future.cancel():
                t.prefetched += 1  # read ahead: arrived, or being read now
            else:  # not predicted, or its read had not started: read it now, first
                t.misses += 1
                future = self.reader.submit(layer, e)
            pending.append((e, future))
        if layer == self.draft_layer:
            t.draft_asked += len(ids)
            t.draft_hits += t.hits - hits_before
        self._discard_unused_prefetch(layer)
        return hits, pending

    def _arrive(
        self,
        layer: int,
        ids: Sequence[int],
        hits: dict[int, Expert],
        pending: list[tuple[int, Future[Extent]]],
    ) -> Iterator[tuple[int, Expert]]:
        t = self.telemetry
        read: dict[int, tuple[Extent, Expert]] = {}
        try:
            yield from hits.items()
            which = {future: e for e, future in pending}
            done = as_completed(which)
            for _ in range(len(which)):
                t0 = time.perf_counter()
                future = next(done)
                e = which[future]
                try:
                    ext = future.result()
                except ExpertFileError as exc:  # never computed on; the store is degraded
                    raise self.health.failed(layer, e, exc) from None
                self.health.ok(layer, e)
                read[e] = ext, expert_from_extent(ext)
                t.wait_seconds += time.perf_counter() - t0
                yield e, read[e][1]
            for e, _future in pending:
                ext, expert = read[e]
                self.cache.put((layer, e), expert, _charge(ext, expert))
            if self.history is not None:
                self.history.record(layer, ids)
        finally:
            for _e, future in pending:
                future.cancel()
            self.cache.release()
            t.resident_bytes = self.cache.resident_bytes

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """Start reading the experts of `layer` that are neither cached nor in flight. A layer may
        be predicted twice before it runs (early, and again once the layer before it is done):
        the later prediction drops the earlier one's reads that have not started, and recall
        counts the union."""
        if layer not in self.manifest.layers:
            return
        new = set(ids)
        earlier = self._predicted.get(layer)
        self._predicted[layer] = new if earlier is None else earlier | new  # measured while paused too
        if self._recall.get(layer, 1.0) < PREFETCH_MIN_RECALL:
            self.telemetry.unread_predictions += len(new)
            return
        size = self.expert_bytes[layer]
        with self._lock:
            if earlier is not None:
                for key in [k for k in self._inflight if k[0] == layer and k[1] not in new]:
                    if self._inflight[key].cancel():  # not started: the newer guess replaces it
                        del self._inflight[key]
                        self._inflight_bytes -= size
            for e in ids:
                key = (layer, e)
                if key in self.cache or key in self._inflight:
                    continue
                if self._inflight_bytes + size > self.prefetch_bytes:
                    break
                self._inflight[key] = self.reader.submit(layer, e, urgent=False)
                self._inflight_bytes += size
                self.telemetry.prefetch_reads += 1

    def _take_inflight(self, layer: int, e: int) -> Future[Extent] | None:
        with self._lock:
            future = self._inflight.pop((layer, e), None)
            if future is not None:
                self._inflight_bytes -= self.expert_bytes[layer]
            return future

    def _discard_unused_prefetch(self, layer: int) -> None:
        """Predictions for this layer that the pass did not ask for: let them go."""
        with self._lock:
            for key in [k for k in self._inflight if k[0] == layer]:
                future = self._inflight.pop(key)
                self._inflight_bytes -= self.expert_bytes[layer]
                if not future.cancel():  # read (or being read) for nothing
                    self.telemetry.wasted_prefetch += 1

    def _next_pass(self) -> None:
        self.cache.next_step()
        t = self.telemetry
        t.passes += 1
        if self.history is not None:
            self.history.tokens += 1
            if t.passes % HISTORY_SAVE_EVERY == 0:
                self.save_history()

    def snapshot(self) -> dict:
        """The telemetry, and the store's health (damaged experts are read again first, at most
        every few seconds: a repaired store is whole again without waiting for a request)."""
        t = self.telemetry
        t.read_seconds = self.reader.stats.read_seconds
        t.bytes_read = self.reader.stats.bytes_read
        t.resident_bytes = self.cache.resident_bytes
        self.health.recheck(self.reader.read)
        return {**t.as_dict(), "store": self.health.as_dict()}

    def close(self) -> None:
        with self._lock:
            for future in self._inflight.values():
                future.cancel()
            self._inflight.clear()
        self.reader.close()
        self.save_history()


class StreamedExperts(LocalStore):
    """One MoE layer's experts, streamed (the `ExpertStore` contract of `latentkv.experts.base`;
    `stacked` is None: never all resident, so the MoE layer asks `run`)."""

    def __init__(self, streamer: ExpertStreamer, layer: int, at_once: int | None = None):
        self.streamer = streamer
        self.layer = layer
        self.num_experts = streamer.reader.entry(layer).n_experts
        self.at_once = at_once

    def get(self, ids: Sequence[int], first: bool = True) -> Mapping[int, Expert]:
        return self.streamer.get(self.layer, ids, first)

    def arrivals(self, ids: Sequence[int], first: bool = True) -> Iterator[tuple[int, Expert]]:
        return self.streamer.arrivals(self.layer, ids, first)

    def prefetch(self, ids: Sequence[int]) -> None:
        self.streamer.prefetch(self.layer, ids)

    @property
    def nbytes(self) -> int:
        cache = self.streamer.cache
        return sum(
            self.streamer.expert_bytes[self.layer] for key in cache.cached_keys() if key[0] == self.layer
        )


def _charge(ext: Extent, expert: Expert) -> int:
    """Bytes an expert holds in the cache: its read buffer (plain and int8 formats keep views of
    it), or what the format built from it (int4 repacks), whichever is more."""
    return max(ext.layout.stride, expert.nbytes)
