"""A byte-budgeted cache of decoded-ready experts, with a pluggable eviction policy (no torch).

Keys are (layer, expert); values are whatever the store keeps (Linear objects); each entry
declares its resident bytes. The cache never holds more than `budget` bytes: an insert evicts
by policy until the newcomer fits, and an expert that cannot fit (everything else pinned or in
use) is simply not kept: the caller computes with it and drops it.

Policies (chosen by measurement, `benchmarks/experts.py`):
    lru          evict the least recently used
    lfu          evict the least frequently used (ties: least recent)
    least-stale  evict the one unused for the most decode steps (tokens), ties by frequency:
                 LRU's order at token granularity, so a layer's own sweep order does not matter
Pinned experts (the hot set from the usage history) are never evicted; experts the current
step is computing with are protected until the step ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

Key = Hashable


class Policy:
    """Eviction order over the cache's unpinned keys."""

    name: ClassVar[str]

    def hit(self, key: Key, step: int) -> None:
        raise NotImplementedError

    def insert(self, key: Key, step: int) -> None:
        self.hit(key, step)

    def remove(self, key: Key) -> None:
        raise NotImplementedError

    def victims(self) -> Iterable[Key]:
        """Keys from first-to-evict onwards."""
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()

    def hit(self, key: Key, step: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victims(self) -> Iterable[Key]:
        return iter(list(self.order))


class _Scored(Policy):
    """Policies that rank by a per-key score (smallest evicted first)."""

    def __init__(self) -> None:
        self.count: dict[Key, int] = {}
        self.last: dict[Key, int] = {}
        self.tick = 0  # access order, for ties

    def hit(self, key: Key, step: int) -> None:
        self.tick += 1
        self.count[key] = self.count.get(key, 0) + 1
        self.last[key] = (step, self.tick)

    def remove(self, key: Key) -> None:
        self.count.pop(key, None)
        self.last.pop(key, None)

    def score(self, key: Key) -> tuple:
        raise NotImplementedError

    def victims(self) -> Iterable[Key]:
        return iter(sorted(self.count, key=self.score))


class LFU(_Scored):
    name = "lfu"

    def score(self, key: Key) -> tuple:
        return (self.count[key], self.last[key])


class LeastStale(_Scored):
    name = "least-stale"

    def score(self, key: Key) -> tuple:
        step, tick = self.last[key]
        return (step, self.count[key], tick)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, LFU, LeastStale)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown expert cache policy {name!r}; valid: {', '.join(POLICIES)}") from None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    not_kept: int = 0  # experts read but not cached (nothing evictable left)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class ExpertCache:
    """(layer, expert) -> value, at most `budget` bytes resident; thread-safe. `on_evict(key,
    value)` is told of each eviction (a store that reuses an evicted value's memory)."""

    def __init__(
        self,
        budget: int,
        policy: str | Policy = "lru",
        on_evict: Callable[[Key, Any], None] | None = None,
    ):
        if budget < 0:
            raise ValueError(f"expert cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.stats = CacheStats()
        self.step = 0  # decode steps seen (the least-stale clock)
        self._items: dict[Key, tuple[Any, int]] = {}
        self._pinned: set[Key] = set()
        self._protected: set[Key] = set()
        self._bytes = 0
        self._lock = threading.RLock()
        self._on_evict = on_evict

    @property
    def resident_bytes(self) -> int:
        return self._bytes

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def cached_keys(self) -> list[Key]:
        with self._lock:
            return list(self._items)

    def values(self) -> list[tuple[Key, Any]]:
        """(key, value) of every cached entry, touching neither statistics nor policy."""
        with self._lock:
            return [(k, v) for k, (v, _n) in self._items.items()]

    def get(self, key: Key, count: bool = True) -> Any | None:
        """The cached value (a hit) or None (a miss); `count=False` peeks without statistics."""
        with self._lock:
            item = self._items.get(key)
            if count:
                if item is None:
                    self.stats.misses += 1
                else:
                    self.stats.hits += 1
            if item is not None and key not in self._pinned:
                self.policy.hit(key, self.step)
            return None if item is None else item[0]

    def put(self, key: Key, value: Any, nbytes: int, pin: bool = False) -> bool:
        """Keep `value` if it fits after evicting by policy; True when kept."""
        with self._lock:
            if key in self._items:
                return True
            if not self._make_room(nbytes):
                self.stats.not_kept += 1
                return False
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            if pin:
                self._pinned.add(key)
            else:
                self.policy.insert(key, self.step)
            return True

    def protect(self, keys: Iterable[Key]) -> None:
        """Experts the current step computes with: not evicted until `release`."""
        with self._lock:
            self._protected.update(keys)

    def release(self) -> None:
        with self._lock:
            self._protected.clear()

    def next_step(self) -> None:
        with self._lock:
            self.step += 1

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.budget:
            return False
        if self._bytes + nbytes <= self.budget:
            return True
        evictable = self._bytes - sum(
            self._items[k][1] for k in self._pinned | self._protected if k in self._items
        )
        if self._bytes - evictable + nbytes > self.budget:
            return False  # even evicting everything allowed would not make room
        for key in self.policy.victims():
            if self._bytes + nbytes <= self.budget:
                break
            if key in self._protected or key in self._pinned:
                continue
            self._evict(key)
        return self._bytes + nbytes <= self.budget

    def _evict(self, key: Key) -> None:
        value, n = self._items.pop(key)
        self._bytes -= n
        self.policy.remove(key)
        self.stats.evictions += 1
        if self._on_evict is not None:
            self._on_evict(key, value)
