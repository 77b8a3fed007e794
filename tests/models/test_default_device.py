"""Nothing in a pass falls back to torch's default device: every tensor takes the model's device.

On a CPU-only machine a tensor made without `device=` lands on the CPU like the model, so such
a bug hides until a GPU run mixes devices. Here torch's default device is made `meta` (tensors
with shapes and no data) for the pass: a tensor made without a device would then be meta, and
the pass would fail or give other numbers. Every KV tier: the codecs' tables are made on the
host and copied to the rows' device (tests/kv/test_devices.py runs them on meta rows).
"""

from __future__ import annotations

import pytest
import torch

from latentkv.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig
from latentkv.engine.generate import generate
from latentkv.engine.sampling import SamplingParams
from latentkv.runtime import load

PROMPT = [5, 17, 3, 99, 42, 7]


def _batched(model, tier=None):
    caches = [model.make_cache(tier) for _ in range(3)]
    cpu = torch.device("cpu")
    prompts = [torch.tensor(p, device=cpu) for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
    with torch.inference_mode():
        first = model.prefill_batch(prompts, caches)
        step = model.decode_batch(torch.tensor([3, 4, 5], device=cpu), caches)
    return first, step


@pytest.mark.parametrize(
    ("name", "weights"), [("builtin:tiny", "f32"), ("builtin:tiny", "int4"), ("builtin:fixture", "f32")]
)
def test_a_pass_makes_nothing_on_the_default_device(name, weights):
    model = load(name, EngineConfig(weight_dtype=weights, cache=CacheConfig("f32")), quiet=True).model
    want = generate(model, PROMPT, 6, SamplingParams(), cache=model.make_cache()).tokens
    want_batched = _batched(model)
    with torch.device("meta"):
        got = generate(model, PROMPT, 6, SamplingParams(), cache=model.make_cache()).tokens
        got_batched = _batched(model)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_batched, want_batched, strict=True))


def test_the_meta_default_catches_a_tensor_made_without_a_device():
    """The check can fail: one tensor made without `device=` (here the prompt, made on meta:
    no values) and the pass computes other logits."""
    model = load("builtin:tiny", EngineConfig(), quiet=True).model
    with torch.inference_mode():
        want = model.forward(torch.tensor(PROMPT, device=torch.device("cpu")), model.make_cache())
        with torch.device("meta"):
            got = model.forward(torch.tensor(PROMPT), model.make_cache())
    assert not torch.equal(got, want)


def _served(model, monkeypatch, meta: bool, speculative=None) -> list[list[int]]:
    """Four requests through the scheduler (greedy, seeded sampling with logprobs), its worker
    thread run with the default device set to meta when `meta`."""
    from latentkv.engine.request import Request
    from latentkv.engine.scheduler import Scheduler

    if meta:
        work = Scheduler._work

        def on_meta(self):
            with torch.device("meta"):  # a mode of this thread: the worker's own
                work(self)

        monkeypatch.setattr(Scheduler, "_work", on_meta)
    scheduler = Scheduler(model, model.tier("f32"), speculative=speculative)
    scheduler.start()
    try:
        params = [
            SamplingParams(max_tokens=6),
            SamplingParams(max_tokens=5, temperature=0.9, seed=3, logprobs=2),
            SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=5),
            SamplingParams(max_tokens=6, prompt_logprobs=1),
        ]
        handles = [scheduler.submit(Request(PROMPT[: 3 + i], p)) for i, p in enumerate(params)]
        outs = [list(h) for h in handles]
    finally:
        scheduler.shutdown()
        monkeypatch.undo()
    assert all(out[-1].reason == "length" for out in outs), outs
    return [[(e.token, e.logprob) for e in out[:-1]] for out in outs]


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "mtp-drafting"])
def test_the_scheduler_makes_nothing_on_the_default_device(monkeypatch, drafting):
    from latentkv.engine.speculative import SpeculativeConfig

    model = load("builtin:fixture", EngineConfig(), quiet=True).model
    spec = SpeculativeConfig(draft_tokens=2, adaptive=False) if drafting else None
    assert _served(model, monkeypatch, meta=True, speculative=spec) == _served(
        model, monkeypatch, meta=False, speculative=spec
    )


@pytest.fixture(scope="module")
def tiny():
    return load("builtin:tiny", EngineConfig(), quiet=True).model


@pytest.mark.parametrize("tier", [t for t in KV_CACHE_DTYPES if t != "f32"])
def test_every_tier_makes_nothing_on_the_default_device(tiny, tier):
    """Every KV tier's codecs (their tables, every intermediate) take the rows' device: a pass
    and a batched step with torch's default device made meta give the same tokens and logits."""
    kv = tiny.tier(tier)
    want = generate(tiny, PROMPT, 4, SamplingParams(), cache=kv.make_cache()).tokens
    want_batched = _batched(tiny, kv)
    with torch.device("meta"):
        got = generate(tiny, PROMPT, 4, SamplingParams(), cache=kv.make_cache()).tokens
        got_batched = _batched(tiny, kv)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_batched, want_batched, strict=True))
