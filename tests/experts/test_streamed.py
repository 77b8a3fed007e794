"""The streamed expert store: experts come back exactly as written (every format that streams),
the budget holds from one expert up, prefetch is collected and counted, the hot set is pinned,
and a damaged expert stops the pass with its name."""

from __future__ import annotations

import os

import pytest
import torch

from latentkv.experts.base import Expert
from latentkv.experts.extent import CODECS
from latentkv.experts.store_file import ExpertDamaged, read_manifest
from latentkv.experts.streamed import ExpertStreamer, StreamConfig
from latentkv.streaming.convert import write_store
from latentkv.weights.base import make_linear

D, I, E = 64, 32, 6  # int8 needs in_features % 32 == 0 (see the report on i15)
LAYERS = (1, 2)
FP = "f" * 64


def _experts(fmt: str, seed: int = 0) -> dict[tuple[int, int], Expert]:
    g = torch.Generator().manual_seed(seed)
    return {
        (layer, e): Expert(
            make_linear(torch.randn(2 * I, D, generator=g), fmt),
            make_linear(torch.randn(D, I, generator=g), fmt),
        )
        for layer in LAYERS
        for e in range(E)
    }


def _store(tmp_path, fmt: str = "f32") -> tuple[os.PathLike, dict]:
    truth = _experts(fmt)
    d = tmp_path / "experts"
    write_store(d, FP, [(layer, E, lambda e, layer=layer: truth[layer, e]) for layer in LAYERS])
    return d, truth


def _streamer(d, budget_experts: float, **kw) -> ExpertStreamer:
    stride = read_manifest(d).layers[LAYERS[0]].layout.stride
    return ExpertStreamer(d, FP, StreamConfig(budget=int(budget_experts * stride), **kw))


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_streamed_experts_compute_exactly_as_the_written_ones(tmp_path, fmt):
    d, truth = _store(tmp_path, fmt)
    s = _streamer(d, 2)
    x = torch.randn(3, D)
    for layer in LAYERS:
        got = s.layer(layer).get(list(range(E)))
        for e in range(E):
            want = truth[layer, e]
            assert got[e].gate_up.format == want.gate_up.format == fmt
            assert torch.equal(got[e].gate_up.dequantize(), want.gate_up.dequantize())
            assert torch.equal(got[e].down.dequantize(), want.down.dequantize())
            assert torch.equal(got[e](x), want(x))
    s.close()


@pytest.mark.parametrize("budget_experts", [0, 1, 2.5, 12])
def test_the_budget_holds_and_hits_follow_it(tmp_path, budget_experts):
    d, truth = _store(tmp_path)
    s = _streamer(d, budget_experts, history=False)
    stride = s.expert_bytes[1]
    ids = [0, 3, 5]
    for _ in range(3):
        for layer in LAYERS:
            got = s.layer(layer).get(ids)
            assert sorted(got) == ids
            assert s.cache.resident_bytes <= s.config.budget
    t = s.snapshot()
    assert t["asked"] == 3 * len(LAYERS) * len(ids) == t["hits"] + t["misses"]
    if budget_experts >= 6:
        assert t["misses"] == 6 and t["bytes_read"] == 6 * stride  # read once, then all hits
    if budget_experts == 0:
        assert t["hits"] == 0 and t["resident_bytes"] == 0
    assert t["passes"] == 3
    s.close()


def test_prefetched_reads_are_collected_and_recall_counted(tmp_path):
    d, truth = _store(tmp_path)
    s = _streamer(d, 0, history=False)
    s.layer(2).prefetch([1, 2, 4])
    for future in list(s._inflight.values()):
        future.result()  # arrived before the pass asks
    got = s.layer(2).get([2, 4, 5])
    assert torch.equal(got[2].down.dequantize(), truth[2, 2].down.dequantize())
    t = s.telemetry
    assert (t.prefetched, t.misses, t.wasted_prefetch) == (2, 1, 1)
    assert (t.recalled, t.predicted) == (2, 3) and t.recall == pytest.approx(2 / 3)
    s.close()


def test_a_pass_reads_before_predictions_and_takes_over_unstarted_ones(tmp_path):
    """Predicted reads queue behind the reads a pass waits for; a predicted expert whose read
    has not started when the pass asks is read at once (a miss), and unused predictions that
    never started are never read."""
    import threading
    import time

    d, _ = _store(tmp_path)
    s = _streamer(d, 0, history=False, threads=1)
    gate, busy = threading.Event(), threading.Event()
    s.reader._pool.submit(0, lambda: busy.set() or gate.wait(10))  # occupies the one reader
    assert busy.wait(10)
    order, read = [], s.reader.read
    s.reader.read = lambda layer, e: order.append((layer, e)) or read(layer, e)
    s.layer(2).prefetch([1, 2, 4])  # queued, none started
    done = threading.Thread(target=lambda: s.layer(2).get([4, 5]))
    done.start()
    deadline = time.monotonic() + 10
    while s.telemetry.misses < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    done.join(10)
    assert order == [(2, 4), (2, 5)]
    t = s.telemetry
    assert (t.prefetched, t.misses, t.wasted_prefetch) == (0, 2, 0)  # 1 and 2 were never read
    s.close()


