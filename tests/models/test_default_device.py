"""Nothing in a pass falls back to torch's default device: every tensor takes the model's device.

On a CPU-only machine a tensor made without `device=` lands on the CPU like the model, so such
a bug hides until a GPU run mixes devices. Here torch's default device is made `meta` (tensors
with shapes and no data) for the pass: a tensor made without a device would then be meta, and
the pass would fail or give other numbers. The f32 KV tier only: the other tiers' codecs still
build their tables on the default device (kv/codecs: fp8's, the rotations', the block tables').
"""

from __future__ import annotations

import pytest
import torch

from latentkv.config import CacheConfig, EngineConfig
from latentkv.engine.generate import generate
from latentkv.engine.sampling import SamplingParams
from latentkv.runtime import load

PROMPT = [5, 17, 3, 99, 42, 7]


def _batched(model):
    caches = [model.make_cache() for _ in range(3)]
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
