"""A model whose experts stream from disk is token- and logit-identical to the same model with
every expert resident (same weight format, same MoE computation), at every budget from one
expert per MoE layer up, in every KV tier, in single and batched decode.

The model is converted into an expert store in a temporary folder; the reference holds the same
Expert objects (built from the checkpoint by the converter's own path) in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, ModelConfig
from latentkv.experts.base import Expert, LocalStore
from latentkv.experts.store_file import read_manifest
from latentkv.experts.streamed import StreamConfig
from latentkv.models.loader import Checkpoint
from latentkv.models.registry import resolve
from latentkv.models.weights import load_model
from latentkv.streaming.attach import load_streamed, moe_layers
from latentkv.streaming.convert import _ExpertSource, convert_experts

FAST_TIERS = ("f32", "q8s", "q4s", "fp8", "tq4-r8")  # the README recommends q8s and q4s
SLOW_TIERS = tuple(t for t in KV_CACHE_DTYPES if t not in FAST_TIERS)
PROMPT = [5, 17, 99, 3, 42, 7]
STEPS = 6


class ResidentDict(LocalStore):
    """Every expert held in memory, served through the same store contract."""

    def __init__(self, experts: dict[int, Expert]):
        self._experts = experts
        self.num_experts = len(experts)
        self.asked: list[list[int]] = []

    def get(self, ids: Sequence[int], first: bool = True) -> dict[int, Expert]:
        self.asked.append(list(ids))
        return {e: self._experts[e] for e in ids}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._experts.values())


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:fixture"])
def converted(request, tmp_path_factory):
    model_dir = resolve(request.param)
    store = tmp_path_factory.mktemp("store") / "experts"
    convert_experts(model_dir, store, "f32")
    return model_dir, store


class ResidentSource:
    """Every layer's experts as the converter builds them, held in memory (`ResidentDict`)."""

    predicts = False

    def __init__(self, model_dir):
        self.cfg = ModelConfig.from_hf(model_dir)
        self.experts = _ExpertSource(self.cfg, Checkpoint(model_dir), None)

    def store(self, layer: int) -> ResidentDict:
        n = self.cfg.n_routed_experts
        return ResidentDict({e: self.experts.expert(layer, e, "f32", {}) for e in range(n)})


def _resident(model_dir):
    return load_model(model_dir, experts=ResidentSource(model_dir), load_mtp=False, device="cpu")


def _streamed(model_dir, store, experts_per_layer: int, prefetch: bool = True, **kw):
    m = read_manifest(store)
    stride = max(e.layout.stride for e in m.layers.values())
    budget = experts_per_layer * len(m.layers) * stride
    return load_streamed(
        model_dir, store, StreamConfig(budget=budget, history=False, **kw), prefetch=prefetch, device="cpu"
    )


def _greedy(model, tier: str) -> tuple[list[int], list[torch.Tensor]]:
    cache = model.make_cache(model.tier(tier))
    logits = model.forward(torch.tensor(PROMPT), cache)[-1]
    tokens, seen = [], [logits]
    for _ in range(STEPS):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(tokens[-1:]), cache)[-1]
        seen.append(logits)
    return tokens, seen