def test_a_second_prediction_replaces_the_first_ones_unstarted_reads(tmp_path):
    import threading

    d, _ = _store(tmp_path)
    s = _streamer(d, 0, history=False, threads=1)
    gate, busy = threading.Event(), threading.Event()
    s.reader._pool.submit(0, lambda: busy.set() or gate.wait(10))
    assert busy.wait(10)
    s.layer(2).prefetch([0, 1])
    s.layer(2).prefetch([1, 3])  # a later, better guess: 0's read has not started
    assert sorted(k[1] for k in s._inflight) == [1, 3]
    gate.set()
    for future in list(s._inflight.values()):
        future.result(10)
    s.layer(2).get([1, 3])
    t = s.telemetry
    assert (t.prefetched, t.misses, t.wasted_prefetch) == (2, 0, 0)
    assert (t.predicted, t.recalled) == (2, 2)  # recall over the union {0, 1, 3}
    s.close()


def test_the_priority_pool_runs_lower_numbers_first_and_skips_cancelled():
    import threading

    from latentkv.experts.pools import PriorityPool

    pool = PriorityPool(1, "test")
    gate, busy, ran = threading.Event(), threading.Event(), []
    pool.submit(0, lambda: busy.set() or gate.wait(10))
    assert busy.wait(10)
    futures = [pool.submit(p, ran.append, name) for p, name in ((1, "a"), (1, "b"), (0, "c"), (1, "d"))]
    assert futures[1].cancel()
    gate.set()
    pool.shutdown(wait=True)
    assert ran == ["c", "a", "d"]
    failing = PriorityPool(1, "test")
    with pytest.raises(ZeroDivisionError):
        failing.submit(0, lambda: 1 / 0).result(10)
    failing.shutdown()


def test_prefetch_stays_within_its_bytes(tmp_path):
    d, _ = _store(tmp_path)
    stride = read_manifest(d).layers[1].layout.stride
    s = ExpertStreamer(d, FP, StreamConfig(budget=0, prefetch_bytes=2 * stride, history=False))
    s.layer(1).prefetch(list(range(E)))
    assert s.telemetry.prefetch_reads == 2 and s._inflight_bytes == 2 * stride
    s.close()


def test_the_usage_history_pins_the_hot_set_across_runs(tmp_path):
    d, _ = _store(tmp_path)
    s = _streamer(d, 4)
    for _ in range(5):
        s.layer(1).get([4])
        s.layer(2).get([0, 1])
    s.layer(1).get([3])
    s.close()  # saves the history
    s2 = _streamer(d, 4, pin_fraction=0.5)  # 2 experts pinned: the two used most (ties: lower layer)
    assert s2.pin_hot_set() == [(1, 4), (2, 0)]
    for _ in range(3):
        s2.layer(1).get([0, 1, 2, 3, 5])  # churn: the pins stay
    assert (1, 4) in s2.cache and (2, 0) in s2.cache
    assert s2.cache.resident_bytes <= s2.config.budget
    s2.close()


def test_a_damaged_expert_stops_the_pass_with_its_name(tmp_path):
    d, _ = _store(tmp_path)
    entry = read_manifest(d).layers[2]
    path = d / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset(3) + 100] ^= 0x10
    path.write_bytes(bytes(data))
    s = _streamer(d, 2, history=False)
    assert sorted(s.layer(2).get([1, 2])) == [1, 2]
    with pytest.raises(ExpertDamaged, match=r"model\.layers\.2\.mlp\.experts\.3"):
        s.layer(2).get([1, 3])
    assert (2, 3) not in s.cache
    s.close()


def test_arrivals_hand_over_hits_first_then_reads_and_cache_like_get(tmp_path):
    d, truth = _store(tmp_path)
    a = _streamer(d, 3, history=False)
    b = _streamer(d, 3, history=False)
    a.layer(1).get([0, 1])
    b.layer(1).get([0, 1])
    got = list(a.layer(1).arrivals([4, 1, 5]))
    assert got[0][0] == 1 and sorted(e for e, _ in got[1:]) == [4, 5]  # the hit first
    for e, expert in got:
        assert torch.equal(expert.down.dequantize(), truth[1, e].down.dequantize())
    b.layer(1).get([4, 1, 5])
    assert sorted(a.cache.cached_keys()) == sorted(b.cache.cached_keys())  # same cache as get
    assert a.telemetry.misses == b.telemetry.misses == 4
    a.close()
    b.close()


def test_an_abandoned_arrivals_iterator_releases_the_pass(tmp_path):
    d, _ = _store(tmp_path)
    s = _streamer(d, 1, history=False)
    it = s.layer(1).arrivals([0, 1, 2])
    next(it)
    it.close()
    s.layer(1).get([3])  # the budget holds one expert: nothing of the closed pass is pinned
    assert [k for k in s.cache.cached_keys()] == [(1, 3)]
    s.close()


def test_a_layer_whose_predictions_miss_stops_being_read_ahead_and_resumes(tmp_path):
    from latentkv.experts.streamed import PREFETCH_MIN_RECALL

    d, _ = _store(tmp_path)
    s = _streamer(d, 0, history=False)
    passes = 0
    while s._recall.get(2, 1.0) >= PREFETCH_MIN_RECALL:  # predictions that never come true
        s.layer(2).prefetch([0, 1])
        s.layer(2).get([4, 5])
        passes += 1
        assert passes < 20
    reads = s.telemetry.prefetch_reads
    s.layer(2).prefetch([0, 1])
    assert s.telemetry.prefetch_reads == reads and s.telemetry.unread_predictions == 2
    s.layer(2).get([0, 1])  # still measured while paused: they come true again ...
    while s._recall[2] < PREFETCH_MIN_RECALL:
        s.layer(2).prefetch([0, 1])
        s.layer(2).get([0, 1])
    s.layer(2).prefetch([2, 3])  # ... and reading ahead resumes
    assert s.telemetry.prefetch_reads == reads + 2
    s.close()
