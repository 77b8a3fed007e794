"""Batched decode (`Model.decode_batch`) against the single-sequence decode (`Model.forward`).

Every sequence gets two caches filled by the same prefill; one decodes alone through `forward`,
the other inside a batch. Their logits must agree within float32 rounding (1e-5 relative to the
largest logit), on every cache tier, with ragged lengths, and with DSA selecting (contexts longer
than index_topk beside shorter ones).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from latentkv.attention import base as attention_base
from latentkv.config import CacheConfig
from latentkv.kv.cache import LatentCache, PackedLatentCache
from latentkv.kv.codecs import TIERS, get_codec
from latentkv.models import moe as moe_module
from latentkv.models.indexer import Indexer

TOLERANCE = 1e-5
CODE_APART_TOLERANCE = 5e-3


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _prefilled(model, lengths: list[int], tier: str, seed: int) -> tuple[list, list[int]]:
    """One prefilled cache per sequence, and the greedy token each one decodes next."""
    g = torch.Generator().manual_seed(seed)
    caches, last = [], []
    for n in lengths:
        prompt = torch.randint(2, model.cfg.vocab_size, (n,), generator=g)
        cache = model.make_cache(model.tier(tier))
        last.append(int(model.forward(prompt, cache)[-1].argmax()))
        caches.append(cache)
    return caches, last


def _clone(cache):
    """A byte-identical copy through the cache's own state."""
    if isinstance(cache, PackedLatentCache):
        return PackedLatentCache.from_state(cache.tier, cache.state())
    return LatentCache.from_state(cache.tier, cache.state())


def _last_rows_equal(a, b) -> bool:
    """Whether two packed caches' newest rows hold the same codes in every layer (their float32
    scales, like f32 rows, are compared through the logits)."""
    sa, sb = a.state(), b.state()
    return all(torch.equal(sa[k][-1:], sb[k][-1:]) for k in sa if "codes" in k)


@dataclass
class Agreement:
    worst: float = 0.0  # worst relative logit error where the new rows are byte-identical (or f32)
    worst_code_apart: float = 0.0  # ... where a quantized value of the new row landed one code apart
    code_apart: int = 0  # sequence-steps with such a row
    total: int = 0


def _compare_steps(model, lengths: list[int], tier: str, seed: int, steps: int = 3) -> Agreement:
    """Each step: copy every reference cache, decode one token alone on the reference (`forward`)
    and batched on the copies, compare; feed the reference's greedy tokens to the next step.

    On a quantized tier the new row is quantized from float32 values that may differ in their
    last bits from the single decode's, so a value sitting on a rounding boundary can land one
    code apart; those sequence-steps are counted (and bounded) separately from the exact ones."""
    refs, tokens = _prefilled(model, lengths, tier, seed)
    out = Agreement()
    for _ in range(steps):
        copies = [_clone(c) for c in refs]
        got = model.decode_batch(torch.tensor(tokens), copies)
        expected = torch.cat([model.forward(torch.tensor([t]), c) for t, c in zip(tokens, refs, strict=True)])
        assert got.shape == expected.shape
        assert [c.length for c in copies] == [c.length for c in refs]
        for b in range(len(lengths)):
            error = _relative(got[b], expected[b])
            out.total += 1
            if tier == "f32" or _last_rows_equal(copies[b], refs[b]):
                out.worst = max(out.worst, error)
            else:
                out.code_apart += 1
                out.worst_code_apart = max(out.worst_code_apart, error)
        tokens = expected.argmax(dim=-1).tolist()
    return out