def _check_identical(ref, got) -> None:
    assert ref[0] == got[0]
    for a, b in zip(ref[1], got[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("experts_per_layer", [1, 2, 8])
def test_streamed_decode_is_identical_at_every_budget(converted, experts_per_layer):
    model_dir, store = converted
    ref = _greedy(_resident(model_dir), "f32")
    model, streamer = _streamed(model_dir, store, experts_per_layer)
    got = _greedy(model, "f32")
    _check_identical(ref, got)
    t = streamer.snapshot()
    assert t["resident_bytes"] <= t["budget"]
    assert t["misses"] > 0 and t["bytes_read"] > 0
    if experts_per_layer == 8:
        assert t["misses"] + t["prefetched"] <= 8 * len(read_manifest(store).layers)  # each read once
    streamer.close()


def test_streamed_tokens_match_the_default_resident_model(converted):
    model_dir, store = converted
    default = _greedy(load_model(model_dir, device="cpu"), "f32")
    model, streamer = _streamed(model_dir, store, 1)
    got = _greedy(model, "f32")
    assert got[0] == default[0]
    for a, b in zip(default[1], got[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fused vs grouped expert paths
    streamer.close()


def _tier_case(converted, tier):
    model_dir, store = converted
    ref = _greedy(_resident(model_dir), tier)
    model, streamer = _streamed(model_dir, store, 1)
    _check_identical(ref, _greedy(model, tier))
    streamer.close()


@pytest.mark.parametrize("tier", FAST_TIERS)
def test_every_kv_tier_is_identical_streamed(converted, tier):
    _tier_case(converted, tier)


@pytest.mark.slow
@pytest.mark.parametrize("tier", SLOW_TIERS)
def test_every_kv_tier_is_identical_streamed_slow(converted, tier):
    _tier_case(converted, tier)


def _batched(model, tier: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    caches = [model.make_cache(model.tier(tier)) for _ in prompts]
    last = torch.stack([model.forward(torch.tensor(p), c)[-1] for p, c in zip(prompts, caches, strict=True)])
    out = [last]
    for _ in range(4):
        last = model.decode_batch(last.argmax(-1), caches)
        out.append(last)
    return out


@pytest.mark.parametrize("tier", ["f32", "tq4-r8"])
def test_batched_decode_is_identical_and_reads_the_union_once(converted, tier):
    model_dir, store = converted
    prompts = [PROMPT, [1, 2, 3], [200 % 128, 9, 9, 9, 4]]
    ref_model = _resident(model_dir)
    ref = _batched(ref_model, tier, prompts)
    model, streamer = _streamed(model_dir, store, 1)
    got = _batched(model, tier, prompts)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    for i in moe_layers(ref_model):  # one get per pass, distinct ids: the union
        for ids in ref_model.blocks[i].mlp.experts.asked:
            assert len(ids) == len(set(ids))
    streamer.close()


def test_prefetch_recall_is_measured(converted):
    model_dir, store = converted
    model, streamer = _streamed(model_dir, store, 1)
    _greedy(model, "f32")
    t = streamer.snapshot()
    assert t["predicted"] > 0 and 0 <= t["recall"] <= 1 and t["prefetch_reads"] > 0
    streamer.close()
    first = moe_layers(model)[0]
    if first > 0:  # the dense layer before the first MoE layer predicts it too
        model, streamer = _streamed(model_dir, store, 1)
        model.blocks[first - 1].mlp.lookahead = None
        _greedy(model, "f32")
        assert 0 < streamer.snapshot()["predicted"] < t["predicted"]
        streamer.close()
    model, streamer = _streamed(model_dir, store, 1, prefetch=False)
    assert not [b for b in model.blocks if getattr(b.mlp, "lookahead", None) is not None]
    _greedy(model, "f32")
    assert streamer.snapshot()["predicted"] == 0
    streamer.close()


def test_load_streamed_never_reads_an_expert_tensor(converted, monkeypatch):
    model_dir, store = converted
    ref = _greedy(_resident(model_dir), "f32")
    read = []
    real_get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: (read.append(name), real_get(self, name))[1])
    model, streamer = load_streamed(model_dir, store, StreamConfig(budget=0, history=False), device="cpu")
    assert read and not [n for n in read if ".mlp.experts." in n]
    _check_identical(ref, _greedy(model, "f32"))
    streamer.close()


def test_a_store_of_another_model_is_refused(converted, tmp_path):
    from latentkv.experts.store_file import ExpertFileError

    model_dir, store = converted
    other = resolve("builtin:fixture" if "tiny" in str(model_dir) else "builtin:tiny")
    with pytest.raises(ExpertFileError, match="another model"):
        load_streamed(other, store, StreamConfig(budget=0, history=False), device="cpu")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_experts_stream_identically_to_resident_packed(tmp_path, fmt):
    model_dir = resolve("builtin:fixture")
    store = tmp_path / "experts"
    convert_experts(model_dir, store, fmt)
    ref = _greedy(
        load_model(model_dir, expert_dtype=fmt, device="cpu"), "f32"
    )  # packed: no stacked fast path
    model, streamer = load_streamed(model_dir, store, StreamConfig(budget=0, history=False), device="cpu")
    _check_identical(ref, _greedy(model, "f32"))
    assert read_manifest(store).meta["weight_format"] == fmt
    streamer.close()
