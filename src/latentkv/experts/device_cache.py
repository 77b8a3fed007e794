"""Routed experts served on a compute device from host memory, through a bounded set of slots.

    cache = DeviceCache(torch.device("cuda"), slots=40, prefetch_max=8)
    store = cache.over(layer, host_store, resident=True)   # one per MoE layer (an ExpertStore)

The host-side store holds a layer's experts in host memory: all of them (`hold`: one flat buffer
per layer, page-locked in place on CUDA so copies run at the bus's speed and overlap compute),
or the streamed store (disk -> host cache, `experts/streamed.py`). The device holds at most
`slots` experts, shared by every layer and kept by the expert cache's policy (`experts/cache.py`,
each slot charged 1). A slot is one flat device buffer in the expert's extent layout
(`experts/extent.py`), so any format with an extent codec is served alike.

A pass of one layer (`arrivals(ids)`, at most `at_once` experts, so each has a slot):
    hits      the experts already in a slot
    misses    asked of the host store together (every disk read started), each copied into a
              slot: evicting by policy, never an expert of this pass (protected until it ends);
              on CUDA on the copy stream, after the compute that last read the slot (an event
              recorded when its pass ended), `non_blocking` from page-locked memory; an expert in
              pageable memory (the disk store's read buffers) is first copied into one of a small
              ring of page-locked staging buffers, which is refilled only once the copy out of it
              is done (its event), so the copy to the device still overlaps compute
    handed    every miss's copy is issued before the first miss is handed over (with experts
              resident on the host, before the first hit too); on CUDA the compute stream waits on
              a copy's event, the host thread never does
Should no slot be free (everything protected), the expert is copied into a buffer used for this
pass only (`not_kept`).

`prefetch(ids)` (the next layer's router, run early): with resident host experts, up to
`prefetch_max` of them are copied into slots now; with a streamed store the hint goes to it
(disk reads start; the copies wait for the pass).

Nothing here picks a device: it is passed in. With device=cpu the same logic runs over CPU
slots with synchronous copies (how the tests run it). The CUDA calls (streams, events, page
locking) are all in `CudaOps`; the tests stand a CPU fake in for it that runs each copy only when
an event after it is waited for, so an ordering mistake shows as wrong weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from latentkv.experts.base import Expert, ExpertStore, LocalStore
from latentkv.experts.cache import ExpertCache
from latentkv.experts.extent import expert_from_views, expert_layout, flat_view
from latentkv.experts.store_file import ExtentLayout

PAGE = 4096
STAGING_BUFFERS = 4  # page-locked buffers pageable experts are staged through (per device cache)


@dataclass
class DeviceCacheStats:
    """Counters since the cache was made."""

    asked: int = 0  # experts asked for by passes (each distinct expert of a pass once)
    hits: int = 0  # found in a slot
    misses: int = 0  # copied in for the pass that asked
    prefetched: int = 0  # of the hits, experts copied ahead by prefetch and not yet used
    prefetch_copies: int = 0  # copies made by prefetch
    copies: int = 0  # host -> device copies, all kinds
    bytes_copied: int = 0
    not_kept: int = 0  # copied into a buffer for one pass only (no slot could be freed)
    staged: int = 0  # copies from pageable memory, through a page-locked staging buffer
    staging_waits: int = 0  # of those, how often the host waited for a staging buffer's last copy

    @property
    def hit_rate(self) -> float:
        return self.hits / self.asked if self.asked else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(eq=False)
class _Slot:
    """One expert on the device: its flat buffer, and the events that order reuse on CUDA."""

    layout: ExtentLayout
    buffer: torch.Tensor | None = None  # uint8 [layout.length] on the device
    ready: object | None = None  # CUDA event: the copy into `buffer` is done
    free_after: object | None = None  # CUDA event: the compute that last read `buffer` is done
    expert: Expert | None = None  # built over `buffer` once its copy is waited for
    prefetched: bool = False  # copied ahead, not yet asked for


class CudaOps:
    """The CUDA calls of the copies: a side stream for them, events to order them, page-locked
    host memory. Events answer `query()` (done?) and `synchronize()` (wait for it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], buffer: torch.Tensor, after):
        """dst[i] <- src[i] (every src page-locked: asynchronous) on the copy stream after event
        `after`; the event of their end."""
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
            buffer.record_stream(self.stream)  # freed while a copy runs: not reused before its end
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event) -> None:
        """The compute stream waits for `event` (the host does not)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self):
        """An event after the compute issued so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def locked(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of exactly `nbytes` (unlocked when it is collected)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        page_lock(buffer, buffer)
        return buffer

    @staticmethod
    def is_locked(t: torch.Tensor) -> bool:
        return t.is_pinned()


def page_lock(owner: object, buffer: torch.Tensor) -> None:
    """Page-lock `buffer` in place (cudaHostRegister: no rounding up, unlike torch's pinned
    allocator), unlocked when `owner` is collected (at the latest at exit, where an error is moot)."""
    if not buffer.numel():
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    weakref.finalize(owner, cudart.cudaHostUnregister, buffer.data_ptr())


class StagingRing:
    """Page-locked host buffers that experts in pageable memory pass through on their way to the
    device, used in turn. A buffer is handed out again only once the copy out of it is done: its
    event is synchronized first (the host waits only when every buffer's copy is still running).
    The buffers are made on first use, of the first expert's bytes rounded up to a page (all of a
    model's experts share one layout); a larger expert remakes the buffer it is given."""

    def __init__(self, count: int, alloc, stats: DeviceCacheStats):
        if count < 1:
            raise ValueError(f"a staging ring needs at least one buffer, got {count}")
        self.alloc = alloc  # nbytes -> a page-locked uint8 host tensor
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.pending: list[object | None] = [None] * count  # the event of each buffer's last copy
        self.next = 0
        self.stats = stats

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(the buffer's index, a buffer of at least `nbytes` whose last copy is done)."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        event, self.pending[i] = self.pending[i], None
        if event is not None:
            if not event.query():
                self.stats.staging_waits += 1
            event.synchronize()
        buffer = self.buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.buffers[i] = self.alloc(-(-nbytes // PAGE) * PAGE)
        return i, buffer

    def give(self, i: int, event) -> None:
        """Buffer `i` is being copied out of until `event`."""
        self.pending[i] = event


class _Copier:
    """Where copies and their ordering happen: through `ops` (CudaOps on CUDA, a fake in tests)
    with a side stream and events; with no ops (any other device) in line, nothing to order."""

    def __init__(
        self, device: torch.device, stats: DeviceCacheStats, ops=None, staging: int = STAGING_BUFFERS
    ):
        self.device = device
        self.ops = CudaOps(device) if ops is None and device.type == "cuda" else ops
        self.ring = StagingRing(staging, self.ops.locked, stats) if self.ops is not None else None
        self.stats = stats

    def copy(self, buffer: torch.Tensor, layout: ExtentLayout, raws: list[torch.Tensor], after) -> object:
        """The expert's tensors `raws` into `buffer` in `layout`, after event `after`; the event
        of the copies' end (None without ops)."""
        names = [t.name for t in layout.tensors]
        dst = [flat_view(buffer, layout, name) for name in names]
        if self.ops is None:
            for d, s in zip(dst, raws, strict=True):
                d.copy_(s)
            return None
        if all(self.ops.is_locked(s) for s in raws):
            return self.ops.copy(dst, raws, buffer, after)
        # pageable (the disk store's read buffers): into a page-locked buffer on the host, then
        # one asynchronous copy of it
        i, staging = self.ring.take(layout.length)
        for name, raw in zip(names, raws, strict=True):
            flat_view(staging, layout, name).copy_(raw)
        done = self.ops.copy([buffer], [staging[: layout.length]], buffer, after)
        self.ring.give(i, done)
        self.stats.staged += 1
        return done

    def wait(self, event) -> None:
        """The compute stream waits for `event` (the host does not)."""
        if event is not None:
            self.ops.wait(event)

    def mark(self):
        """An event after the compute issued so far (None without ops)."""
        return None if self.ops is None else self.ops.mark()


class HostExperts(LocalStore):
    """A layer's experts resident in host memory, in one flat buffer in their extent layout
    (`hold` makes it), page-locked in place when the device is CUDA."""

    def __init__(self, experts: list[Expert], buffer: torch.Tensor):
        self.experts = experts
        self.buffer = buffer  # keeps the experts' memory (and its page lock) alive
        self.num_experts = len(experts)

    def get(self, ids: Sequence[int], first: bool = True) -> Mapping[int, Expert]:
        return {e: self.experts[e] for e in ids}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def hold(store: LocalStore, pin: bool) -> HostExperts:
    """Every expert of `store` (a resident store on the CPU) copied into one flat host buffer, each
    in its extent layout at a page-aligned stride; `pin`: page-locked in place (cudaHostRegister:
    no rounding up, unlike torch's pinned allocator)."""
    experts = [store.get([e], first=False)[e] for e in range(store.num_experts)]
    layouts = [expert_layout(x) for x in experts]
    stride = max((-(-layout.length // PAGE) * PAGE for layout, _ in layouts), default=0)
    buffer = torch.empty(stride * len(experts), dtype=torch.uint8)
    held = []
    for e, (layout, raws) in enumerate(layouts):
        base = e * stride
        names = [t.name for t in layout.tensors]
        for name, raw in zip(names, raws, strict=True):
            flat_view(buffer, layout, name, base).copy_(raw)
        held.append(expert_from_views(layout, lambda n, b=base, lay=layout: flat_view(buffer, lay, n, b)))
    host = HostExperts(held, buffer)
    if pin:
        page_lock(host, buffer)
    return host


class DeviceCache:
    """The device slots of one model, shared by its MoE layers (the `ExpertFront` the loader puts
    in front of each layer's host store)."""

    host = torch.device("cpu")  # where the loader reads resident experts
    predicts = True  # prefetch hints are worth the router's second run: copies (or reads) start early

    def __init__(
        self,
        device: torch.device,
        slots: int,
        policy: str = "lru",
        prefetch_max: int | None = None,
        ops=None,
        staging: int = STAGING_BUFFERS,
    ):
        """`ops`: the copies' stream/event calls (default: CudaOps on CUDA, none elsewhere; tests
        pass a fake); `staging`: page-locked buffers for experts in pageable memory."""
        if slots < 1:
            raise ValueError(f"a device expert cache needs at least one slot, got {slots}")
        self.device = torch.device(device)
        self.slots = slots
        self.prefetch_max = slots if prefetch_max is None else prefetch_max
        self.cache = ExpertCache(slots, policy, on_evict=self._evicted)
        self.stats = DeviceCacheStats()
        self._copier = _Copier(self.device, self.stats, ops, staging)
        self._free: list[_Slot] = []  # evicted slots whose buffers the next copies reuse
        self._first_layer: int | None = None  # a pass starts at it (the least-stale clock)

    def over(self, layer: int, store: ExpertStore, resident: bool) -> DeviceExperts:
        """Layer `layer`'s store on the device, in front of `store` (host memory). `resident`: the
        loader read every expert into host memory (held here in one buffer; prefetch copies)."""
        if self._first_layer is None or layer < self._first_layer:
            self._first_layer = layer
        if resident:
            store = hold(store, pin=self.device.type == "cuda")
        return DeviceExperts(self, layer, store, resident)

    # --- a pass -----------------------------------------------------------------------------

    def begin(self, layer: int, ids: Sequence[int], first: bool) -> tuple[list[tuple[int, _Slot]], list[int]]:
        """Protect the pass's experts; (hits with their slots, the ids to copy in)."""
        if first and layer == self._first_layer:
            self.cache.next_step()
        keys = [(layer, e) for e in ids]
        self.cache.protect(keys)
        hits, misses = [], []
        for e, key in zip(ids, keys, strict=True):
            slot = self.cache.get(key)
            if slot is None:
                misses.append(e)
                continue
            if slot.prefetched:
                slot.prefetched = False
                self.stats.prefetched += 1
            hits.append((e, slot))
        s = self.stats
        s.asked += len(ids)
        s.hits += len(hits)
        s.misses += len(misses)
        return hits, misses

    def end(self, used: list[_Slot]) -> None:
        """The pass is issued: its slots may be reused once the compute issued so far is done."""
        done = self._copier.mark()
        for slot in used:
            slot.free_after = done
        self.cache.release()

    def fill(self, layer: int, e: int, expert: Expert, keep_only: bool = False) -> _Slot | None:
        """Copy host `expert` into a slot (evicting by policy), or into a buffer for this pass
        when none can be freed (None instead with `keep_only`)."""
        layout, raws = expert_layout(expert)
        slot = _Slot(layout)
        if not self.cache.put((layer, e), slot, 1):
            if keep_only:
                return None
            self.stats.not_kept += 1
        slot.buffer, after = self._buffer(layout)
        slot.ready = self._copier.copy(slot.buffer, layout, raws, after)
        self.stats.copies += 1
        self.stats.bytes_copied += layout.length
        return slot

    def expert(self, slot: _Slot) -> Expert:
        """The slot's expert, for compute issued from now on (which waits for its copy)."""
        self._copier.wait(slot.ready)
        if slot.expert is None:
            assert slot.buffer is not None
            buffer, layout = slot.buffer, slot.layout
            slot.expert = expert_from_views(layout, lambda name: flat_view(buffer, layout, name))
        return slot.expert

    def _buffer(self, layout: ExtentLayout) -> tuple[torch.Tensor, object]:
        """An evicted slot's buffer of this layout (with the event to copy after), or a new one."""
        for i, freed in enumerate(self._free):
            if freed.layout == layout:
                del self._free[i]
                assert freed.buffer is not None
                return freed.buffer, freed.free_after
        if self._free:
            self._free.pop(0)  # another layout's: let it go (its memory returns to the allocator)
        buffer = torch.empty(layout.length, dtype=torch.uint8, device=self.device)
        return buffer, self._copier.mark()  # written after the compute that last used this memory

    def _evicted(self, key, slot: _Slot) -> None:
        slot.expert = None
        self._free.append(slot)

    # --- reporting --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the device slots holding experts now."""
        return sum(slot.layout.length for _key, slot in self.cache.values())

    def layer_bytes(self, layer: int) -> int:
        return sum(slot.layout.length for key, slot in self.cache.values() if key[0] == layer)

    def snapshot(self) -> dict:
        """The counters, the slots and the bytes they hold."""
        return {**self.stats.as_dict(), "slots": self.slots, "cached": len(self.cache), "bytes": self.nbytes}


class DeviceExperts(LocalStore):
    """One MoE layer's experts on `cache.device`, copied in from `host` as passes ask for them
    (the `ExpertStore` contract; `stacked` and `packed` None: the MoE layer asks `run`).
    `resident`: the host store holds every expert (prefetch copies; misses are copied first)."""

    def __init__(self, cache: DeviceCache, layer: int, host: LocalStore, resident: bool):
        self.cache, self.layer, self.host, self.resident = cache, layer, host, resident
        self.num_experts = host.num_experts
        self.at_once = min(n for n in (cache.slots, host.at_once) if n)  # each of a chunk gets a slot

    def get(self, ids: Sequence[int], first: bool = True) -> Mapping[int, Expert]:
        return dict(self.arrivals(ids, first))

    def arrivals(self, ids: Sequence[int], first: bool = True) -> Iterator[tuple[int, Expert]]:
        hits, misses = self.cache.begin(self.layer, ids, first)
        return self._arrive(hits, misses, first)

    def _arrive(
        self, hits: list[tuple[int, _Slot]], misses: list[int], first: bool
    ) -> Iterator[tuple[int, Expert]]:
        cache = self.cache
        used = [slot for _e, slot in hits]
        try:
            copied = self._copy_in(misses, first) if self.resident else None
            for e, slot in hits:
                yield e, cache.expert(slot)
            if copied is None:  # from disk: the hits computed while the reads run
                copied = self._copy_in(misses, first)
            used += [slot for _e, slot in copied]
            for e, slot in copied:
                yield e, cache.expert(slot)
        finally:
            cache.end(used)

    def _copy_in(self, misses: list[int], first: bool) -> list[tuple[int, _Slot]]:
        """Every miss copied into a slot (issued, not waited for), as the host store hands it."""
        arriving = self.host.arrivals(misses, first)  # asked even when empty: a streamed store counts passes
        try:
            out = []
            for e, expert in arriving:
                slot = self.cache.fill(self.layer, e, expert)
                assert slot is not None
                out.append((e, slot))
            return out
        finally:
            close = getattr(arriving, "close", None)
            if close is not None:
                close()

    def prefetch(self, ids: Sequence[int]) -> None:
        wanted = [e for e in dict.fromkeys(ids) if (self.layer, e) not in self.cache.cache]
        if not wanted:
            return
        if not self.resident:
            self.host.prefetch(wanted)  # the reads start; the copies wait for the pass
            return
        for e, expert in self.host.get(wanted[: self.cache.prefetch_max], first=False).items():
            slot = self.cache.fill(self.layer, e, expert, keep_only=True)
            if slot is None:
                break
            slot.prefetched = True
            self.cache.stats.prefetch_copies += 1

    @property
    def nbytes(self) -> int:
        return self.cache.layer_bytes(self.layer)