def _assert_agrees(a: Agreement) -> None:
    assert a.worst <= TOLERANCE, a
    # A value one code apart moves the logits by at most the tier's own rounding; it is rare.
    assert a.worst_code_apart <= CODE_APART_TOLERANCE, a
    assert a.code_apart <= max(1, a.total // 10), a


# 16 ragged sequences: some shorter than the DSA models' index_topk (8), most longer.
RAGGED = [1, 3, 7, 8, 9, 12, 17, 20, 25, 31, 5, 40, 2, 14, 33, 10]


@pytest.mark.parametrize("tier", ["f32", "bf16", "fp8", "tq4"])
@pytest.mark.parametrize("name", ["glm5-tiny-dsa", "dsv3-tiny"])
def test_sixteen_sequences_match_single_decode(ours, name, tier):
    _assert_agrees(_compare_steps(ours(name), RAGGED, tier, seed=11))


@pytest.mark.parametrize("tier", ["f32", "tq4"])
def test_equal_lengths_match_single_decode(ours, tier):
    """Sequences of one length (read without padding) against the single decode."""
    _assert_agrees(_compare_steps(ours("glm5-tiny-dsa"), [15] * 6, tier, seed=17))


@pytest.mark.parametrize("name", ["dsv32-tiny-dsa", "dsv3-tiny-noqlora", "glm5-tiny"])
def test_other_families_match_single_decode(ours, name):
    _assert_agrees(_compare_steps(ours(name), RAGGED[:6], "f32", seed=12, steps=2))


@pytest.mark.parametrize("tier", ["f32", "tq4"])
def test_alone_is_the_single_decode(ours, tier):
    """A batch of one is `forward` itself: the same logits and the same cache bytes."""
    model = ours("glm5-tiny-dsa")
    (ref,), (token,) = _prefilled(model, [19], tier, seed=13)
    copy = _clone(ref)
    for _ in range(3):
        expected = model.forward(torch.tensor([token]), ref)
        got = model.decode_batch(torch.tensor([token]), [copy])
        assert torch.equal(got, expected)
        token = int(expected.argmax())
    assert all(torch.equal(v, copy.state()[k]) for k, v in ref.state().items())


def test_the_new_rows_are_the_single_decode_rows(ours):
    """What decode_batch appends to each f32 cache is what forward appends (within rounding)."""
    model = ours("glm5-tiny-dsa")
    refs, tokens = _prefilled(model, [4, 11, 23], "f32", seed=14)
    batched = [_clone(c) for c in refs]
    for t, c in zip(tokens, refs, strict=True):
        model.forward(torch.tensor([t]), c)
    model.decode_batch(torch.tensor(tokens), batched)
    for ref, got in zip(refs, batched, strict=True):
        for layer in range(model.cfg.num_layers):
            assert _relative(got.view(layer), ref.view(layer)) <= TOLERANCE
        for layer in model.layout.index_layers:
            assert _relative(got.index_keys(layer), ref.index_keys(layer)) <= TOLERANCE


def test_mixed_tiers_in_one_batch(ours):
    """Sequences in different tiers decode together, each reading its own format."""
    model = ours("glm5-tiny-dsa")
    tiers = ["f32", "tq4", "fp8", "f32", "bf16", "tq4"]
    lengths = [9, 3, 15, 21, 12, 30]
    refs, tokens = [], []
    for i, (tier, n) in enumerate(zip(tiers, lengths, strict=True)):
        caches, last = _prefilled(model, [n], tier, seed=20 + i)
        refs += caches
        tokens += last
    batched = [_clone(c) for c in refs]
    got = model.decode_batch(torch.tensor(tokens), batched)
    expected = torch.cat([model.forward(torch.tensor([t]), c) for t, c in zip(tokens, refs, strict=True)])
    for b, tier in enumerate(tiers):
        if tier == "f32" or _last_rows_equal(batched[b], refs[b]):
            assert _relative(got[b], expected[b]) <= TOLERANCE, tier


def test_recent_window_caches(ours):
    """Packed caches with a full-precision recent window (their own reader kind, read one sequence
    at a time) beside plain tq4 caches of the same codec, in one batch. The window's f32 rows are
    not in a cache's state, so each side prefills the same prompt itself instead of copying."""
    model = ours("glm5-tiny-dsa")
    refs, batched, tokens = [], [], []
    for i, (window, n) in enumerate([(4, 9), (0, 12), (4, 20), (16, 3), (0, 25)]):
        prompt = torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(40 + i))
        pair = [model.make_cache(model.tier(CacheConfig("tq4", recent_window=window))) for _ in range(2)]
        tokens.append([int(model.forward(prompt, c)[-1].argmax()) for c in pair][0])
        refs.append(pair[0])
        batched.append(pair[1])
    got = model.decode_batch(torch.tensor(tokens), batched)
    expected = torch.cat([model.forward(torch.tensor([t]), c) for t, c in zip(tokens, refs, strict=True)])
    compared = [b for b in range(len(refs)) if _last_rows_equal(batched[b], refs[b])]
    assert len(compared) >= 3
    for b in compared:
        assert _relative(got[b], expected[b]) <= TOLERANCE


