"""Placement of experts over a cluster's ranks: balanced by expected load, cache room and disk
speed, deterministic, named by a digest, refused when it belongs to another model. Expected
values are computed here from the definitions, not by the code under test."""

from __future__ import annotations

import json
import random

import pytest

from latentkv.experts.placement import Placement, PlacementError, Rank, expected_reads, place

EXTENT = 1 << 20


def _layer_seconds(placement: Placement, layer: int, uses: list[float], ranks: list[Rank]) -> list[float]:
    """Per rank: expected read seconds per token in `layer` with nothing cached (the definition)."""
    out = [0.0] * len(ranks)
    for e, r in enumerate(placement.owners[layer]):
        out[r] += uses[e] * EXTENT / (ranks[r].disk_gbps * 1e9)
    return out


def test_even_load_equal_ranks_deals_evenly_and_spreads_the_remainder():
    layers = {1: 8, 2: 8, 3: 8, 4: 8}
    p = place(layers, EXTENT, [Rank(0), Rank(0), Rank(0)])
    for layer, n in layers.items():
        counts = [p.owners[layer].count(r) for r in range(3)]
        assert sum(counts) == n and max(counts) - min(counts) <= 1
    assert max(p.counts()) - min(p.counts()) <= 1  # the odd experts are not all rank 0's
    assert p.share(1) == {layer: [e for e, r in enumerate(p.owners[layer]) if r == 1] for layer in layers}


def test_a_faster_disk_takes_more_of_the_uncached_load():
    rng = random.Random(0)
    uses = [rng.random() for _ in range(64)]
    ranks = [Rank(0, 1.0), Rank(0, 2.0)]
    p = place({5: 64}, EXTENT, ranks, {5: uses})
    seconds = _layer_seconds(p, 5, uses, ranks)
    # balanced read time: the slower rank's time within one expert's read of the faster one's
    assert abs(seconds[0] - seconds[1]) <= max(uses) * EXTENT / 1e9
    load = [sum(u for u, r in zip(uses, p.owners[5], strict=True) if r == k) for k in range(2)]
    assert load[1] / load[0] == pytest.approx(2.0, rel=0.15)
    # and better than handing out experts alternately
    even = Placement(2, {5: tuple(e % 2 for e in range(64))})
    assert max(seconds) < max(_layer_seconds(even, 5, uses, ranks))


def test_cache_room_takes_the_hottest_experts_first():
    uses = [10.0, 9.0, 8.0, 7.0] + [1.0] * 12
    # rank 1 caches 4 experts of this one layer; rank 0 caches none
    ranks = [Rank(0, 1.0), Rank(4 * EXTENT, 1.0)]
    p = place({0: 16}, EXTENT, ranks, {0: uses})
    assert [p.owner(0, e) for e in range(4)] == [1, 1, 1, 1]
    reads = expected_reads(p, EXTENT, ranks, {0: uses})
    cold_on_1 = sum(uses[e] * EXTENT for e in range(16) if p.owner(0, e) == 1 and e >= 4)
    assert reads[1][0] == pytest.approx(cold_on_1)
    assert reads[0][0] == pytest.approx(sum(uses[e] * EXTENT for e in range(16) if p.owner(0, e) == 0))


def test_a_head_told_to_keep_no_experts_owns_none():
    p = place({1: 8, 2: 8}, EXTENT, [Rank(0, takes_experts=False), Rank(0), Rank(0)])
    assert p.counts()[0] == 0 and p.share(0) == {}
    assert sorted(p.counts()[1:]) == [8, 8]
    with pytest.raises(ValueError, match="no rank takes experts"):
        place({1: 8}, EXTENT, [Rank(0, takes_experts=False)])


def test_deterministic_digest_and_json_round_trip(tmp_path):
    args = (
        {1: 16, 3: 16},
        EXTENT,
        [Rank(3 * EXTENT, 1.5), Rank(EXTENT, 1.0)],
        {1: [float(i) for i in range(16)]},
    )
    a, b = place(*args), place(*args)
    assert a == b and a.digest == b.digest and len(a.digest) == 16
    other = Placement(2, {**a.owners, 3: tuple(1 - r for r in a.owners[3])})
    assert other.digest != a.digest
    path = tmp_path / "p.json"
    a.save(path)
    assert Placement.load(path) == a
    # a `plan --json` output holds it under "placement"
    (tmp_path / "plan.json").write_text(json.dumps({"nodes": 2, "placement": a.to_json()}))
    assert Placement.load(tmp_path / "plan.json") == a
    raw = json.loads(path.read_text())
    raw["owners"]["1"][0] = 1 - raw["owners"]["1"][0]
    path.write_text(json.dumps(raw))
    with pytest.raises(PlacementError, match="digest does not match"):
        Placement.load(path)
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(PlacementError, match="cannot read it as JSON"):
        Placement.load(tmp_path / "bad.json")
    with pytest.raises(PlacementError, match="no placement file"):
        Placement.load(tmp_path / "none.json")


def test_a_placement_of_another_model_is_refused():
    p = place({1: 8, 2: 8}, EXTENT, [Rank(0), Rank(0)])
    p.check_layers({1: 8, 2: 8})
    with pytest.raises(PlacementError, match="covers layers"):
        p.check_layers({1: 8, 2: 8, 3: 8})
    with pytest.raises(PlacementError, match="covers layers"):
        p.check_layers({1: 16, 2: 16})
