"""The model's seams against their references: a weight format the model has never seen (no
plain tensor to fuse or stack), an expert store that loads lazily and evicts, and the
attention backend registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentkv.attention import BACKENDS, REFERENCE, backend_for, register_backend
from latentkv.attention import base as attention_base
from latentkv.config import CacheConfig
from latentkv.experts import Expert, LocalStore
from latentkv.kv.cache import CacheLayout, resolve_tier
from latentkv.weights import FORMATS, Linear


class OpaqueF32(Linear):
    """float32 behind the seam with no `dense` tensor: what a packed format looks like to the model."""

    format = "opaque-f32"

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None):
        self._w = w.float().contiguous()
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = w.shape

    @classmethod
    def from_float(cls, w, bias=None, **params):
        return cls(w, bias)

    def __call__(self, x):
        return F.linear(x, self._w, self.bias)

    def dequantize(self):
        return self._w.clone()

    @property
    def nbytes(self):
        return self._w.numel() * 4


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["dsv3-tiny", pytest.param("glm5-tiny-dsa", marks=pytest.mark.slow)])
def test_a_format_without_a_plain_tensor_runs_every_path(name, checkpoint, ours, monkeypatch):
    """The model built in a format it cannot stack or fuse takes the general paths (per-head
    Linears, experts through the store one by one or grouped) and agrees with f32."""
    from latentkv.models.weights import load_model

    monkeypatch.setitem(FORMATS, OpaqueF32.format, OpaqueF32)
    opaque, f32 = load_model(checkpoint(name), OpaqueF32.format, device="cpu"), ours(name)
    moe = opaque.blocks[-1].mlp
    assert moe.experts.stacked is None and moe._every is None
    assert opaque.blocks[0].attn.w.w_uv.stacked is None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, f32.cfg.vocab_size, (n,), generator=g) for n in (70, 9)]
    caches = {m: [m.make_cache() for _ in prompts] for m in (opaque, f32)}
    for m in (opaque, f32):
        got = m.prefill_batch(prompts, caches[m])
        if m is opaque:
            first = got
    assert _relative(first, f32.prefill_batch(prompts, [f32.make_cache() for _ in prompts])) < 1e-5
    tokens = torch.tensor([4, 5])
    for _ in range(3):
        a, b = opaque.decode_batch(tokens, caches[opaque]), f32.decode_batch(tokens, caches[f32])
        assert _relative(a, b) < 1e-5
        one_a, one_b = opaque.forward(tokens[:1], caches[opaque][0]), f32.forward(tokens[:1], caches[f32][0])
        assert _relative(one_a, one_b) < 1e-5
        tokens = a.argmax(-1)
        caches[opaque][0].trim(caches[opaque][0].length - 1)  # undo the lone step (the batch continues)
        caches[f32][0].trim(caches[f32][0].length - 1)


class LazyStore(LocalStore):
    """Loads each expert on request as fresh copies and invalidates the previous request's
    experts: the lifetime the ExpertStore contract allows."""

    def __init__(self, resident, at_once: int):
        self.resident, self.num_experts = resident, resident.num_experts
        self.live: dict[int, Expert] = {}
        self.calls, self.hints = 0, []
        self.at_once = at_once  # asked for k experts at a time: the chunks' lifetimes are tested too

    def get(self, ids, first=True):
        for expert in self.live.values():  # evicted: any later use would fail loudly
            expert.gate_up._w.fill_(float("nan"))
        self.calls += 1
        self.live = {
            e: Expert(OpaqueF32(r.gate_up.dequantize().clone()), OpaqueF32(r.down.dequantize().clone()))
            for e, r in self.resident.get(ids).items()
        }
        return self.live

    def prefetch(self, ids):
        self.hints.append(list(ids))

    @property
    def nbytes(self):
        return sum(e.nbytes for e in self.live.values())


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("decode", [False, True])
def test_a_lazy_evicting_expert_store_gives_the_resident_results(ours, rows, decode):
    from latentkv.models.moe import MoE

    layer = ours("dsv3-tiny").blocks[-1].mlp
    lazy = MoE(layer.router, LazyStore(layer.experts, layer.router.top_k), layer.shared)
    x = torch.randn(rows, layer.router.w.weight.in_features, generator=torch.Generator().manual_seed(rows))
    expected = torch.cat([layer(x[i : i + 1]) for i in range(rows)])  # one token at a time, resident
    assert _relative(lazy(x, decode=decode), expected) < 1e-5
    assert lazy.experts.calls >= 1


class _Refuses:
    name = "picky"

    def __init__(self):
        self.asked = 0

    def refuse(self, tier, device):
        self.asked += 1
        return None if tier.name == "fp8" else f"tier {tier.name} not supported"


def test_backends_are_chosen_once_per_tier_and_device_with_reasons(monkeypatch):
    layout = CacheLayout(1, 80, 64, (), 0, device=torch.device("cpu"))
    tq4, f32, fp8 = (resolve_tier(layout, CacheConfig(name)) for name in ("tq4", "f32", "fp8"))
    cpu = torch.device("cpu")
    monkeypatch.setattr(attention_base, "BACKENDS", list(BACKENDS))
    monkeypatch.setattr(attention_base, "_CHOSEN", {})
    assert backend_for(tq4, cpu) is REFERENCE and backend_for(f32, cpu) is REFERENCE
    picky = register_backend(_Refuses())
    assert backend_for(fp8, cpu) is picky  # registered later: tried first
    assert backend_for(tq4, cpu) is REFERENCE  # refused there: the reference serves it
    asked = picky.asked
    assert backend_for(fp8, cpu) is picky and backend_for(tq4, cpu) is REFERENCE
    assert picky.asked == asked  # chosen once per (tier, device)
    with pytest.raises(ValueError, match="registered twice"):
        register_backend(_Refuses())
    monkeypatch.setattr(attention_base, "BACKENDS", [picky])
    monkeypatch.setattr(attention_base, "_CHOSEN", {})
    with pytest.raises(ValueError, match="no attention backend serves KV tier tq4 on cpu: picky: tier tq4"):
        backend_for(tq4, cpu)


class _Recording:
    """The torch reference for q4s caches only, recording what the model hands it."""

    name = "recording"

    def __init__(self):
        self.asked, self.calls = [], []

    def refuse(self, tier, device):
        self.asked.append((tier, device))
        return None if tier.name == "q4s" else "q4s only"

    def attend(self, query, reader, allowed, positions):
        self.calls.append(("attend", type(reader).__name__))
        return REFERENCE.attend(query, reader, allowed, positions)

    def attend_selected(self, query, reader, index, positions):
        self.calls.append(("attend_selected", type(reader).__name__))
        return REFERENCE.attend_selected(query, reader, index, positions)

    def attend_batch(self, query, readers, blocked):
        self.calls.append(("attend_batch", len(readers)))
        return REFERENCE.attend_batch(query, readers, blocked)

    def attend_padded(self, query, rows, blocked, kv_lora_rank):
        self.calls.append(("attend_padded", rows.shape[0]))
        return REFERENCE.attend_padded(query, rows, blocked, kv_lora_rank)


def test_the_model_asks_for_the_backend_of_its_caches_tier_and_device(ours, monkeypatch):
    """models/batch.py picks the backend with each cache's own KVTier and the rows' device; the
    backend's arithmetic is what runs (the reference's, here, so the logits are unchanged)."""
    monkeypatch.setattr(attention_base, "BACKENDS", list(BACKENDS))
    monkeypatch.setattr(attention_base, "_CHOSEN", {})
    model = ours("glm5-tiny")
    q4s = model.tier("q4s")
    prompt = torch.tensor([3, 5, 7, 9])
    expected = [model.forward(prompt, model.make_cache(t)) for t in (q4s, model.tier())]
    recording = register_backend(_Recording())
    got = [model.forward(prompt, model.make_cache(t)) for t in (q4s, model.tier())]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert (q4s, torch.device("cpu")) in [(t, d) for t, d in recording.asked]
    assert {t.name for t, _ in recording.asked} == {"q4s", "f32"}  # each cache's own tier
    assert recording.calls == [("attend", "PackedRows")] * model.cfg.num_layers  # the f32 cache: not here
    caches = [model.make_cache(q4s) for _ in range(2)]
    for cache, n in zip(caches, (3, 5), strict=True):
        model.forward(prompt[:n], cache)
    recording.calls.clear()
    model.decode_batch(torch.tensor([1, 2]), caches)
    assert recording.calls == [("attend_batch", 2)] * model.cfg.num_layers