@pytest.mark.parametrize("tier", ["f32", "tq4"])
def test_per_sequence_fallback_matches(ours, monkeypatch, tier):
    """Past the padded-read budget every sequence is read on its own: the same results."""
    monkeypatch.setattr(attention_base, "BATCH_ATTEND_ELEMENTS", 0)
    monkeypatch.setattr(moe_module, "EVERY_EXPERT_MAX_BYTES", 0)  # experts grouped by expert
    monkeypatch.setattr(moe_module, "GATHER_BATCH_MAX_BYTES", 0)
    _assert_agrees(_compare_steps(ours("glm5-tiny-dsa"), RAGGED[:8], tier, seed=15, steps=2))


@pytest.mark.parametrize("path", ["every", "gathered", "grouped"])
@pytest.mark.parametrize("B", [1, 3, 16])
def test_moe_decode_paths_match_the_layer(ours, monkeypatch, path, B):
    """Each MoE decode path against `MoE.__call__` on the same rows, one row at a time (the
    single-token decode path) as the reference."""
    model = ours("dsv3-tiny")  # grouped routing: 4 groups, 2 kept
    moe = model.blocks[-1].mlp
    limits = {"every": (1 << 40, 0), "gathered": (0, 1 << 40), "grouped": (0, 0)}[path]
    monkeypatch.setattr(moe_module, "EVERY_EXPERT_MAX_BYTES", limits[0])
    monkeypatch.setattr(moe_module, "GATHER_BATCH_MAX_BYTES", limits[1])
    monkeypatch.setattr(moe_module, "EVERY_EXPERT_MIN_PICKS", 0)
    x = torch.randn(B, model.cfg.hidden_size, generator=torch.Generator().manual_seed(B))
    expected = torch.cat([moe(x[b : b + 1]) for b in range(B)])
    assert _relative(moe(x, decode=True), expected) <= TOLERANCE


@pytest.mark.parametrize("B", [1, 3])
def test_small_bf16_experts_take_one_call_with_the_layers_own_sum(checkpoint, monkeypatch, B):
    """A small bf16 layer's resident experts run as one `moe_bf16` call that reads only the
    router's picks (not every expert at once, as float32 layers of that size do), for a lone
    token and a decode batch: the same sum as the store's paths give (one by one in the router's
    order, grouped by expert id), bit for bit."""
    from latentkv import native
    from latentkv.models.weights import load_model

    if native.kernels() is None:
        pytest.skip(f"latentkv's kernels are not built here: {native.unavailable()}")
    model = load_model(checkpoint("dsv3-tiny"), "bf16", device="cpu")
    moe = model.blocks[-1].mlp
    assert moe.experts.packed is not None and moe._every is None
    x = torch.randn(B, model.cfg.hidden_size, generator=torch.Generator().manual_seed(B))
    calls = []
    real = torch.ops.latentkv.moe_bf16
    monkeypatch.setattr(torch.ops.latentkv, "moe_bf16", lambda *a: calls.append(1) or real(*a))
    got = moe(x, decode=B > 1)
    assert calls == [1]
    monkeypatch.setattr(moe.experts, "packed", None)
    idx, weights = moe.router(x)
    store_path = moe._grouped(x, idx, weights) if B > 1 else moe._one_by_one(x, idx[0], weights[0])
    reference = moe._finish(x, *store_path, None)
    assert torch.equal(got, reference)


