"""The device expert cache (experts/device_cache.py) on the CPU: a MoE layer served through its
slots, in front of resident host experts or of the streamed disk store, gives the resident
store's output bit for bit (fresh random routings, ragged batches, fewer slots than a pass's
experts, prefetch on and off); the slots never exceed their number nor share a buffer; an
expert of a pass is never evicted while the pass needs it (and the check can fail). The CUDA
paths (page-locked host buffer, copy stream, events) run only where torch has CUDA."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from latentkv.experts.base import Expert, Job, LocalStore
from latentkv.experts.cache import ExpertCache
from latentkv.experts.device_cache import DeviceCache, HostExperts
from latentkv.experts.extent import CODECS, expert_layout
from latentkv.experts.streamed import ExpertStreamer, StreamConfig
from latentkv.models.moe import MoE
from latentkv.streaming.convert import write_store
from latentkv.weights.base import make_linear

CPU = torch.device("cpu")
LAYER = 1
FP = "f" * 64


class Resident(LocalStore):
    """The reference: every expert resident, asked through the store contract (no stacked fast
    path, so the MoE layer takes the same `run` path as with the device cache)."""

    def __init__(self, experts: dict[int, Expert]):
        self._experts, self.num_experts = experts, len(experts)

    def get(self, ids, first=True):
        return {e: self._experts[e] for e in ids}


def _front(kind: str, experts, slots: int, tmp_path, policy: str = "lru"):
    """(the device cache, the layer's store behind it, what to close)."""
    cache = DeviceCache(CPU, slots, policy, prefetch_max=3)
    if kind == "resident":
        return cache, cache.over(LAYER, Resident(experts), resident=True), None
    d = tmp_path / "experts"
    write_store(d, FP, [(LAYER, len(experts), lambda e: experts[e])])
    stride = max(x.nbytes for x in experts.values()) + 8192
    streamer = ExpertStreamer(d, FP, StreamConfig(budget=2 * stride, history=False))
    return cache, cache.over(LAYER, streamer.layer(LAYER, at_once=3), resident=False), streamer


def _check_slots(cache: DeviceCache) -> None:
    slots = [slot for _key, slot in cache.cache.values()]
    assert len(slots) + len(cache._free) <= cache.slots
    pointers = [s.buffer.data_ptr() for s in slots]
    assert len(set(pointers)) == len(pointers), "two cached experts share one slot"


@pytest.mark.parametrize("kind", ["resident", "streamed"])
@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_layer_through_the_device_cache_is_bit_identical(layer, tmp_path, kind, slots, prefetch):
    router, shared, experts = layer
    want_layer = MoE(router, Resident(experts), shared)
    cache, store, streamer = _front(kind, experts, slots, tmp_path)
    got_layer = MoE(router, store, shared)
    rng = random.Random(slots * 10 + prefetch)
    g = torch.Generator().manual_seed(slots)
    try:
        for step in range(12):
            rows = rng.choice([1, 1, 2, 3, 7, 19])  # a token, small batches, a prompt
            decode = rows > 1 and rng.random() < 0.5
            x = torch.randn(rows, experts[0].gate_up.in_features, generator=g) * (1 + step % 3)
            residual = torch.randn_like(x)
            if prefetch:  # a prediction, partly wrong, as the previous layer's lookahead makes
                store.prefetch(rng.sample(range(len(experts)), 4))
            want = want_layer(x, residual=residual, decode=decode)
            got = got_layer(x, residual=residual, decode=decode)
            assert torch.equal(got, want), f"step {step}: {rows} rows"
            _check_slots(cache)
    finally:
        if streamer is not None:
            streamer.close()
    s = cache.stats
    assert s.asked == s.hits + s.misses > 0
    assert s.copies == s.misses + s.prefetch_copies
    extent = cache.cache.values()[0][1].layout.length
    assert s.bytes_copied == s.copies * extent
    if slots == 8 and not prefetch:
        assert s.misses == len(cache.cache)  # every expert copied once (none evicted), then hits
    if kind == "streamed" and prefetch:
        assert s.prefetch_copies == 0  # from disk the hint goes to the reads, not the copies
    if kind == "resident" and prefetch:
        assert s.prefetch_copies > 0 and s.prefetched > 0


def _asked(cache: DeviceCache) -> set[int]:
    return {e for (_layer, e) in cache.cache.cached_keys()}


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_every_format_with_an_extent_codec_computes_as_on_the_host(fmt):
    g = torch.Generator().manual_seed(3)
    D, I = 64, 32
    experts = {
        e: Expert(
            make_linear(torch.randn(2 * I, D, generator=g), fmt),
            make_linear(torch.randn(D, I, generator=g), fmt),
        )
        for e in range(5)
    }
    cache = DeviceCache(CPU, 2)
    store = cache.over(LAYER, Resident(experts), resident=True)
    assert isinstance(store.host, HostExperts)
    x = torch.randn(6, D, generator=g)
    jobs = [Job(e, torch.tensor([e, (e + 2) % 6])) for e in (4, 0, 3, 1)]
    got = dict(store.run(x, jobs))
    for j in jobs:
        assert torch.equal(got[j.expert], j.apply(experts[j.expert], x)), fmt
    assert store.at_once == 2 and len(cache.cache) == 2
    # no second copy: the experts computed on are views of the slots, and of the held host buffer
    for _key, slot in cache.cache.values():
        assert _inside(slot.expert, slot.buffer), fmt
    assert all(_inside(x, store.host.buffer) for x in store.host.experts), fmt


def _inside(expert: Expert, buffer: torch.Tensor) -> bool:
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    _layout, raws = expert_layout(expert)
    return all(start <= t.data_ptr() < end for t in raws if t.numel())


def _warm_then_pass(policy: str, experts, x) -> tuple[torch.Tensor, dict]:
    """Slots 3; experts 5, 6, 7 asked often (high counts), then one pass of misses 0, 1, 2: under
    LFU the newest (count 1) is the first victim, so only the pass's protection keeps a miss
    from being evicted by the next one."""
    cache = DeviceCache(CPU, 3, policy)
    store = cache.over(LAYER, Resident(experts), resident=True)
    for _ in range(4):
        dict(store.run(x, [Job(e, None) for e in (5, 6, 7)]))
    return dict(store.run(x, [Job(e, None) for e in (0, 1, 2)])), cache


@pytest.mark.parametrize("policy", ["lru", "lfu", "least-stale"])
def test_an_expert_is_never_evicted_while_its_pass_needs_it(layer, policy):
    _router, _shared, experts = layer
    x = torch.randn(2, experts[0].gate_up.in_features, generator=torch.Generator().manual_seed(7))
    got, cache = _warm_then_pass(policy, experts, x)
    for e in (0, 1, 2):
        assert torch.equal(got[e], experts[e](x))
    assert _asked(cache) == {0, 1, 2}
    _check_slots(cache)


def test_the_check_can_fail_without_the_pass_protection(layer, monkeypatch):
    """Control: with protection gone, LFU evicts the pass's first miss for its second, whose copy
    overwrites the first's slot before it is computed: the first expert's output is wrong."""
    _router, _shared, experts = layer
    monkeypatch.setattr(ExpertCache, "protect", lambda self, keys: None)
    x = torch.randn(2, experts[0].gate_up.in_features, generator=torch.Generator().manual_seed(7))
    got, _cache = _warm_then_pass("lfu", experts, x)
    assert not all(torch.equal(got[e], experts[e](x)) for e in (0, 1, 2))


def test_an_abandoned_pass_releases_its_slots(layer):
    _router, _shared, experts = layer
    cache = DeviceCache(CPU, 2)
    store = cache.over(LAYER, Resident(experts), resident=True)
    x = torch.randn(1, experts[0].gate_up.in_features)
    results = store.run(x, [Job(e, None) for e in (0, 1)])
    next(results)
    results.close()
    assert not cache.cache._protected
    assert sorted(dict(store.run(x, [Job(e, None) for e in (2, 3)]))) == [2, 3]
    assert _asked(cache) == {2, 3}


def test_a_device_cache_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        DeviceCache(CPU, 0)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch has no CUDA here: the page-locked host "
    "buffer, the copy stream and its events need a CUDA device",
)
def test_on_cuda_host_experts_are_page_locked_and_copies_ordered_by_events(layer):
    router, shared, experts = layer
    cuda = torch.device("cuda")
    cache = DeviceCache(cuda, 3, prefetch_max=2)
    store = cache.over(LAYER, Resident(experts), resident=True)
    assert store.host.buffer.is_pinned()
    x = torch.randn(5, experts[0].gate_up.in_features)
    want = MoE(router, Resident(experts), shared)(x)
    store.prefetch([0, 1])
    got = MoE(_router_on(router, cuda), store, _shared_on(shared, cuda))(x.to(cuda))
    assert torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-5)
    slot = cache.cache.values()[0][1]
    assert slot.buffer.is_cuda and slot.ready is not None and slot.free_after is not None


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch has no CUDA here: converting int4 codes to the CUDA op's layout in a slot needs a CUDA device",
)
def test_on_cuda_int4_experts_are_converted_in_their_slots():
    """int4 experts copied as the host holds them (its CPU layout) are rewritten in the slot in the
    CUDA op's layout: the same weight read back, products within the int4 op's tolerance, and the
    codes still a view of the slot (one copy on the device)."""
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    D, I = 256, 128
    experts = {
        e: Expert(
            make_linear(torch.randn(2 * I, D, generator=g), "int4"),
            make_linear(torch.randn(D, I, generator=g), "int4"),
        )
        for e in range(4)
    }
    cache = DeviceCache(cuda, 2)
    store = cache.over(LAYER, Resident(experts), resident=True)
    x = torch.randn(3, D, generator=g)
    jobs = [Job(e, None) for e in (3, 0, 2)]
    got = dict(store.run(x.to(cuda), jobs))
    for e, y in got.items():
        want = experts[e](x).double()
        assert float((y.double().cpu() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    for _key, slot in cache.cache.values():
        lin = slot.expert.gate_up
        assert lin.packed.is_cuda and lin.packed.dtype == torch.int32
        start = slot.buffer.data_ptr()
        assert start <= lin.packed.data_ptr() < start + slot.buffer.numel()
    (_layer, e), slot = cache.cache.values()[0]
    assert torch.equal(slot.expert.down.dequantize().cpu(), experts[e].down.dequantize())


def _router_on(router, device):
    from latentkv.models.moe import Router, RouterWeights

    moved = copy.copy(router)
    w = router.w
    moved.w = RouterWeights(make_linear(w.weight.dense.to(device), "f32"), w.bias.to(device))
    assert isinstance(moved, Router)
    return moved


def _shared_on(shared, device):
    if shared is None:
        return None
    return Expert(
        make_linear(shared.gate_up.dense.to(device), "f32"), make_linear(shared.down.dense.to(device), "f32")
    )
