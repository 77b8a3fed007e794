"""SlotPool: float32 caches placed side by side keep every row, grow together, come back whole,
and a batched decode over them gives the bytes the caches' own buffers give."""

from __future__ import annotations

import pytest
import torch

from latentkv.kv.slots import SlotPool


def _filled(model, n: int, seed: int):
    cache = model.make_cache()
    g = torch.Generator().manual_seed(seed)
    model.forward(torch.randint(2, model.cfg.vocab_size, (n,), generator=g), cache)
    return cache


def _state(cache) -> dict[str, torch.Tensor]:
    return cache.state()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_place_and_release_keep_the_rows(ours):
    model = ours("glm5-tiny-dsa")
    pool = SlotPool(model.layout, slots=3, capacity=4)
    caches = [_filled(model, n, seed=n) for n in (5, 9, 2)]
    before = [_state(c) for c in caches]
    assert all(pool.place(c) for c in caches)
    assert pool.capacity >= 9 and len(pool) == 3
    assert [pool.slot_of(c) for c in caches] == [0, 1, 2]
    for cache, state in zip(caches, before, strict=True):
        assert _same(_state(cache), state)  # the cache reads its rows from the pool now
        assert cache.view(0).data_ptr() in {pool.rows[0][s].data_ptr() for s in range(3)}
    pool.release(caches[1])
    assert pool.slot_of(caches[1]) is None and len(pool) == 2
    assert _same(_state(caches[1]), before[1])
    assert caches[1].view(0).data_ptr() != pool.rows[0][1].data_ptr()
    assert not pool.rows[0][1].any() and not pool.keys[model.layout.index_layers[0]][1].any()  # zeroed
    pool.release(caches[1])  # a second release is a no-op
    # the released cache decodes on in its own buffers, as a fresh copy of it does
    twin = caches[1].tier.from_state(before[1])
    token = torch.tensor([3])
    assert torch.equal(model.forward(token, caches[1]), model.forward(token, twin))


def test_place_refuses_what_it_cannot_hold(ours):
    model = ours("glm5-tiny-dsa")
    pool = SlotPool(model.layout, slots=1)
    packed = model.make_cache(model.tier("tq4"))
    assert not pool.place(packed)
    first, second = _filled(model, 3, seed=1), _filled(model, 3, seed=2)
    assert pool.place(first)
    assert not pool.place(first)  # already placed
    assert not pool.place(second)  # no free slot
    assert pool.slot_of(second) is None
    with pytest.raises(ValueError, match="at least one slot"):
        SlotPool(model.layout, slots=0)


def test_a_bound_buffer_that_needs_room_grows_every_slot(ours):
    """A placed cache decoding alone (Model.forward) past the capacity grows the whole pool; the
    other caches' rows move with it."""
    model = ours("glm5-tiny-dsa")
    pool = SlotPool(model.layout, slots=2, capacity=8)
    grower, other = _filled(model, 7, seed=3), _filled(model, 5, seed=4)
    twin = grower.tier.from_state(grower.state())
    kept = _state(other)
    pool.place(grower)
    pool.place(other)
    for token in range(2, 8):
        assert torch.equal(
            model.forward(torch.tensor([token]), grower), model.forward(torch.tensor([token]), twin)
        )
    assert pool.capacity >= 13 and pool.slot_of(grower) == 0
    assert grower.view(0).data_ptr() == pool.rows[0][0].data_ptr()
    assert _same(_state(other), kept) and _same(_state(grower), _state(twin))


def test_over_max_bytes_every_cache_gets_its_rows_back(ours):
    model = ours("glm5-tiny-dsa")
    pool = SlotPool(model.layout, slots=2, capacity=8, max_bytes=SlotPool(model.layout, 2, 8).bytes_for(16))
    a, b = _filled(model, 6, seed=5), _filled(model, 4, seed=6)
    twins = [c.tier.from_state(c.state()) for c in (a, b)]
    pool.place(a)
    pool.place(b)
    assert pool.reserve(16)  # exactly the bound
    assert not pool.reserve(17)  # past it: both caches back in their own buffers
    assert pool.slot_of(a) is None and pool.slot_of(b) is None
    assert all(_same(_state(c), _state(t)) for c, t in zip((a, b), twins, strict=True))
    fresh = _filled(model, 2, seed=7)
    assert not pool.place(fresh)  # closed until the evicted caches are released
    pool.release(a)
    assert not pool.place(fresh)
    pool.release(b)
    assert pool.place(fresh)
    # the evicted caches decode on by themselves
    tokens = torch.tensor([4, 5])
    got = model.decode_batch(tokens, [a, b])
    expected = torch.cat([model.forward(tokens[i : i + 1], t) for i, t in enumerate(twins)])
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5


# lengths on both sides of the DSA models' index_topk (8)
LENGTHS = [1, 3, 7, 8, 9, 12, 17, 20, 25, 31, 5, 40, 2, 14, 33, 10]


@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny", "glm5-tiny"])
@pytest.mark.parametrize("order", ["in order", "shuffled", "with gaps"])
def test_pooled_step_is_the_own_buffers_step(ours, name, order):
    """decode_batch with the pool (one write per layer, rows read from the pool) gives exactly
    the bytes of the same step over the caches' own buffers: logits and every cache's rows,
    over steps that grow the pool and cross index_topk; slots in batch order, out of it (the
    step runs in slot order and puts the logits back), and with free slots between."""
    model = ours(name)
    lengths = LENGTHS[:8] if order == "with gaps" else LENGTHS
    own = [_filled(model, n, seed=100 + i) for i, n in enumerate(lengths)]
    pooled = [c.tier.from_state(c.state()) for c in own]
    slots = 2 * len(lengths) if order == "with gaps" else len(lengths)
    pool = SlotPool(model.layout, slots=slots, capacity=16)
    fillers = [_filled(model, 1, seed=0) for _ in range(slots)]
    for c in fillers:
        pool.place(c)
    wanted = {"in order": range(len(lengths)), "shuffled": reversed(range(len(lengths)))}.get(
        order, range(0, 2 * len(lengths), 2)
    )
    for cache, slot in zip(pooled, wanted, strict=True):
        pool.release(fillers[slot])
        assert pool.place(cache) and pool.slot_of(cache) == slot
    for c in fillers:
        pool.release(c)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(2, model.cfg.vocab_size, (len(lengths),), generator=g)
    for _ in range(12):
        expected = model.decode_batch(tokens, own)
        got = model.decode_batch(tokens, pooled, pool)
        assert torch.equal(got, expected)
        tokens = expected.argmax(dim=-1)
    assert pool.capacity >= max(lengths) + 12
    for a, b in zip(own, pooled, strict=True):
        assert _same(_state(a), _state(b))