def test_dsa_selection_matters_here(ours, monkeypatch):
    """With contexts past index_topk, ignoring the selection changes the logits far beyond the
    tolerance: the DSA comparisons above really exercise the per-sequence top-k."""
    model = ours("glm5-tiny-dsa")
    batched, tokens = _prefilled(model, [30, 40], "f32", seed=16)
    unselected = [_clone(c) for c in batched]
    got = model.decode_batch(torch.tensor(tokens), batched)
    monkeypatch.setattr(Indexer, "select_batch", lambda *args: None)
    everything = model.decode_batch(torch.tensor(tokens), unselected)
    for b in range(2):
        assert _relative(everything[b], got[b]) > 100 * TOLERANCE


def test_rejects_bad_batches(ours):
    model = ours("glm5-tiny")
    a, b = model.make_cache(), model.make_cache()
    model.forward(torch.tensor([5, 6]), a)
    with pytest.raises(ValueError, match="twice"):
        model.decode_batch(torch.tensor([3, 4]), [a, a])
    with pytest.raises(ValueError, match="2 tokens for 1 caches"):
        model.decode_batch(torch.tensor([3, 4]), [a])
    with pytest.raises(ValueError, match="out of range"):
        model.decode_batch(torch.tensor([3, 999]), [a, b])
    with pytest.raises(ValueError, match="int64"):
        model.decode_batch(torch.tensor([3.0]), [a])
    other = ours("dsv3-tiny-noqlora").make_cache()
    with pytest.raises(ValueError, match="does not belong"):
        model.decode_batch(torch.tensor([3, 4]), [b, other])
    assert (a.length, b.length) == (2, 0)  # a refused batch writes nothing


def test_bench_batch_rows(ours):
    """The benchmark's bookkeeping (not its timings): aggregate = batch x per-sequence tok/s, and
    the speedups are ratios to the batch-1 row and to the single-sequence figure."""
    from latentkv.eval.bench import measure_batch as bench

    model = ours("glm5-tiny")
    single, rows = bench.bench_batches(model, "tiny", [1, 3], context=4, steps=3)
    assert single > 0 and [(r.batch, r.steps) for r in rows] == [(1, 3), (3, 3)]
    bench.add_speedups(rows, {("f32", 4): 100.0})
    for row in rows:
        assert row.step_seconds == pytest.approx(1 / row.per_sequence_tps)
        assert row.aggregate_tps == pytest.approx(row.batch * row.per_sequence_tps)
        assert row.speedup == pytest.approx(row.aggregate_tps / rows[0].aggregate_tps)
        assert row.speedup_vs_single == pytest.approx(row.aggregate_tps / 100.0)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_encoding_rows_together_is_encoding_each(tier):
    """decode_batch encodes a batch's new rows in one call per tier group: every codec must give
    each row the codes and scales it gets alone (fresh random rows of varied scale; the widths of
    tiny's c and r and GLM-5's, grouped and not)."""
    t = TIERS[tier]
    g = torch.Generator().manual_seed(zlib.crc32(tier.encode()))
    checked = 0
    for name, width, group in [(t.c, 32, None), (t.r, 8, None), (t.c, 512, None), (t.c, 512, 32)]:
        try:
            codec = get_codec(name, width, seed=3, group_size=group)
        except ValueError:  # e.g. a codec that takes no groups
            continue
        x = torch.randn(16, width, generator=g) * torch.rand(16, 1, generator=g) * 8
        together = codec.encode(x)
        alone = [codec.encode(x[i : i + 1]) for i in range(16)]
        assert torch.equal(together.codes, torch.cat([a.codes for a in alone])), (name, width, group)
        assert torch.equal(together.scales, torch.cat([a.scales for a in alone])), (name, width, group)
        checked += 1
    assert checked >= 2
