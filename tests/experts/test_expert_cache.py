"""The expert cache: the byte budget is never exceeded, pins and protection hold, and each policy
evicts in its stated order (checked against a direct model of that order)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from latentkv.experts.cache import POLICIES, ExpertCache, make_policy
from latentkv.experts.history import UsageHistory


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    budget=st.integers(0, 50),
    ops=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 12), st.booleans(), st.booleans()), max_size=60),
)
def test_the_budget_is_never_exceeded_and_pins_stay(policy, budget, ops):
    cache = ExpertCache(budget, policy)
    pinned = set()
    for key, nbytes, pin, step in ops:
        if cache.get(key) is None:
            kept = cache.put(key, f"v{key}", nbytes, pin=pin and not pinned)
            if kept and pin and not pinned:
                pinned.add(key)
        assert cache.resident_bytes <= budget
        assert cache.resident_bytes == sum(n for _v, n in cache._items.values())
        assert pinned <= set(cache.cached_keys())
        if step:
            cache.next_step()
    assert cache.stats.hits + cache.stats.misses == len(ops)


def test_lru_evicts_the_least_recently_used():
    c = ExpertCache(3, "lru")
    for k in "abc":
        c.put(k, k, 1)
    c.get("a")
    c.put("d", "d", 1)
    assert sorted(c.cached_keys()) == ["a", "c", "d"]


def test_lfu_evicts_the_least_frequently_used_ties_by_recency():
    c = ExpertCache(3, "lfu")
    for k in "abc":
        c.put(k, k, 1)
    for k in "aab":
        c.get(k)
    c.put("d", "d", 1)  # c used once (at insert), least
    assert sorted(c.cached_keys()) == ["a", "b", "d"]
    c.put("e", "e", 1)  # d (count 1) goes before b (2) and a (3)
    assert sorted(c.cached_keys()) == ["a", "b", "e"]


def test_least_stale_evicts_by_step_not_by_access_order():
    c = ExpertCache(3, "least-stale")
    c.put("a", "a", 1)
    c.put("b", "b", 1)
    c.get("a")
    c.get("a")
    c.next_step()
    c.put("c", "c", 1)
    c.get("b")  # b used at step 1: a (step 0) is now the stalest despite its count
    c.put("d", "d", 1)
    assert sorted(c.cached_keys()) == ["b", "c", "d"]


def test_protected_experts_are_not_evicted_and_oversized_ones_are_not_kept():
    c = ExpertCache(2, "lru")
    c.put("a", "a", 1)
    c.put("b", "b", 1)
    c.protect(["a", "b"])
    assert not c.put("c", "c", 1) and c.stats.not_kept == 1
    c.release()
    assert c.put("c", "c", 1) and "a" not in c
    assert not c.put("big", "x", 3)


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="lru, lfu, least-stale"):
        make_policy("fifo")


def test_usage_history_round_trip_and_hot_set(tmp_path):
    path = tmp_path / "usage.json"
    h = UsageHistory("fp", {1: 4, 2: 4})
    h.record(1, [0, 2])
    h.record(1, [2])
    h.record(2, [3])
    h.tokens = 3
    h.save(path)
    back, note = UsageHistory.load(path, "fp", {1: 4, 2: 4})
    assert note is None and back.counts == {1: [1, 0, 2, 0], 2: [0, 0, 0, 1]} and back.tokens == 3
    assert back.hot_set(2 * 10, {1: 10, 2: 10}) == [(1, 2), (1, 0)]
    assert back.hot_set(100, {1: 10, 2: 10}) == [(1, 2), (1, 0), (2, 3)]
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda d: d["usage"]["layers"]["1"].__setitem__(0, 99), "checksum"),
        (lambda d: d.__setitem__("usage", {**d["usage"], "fingerprint": "other"}), "checksum"),
    ],
)
def test_a_damaged_history_is_ignored_with_a_note(tmp_path, damage, why):
    path = tmp_path / "usage.json"
    h = UsageHistory("fp", {1: 4})
    h.record(1, [1])
    h.save(path)
    d = json.loads(path.read_text())
    damage(d)
    path.write_text(json.dumps(d))
    back, note = UsageHistory.load(path, "fp", {1: 4})
    assert why in note and back.counts == {1: [0, 0, 0, 0]}


def test_a_history_of_another_model_or_shape_is_ignored(tmp_path):
    path = tmp_path / "usage.json"
    UsageHistory("fp", {1: 4}).save(path)
    assert "another model" in UsageHistory.load(path, "other", {1: 4})[1]
    assert "expert counts differ" in UsageHistory.load(path, "fp", {1: 8})[1]
    path.write_text("{garbage")
    assert "unreadable" in UsageHistory.load(path, "fp", {1: 4})[1]
    assert UsageHistory.load(tmp_path / "none.json", "fp", {1: 4})[1] is None


def test_on_evict_hears_each_eviction_and_values_peeks_without_touching_the_order():
    evicted = []
    c = ExpertCache(2, "lru", on_evict=lambda key, value: evicted.append((key, value)))
    c.put("a", 1, 1)
    c.put("b", 2, 1)
    assert c.values() == [("a", 1), ("b", 2)]  # a stays least recent: values() is not a use
    c.put("c", 3, 1)
    assert evicted == [("a", 1)] and "a" not in c
