"""Copies from pageable memory through the device cache's staging ring (experts/device_cache.py).

On the CPU a fake stands in for `CudaOps`: it queues every copy and runs it only when an event
after it is synchronized (as a CUDA stream would, at the latest moment), and hands out plain
host tensors as the "page-locked" buffers. A staging buffer refilled before the copy out of it
has run then leaves another expert's bytes in the slot, and the MoE output is wrong: the
controls below show the tests catch it. The CUDA path itself is checked only where torch has CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.experts.test_device_cache import CPU, FP, LAYER, Resident, _router_on, _shared_on

from latentkv.experts.device_cache import DeviceCache, DeviceCacheStats, StagingRing
from latentkv.models.moe import MoE
from latentkv.streaming.convert import write_store


class Deferred:
    """A stream on the CPU: copies run in order, only when an event after them is synchronized."""

    def __init__(self):
        self.queue: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self.ran = 0  # copies run so far
        self.allocs: list[int] = []  # sizes of the "page-locked" buffers made
        self.synced: list[int] = []  # events synchronized from the host, in order (their copy count)

    def copy(self, dst, src, buffer, after):
        self.queue.append((dst, src))
        return Event(self, len(self.queue))

    def run_to(self, n: int) -> None:
        while self.ran < n:
            for d, s in zip(*self.queue[self.ran], strict=True):
                d.copy_(s)
            self.ran += 1

    def wait(self, event) -> None:  # compute is synchronous here: it needs the copy done now
        self.run_to(event.upto)

    def mark(self):
        return None  # compute already ran: nothing to order a copy after

    def locked(self, nbytes: int) -> torch.Tensor:
        self.allocs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def is_locked(t: torch.Tensor) -> bool:
        return False  # every host tensor here is pageable: every copy is staged


class Event:
    def __init__(self, ops: Deferred, upto: int):
        self.ops, self.upto = ops, upto

    def query(self) -> bool:
        return self.ops.ran >= self.upto

    def synchronize(self) -> None:
        self.ops.synced.append(self.upto)
        self.ops.run_to(self.upto)


def test_the_ring_hands_a_buffer_out_again_only_after_its_copy():
    """Two buffers, five copies, none run until the ring must wait: buffers are made once, used in
    turn, and each is taken again only after the event of its last copy (the third take waits for
    the first copy, the fourth for the second, ...)."""
    ops, stats = Deferred(), DeviceCacheStats()
    ring = StagingRing(2, ops.locked, stats)
    dst = torch.zeros(5, 100, dtype=torch.uint8)
    used = []
    for n in range(5):
        i, buf = ring.take(100)
        if n >= 2:
            assert ops.ran >= n - 1, "a staging buffer refilled before the copy out of it ran"
        buf[:100].fill_(n + 1)
        ring.give(i, ops.copy([dst[n]], [buf[:100]], None, None))
        used.append(buf.data_ptr())
    assert ops.allocs == [4096, 4096]  # made once each, rounded up to a page
    assert used == [used[0], used[1]] * 2 + [used[0]]
    assert ops.synced == [1, 2, 3] and stats.staging_waits == 3
    ops.run_to(5)
    assert [int(row[0]) for row in dst] == [1, 2, 3, 4, 5]  # every copy saw its own bytes


def test_the_ring_waits_only_for_copies_still_running():
    ops, stats = Deferred(), DeviceCacheStats()
    ring = StagingRing(1, ops.locked, stats)
    i, buf = ring.take(10)
    ring.give(i, ops.copy([torch.empty(10, dtype=torch.uint8)], [buf[:10]], None, None))
    ops.run_to(1)  # the copy finished on its own
    ring.take(10)
    assert stats.staging_waits == 0 and ops.synced == [1]  # synchronized (free), not counted as a wait


def test_a_larger_expert_remakes_the_buffer_it_is_given():
    ops = Deferred()
    ring = StagingRing(2, ops.locked, DeviceCacheStats())
    ring.take(100)
    ring.take(100)
    _, buf = ring.take(5000)
    assert buf.numel() == 8192 and ops.allocs == [4096, 4096, 8192]
    with pytest.raises(ValueError, match="at least one buffer"):
        StagingRing(0, ops.locked, DeviceCacheStats())


def _streamer(experts, tmp_path):
    """The experts in a disk store, streamed through a host cache of two (pageable read buffers)."""
    from latentkv.experts.streamed import ExpertStreamer, StreamConfig

    d = tmp_path / "experts"
    write_store(d, FP, [(LAYER, len(experts), lambda e: experts[e])])
    stride = max(x.nbytes for x in experts.values()) + 8192
    return ExpertStreamer(d, FP, StreamConfig(budget=2 * stride, history=False))


def _through(kind: str, experts, slots: int, staging: int, tmp_path, ops):
    cache = DeviceCache(CPU, slots, prefetch_max=3, ops=ops, staging=staging)
    if kind == "resident":
        return cache, cache.over(LAYER, Resident(experts), resident=True), None
    streamer = _streamer(experts, tmp_path)
    return cache, cache.over(LAYER, streamer.layer(LAYER, at_once=3), resident=False), streamer


def _passes(layer, kind: str, slots: int, staging: int, tmp_path, ops) -> tuple[bool, DeviceCache]:
    """12 random ragged passes through the cache (staged copies): all equal to the resident store?"""
    router, shared, experts = layer
    want_layer = MoE(router, Resident(experts), shared)
    cache, store, streamer = _through(kind, experts, slots, staging, tmp_path, ops)
    got_layer = MoE(router, store, shared)
    rng = random.Random(slots * 7 + staging)
    g = torch.Generator().manual_seed(staging)
    same = True
    try:
        for step in range(12):
            rows = rng.choice([1, 2, 3, 7, 19])
            x = torch.randn(rows, experts[0].gate_up.in_features, generator=g) * (1 + step % 3)
            if kind == "resident" and step % 2:
                store.prefetch(rng.sample(range(len(experts)), 3))
            same &= torch.equal(got_layer(x), want_layer(x))
    finally:
        if streamer is not None:
            streamer.close()
    return same, cache


@pytest.mark.parametrize("kind", ["streamed", "resident"])
@pytest.mark.parametrize(("slots", "staging"), [(3, 1), (8, 2), (2, 4)])
def test_staged_copies_give_the_resident_output(layer, tmp_path, kind, slots, staging):
    """Passes of up to 4 misses through 1, 2 or 4 staging buffers, every copy deferred to the
    moment its expert is computed: bit-identical to the resident store."""
    ops = Deferred()
    same, cache = _passes(layer, kind, slots, staging, tmp_path, ops)
    assert same
    s = cache.stats
    assert s.staged == s.copies == len(ops.queue) > 0
    assert len(ops.allocs) <= staging  # the ring's buffers are made once
    if staging == 1:
        assert s.staging_waits > 0  # a pass had more misses than buffers: the host waited


def test_the_check_fails_when_the_ring_refills_a_buffer_early(layer, tmp_path, monkeypatch):
    """Control: a ring that does not wait for a buffer's last copy lets the next expert's bytes
    reach the slot of the previous one: the output is wrong."""

    def take_without_waiting(self, nbytes):
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.buffers[i] is None:
            self.buffers[i] = self.alloc(nbytes)
        return i, self.buffers[i]

    monkeypatch.setattr(StagingRing, "take", take_without_waiting)
    same, _cache = _passes(layer, "streamed", 3, 1, tmp_path, Deferred())
    assert not same


def test_the_cpu_path_stages_nothing(layer):
    """Without ops (any device but CUDA) copies run in line, as before: no ring, no staging."""
    _router, _shared, experts = layer
    cache = DeviceCache(CPU, 2)
    assert cache._copier.ring is None
    store = cache.over(LAYER, Resident(experts), resident=True)
    x = torch.randn(3, experts[0].gate_up.in_features)
    MoE(layer[0], store, layer[1])(x)
    assert cache.stats.copies > 0 and cache.stats.staged == 0


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch has no CUDA here: page-locked staging buffers, the copy stream and its events "
    "need a CUDA device",
)
def test_on_cuda_experts_from_disk_are_staged_through_page_locked_buffers(layer, tmp_path):
    router, shared, experts = layer
    cuda = torch.device("cuda")
    streamer = _streamer(experts, tmp_path)
    cache = DeviceCache(cuda, 3, prefetch_max=2, staging=2)
    store = cache.over(LAYER, streamer.layer(LAYER, at_once=3), resident=False)
    try:
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            x = torch.randn(5, experts[0].gate_up.in_features, generator=g)
            want = MoE(router, Resident(experts), shared)(x)
            got = MoE(_router_on(router, cuda), store, _shared_on(shared, cuda))(x.to(cuda))
            assert torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-5)
    finally:
        streamer.close()
    ring = cache._copier.ring
    assert cache.stats.staged == cache.stats.copies > 0
    assert all(b is None or b.is_pinned() for b in ring.buffers)
