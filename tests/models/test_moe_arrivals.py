"""A MoE layer computes on experts in the order a store delivers them (a store from disk hands
them over as their reads finish) and sums them in a fixed order: the output is bit-identical to
the in-order computation whatever the arrival order, on every path that asks the store."""

from __future__ import annotations

import random

import pytest
import torch
from tests.conftest import fixture_moe

from latentkv.experts.base import LocalStore
from latentkv.models.moe import MoE


class Store(LocalStore):
    """Experts resident, asked through the store contract; `shuffle` hands `arrivals` over in a
    random order (as reads finishing out of order would), k at a time as a store from disk."""

    def __init__(self, experts: dict, shuffle: bool, seed: int = 0, k: int = 6):
        self._experts, self.num_experts = experts, len(experts)
        self.at_once = k if shuffle else None
        self._rng = random.Random(seed) if shuffle else None

    def get(self, ids, first=True):
        return {e: self._experts[e] for e in ids}

    def arrivals(self, ids, first=True):
        if self._rng is None:
            return super().arrivals(ids, first)
        order = list(ids)
        self._rng.shuffle(order)
        return iter([(e, self._experts[e]) for e in order])


@pytest.fixture(scope="module")
def moe_layer():
    # top-6: with 2 the sum of two terms from zero is the same in either order
    mlp, router, experts = fixture_moe(top_k=6)
    return MoE(router, mlp.experts, mlp.shared), experts


@pytest.mark.parametrize(("rows", "decode"), [(1, False), (1, True), (5, False), (4, True), (40, False)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_arrival_order_gives_the_same_bits(moe_layer, rows, decode, seed):
    mlp, experts = moe_layer
    plain = MoE(mlp.router, Store(experts, shuffle=False), mlp.shared)
    shuffled = MoE(mlp.router, Store(experts, shuffle=True, seed=seed), mlp.shared)
    g = torch.Generator().manual_seed(seed + 100 * rows)
    x = torch.randn(rows, experts[0].gate_up.in_features, generator=g)
    residual = torch.randn_like(x)
    want = plain(x, residual=residual, decode=decode)
    got = shuffled(x, residual=residual, decode=decode)
    assert torch.equal(got, want)
    # and the in-order result is the expert sum computed directly (in float64, loosely)
    idx, w = mlp.router(x)
    ref = residual.double().clone()
    for r in range(rows):
        for e, wt in zip(idx[r].tolist(), w[r].tolist(), strict=True):
            ref[r] += wt * experts[e](x[r : r + 1]).double()[0]
        if mlp.shared is not None:
            ref[r] += mlp.shared(x[r : r + 1]).double()[0]
    assert torch.allclose(want.double(), ref, rtol=1e-4, atol=1e-4)


def test_the_check_can_fail_adding_in_arrival_order_changes_bits(moe_layer, monkeypatch):
    """Control: with the outputs added as they arrive (no reordering) some case differs."""
    from latentkv.models import moe as moe_mod

    def unordered(ids, results, add):
        for e, y in results:
            add(e, y)

    mlp, experts = moe_layer
    x = torch.randn(40, experts[0].gate_up.in_features, generator=torch.Generator().manual_seed(7))
    want = MoE(mlp.router, Store(experts, shuffle=False), mlp.shared)(x)
    monkeypatch.setattr(moe_mod, "_in_order", unordered)
    got = [MoE(mlp.router, Store(experts, shuffle=True, seed=s), mlp.shared)(x) for s in range(3)]
    assert any(not torch.equal(g, want) for g in got)
