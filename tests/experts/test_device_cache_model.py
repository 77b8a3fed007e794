"""A model loaded through the runtime with a --vram-gb plan whose experts do not all fit in VRAM
(`LoadSpec.gpu_plan`, set here by hand on a CPU run: the CLI takes --vram-gb only with
--device cuda) serves its routed experts through the device cache, from resident host experts
(`pinned`) or from the disk store (`disk`), and generates the resident model's tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from latentkv.config import EngineConfig
from latentkv.engine.generate import generate
from latentkv.engine.sampling import SamplingParams
from latentkv.experts.device_cache import DeviceExperts
from latentkv.models.moe import MoE
from latentkv.runtime import build, device_cache_line, device_slots, load, resolve_load
from latentkv.streaming.gpu_plan import make_gpu_plan
from latentkv.weights import int4

PROMPT = [5, 17, 3, 99, 42, 7, 11, 2]


def _spec(name: str, home: str, slots: int):
    spec = resolve_load(name, EngineConfig(), max_model_len=64)
    plan = make_gpu_plan(spec.model_cfg, spec.directory, 1 << 40, 1 << 40, "f32", max_model_len=64)
    plan = dataclasses.replace(
        plan,
        expert_home=home,
        vram_experts=slots,
        staging_bytes=0,
        pinned_expert_bytes=3 * plan.expert_extent_bytes,  # the disk home's host cache: 3 experts
    )
    return dataclasses.replace(spec, gpu_plan=plan)


def _tokens(model, n: int = 12) -> list[int]:
    return generate(model, PROMPT, n, SamplingParams(), cache=model.make_cache()).tokens


@pytest.mark.parametrize("name", ["builtin:fixture", "builtin:tiny"])
@pytest.mark.parametrize(("home", "slots"), [("pinned", 3), ("pinned", 1), ("disk", 5)])
def test_generate_through_the_device_cache_gives_the_resident_tokens(
    name, home, slots, tmp_path, monkeypatch
):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))  # the disk home converts its store there
    want = _tokens(load(name, EngineConfig(), quiet=True).model)
    loaded = build(_spec(name, home, slots), quiet=True)
    try:
        stores = [b.mlp.experts for b in loaded.model.blocks if isinstance(b.mlp, MoE)]
        assert stores and all(isinstance(s, DeviceExperts) for s in stores)
        assert (loaded.streamer is not None) == (home == "disk")
        assert _tokens(loaded.model) == want
        cache = loaded.device_cache
        assert cache is not None and cache.slots == slots and len(cache.cache) <= slots
        s = cache.stats
        assert s.misses > 0 and s.asked == s.hits + s.misses
        assert "experts cached on cpu" in device_cache_line(cache)
    finally:
        loaded.close()


def test_logits_match_the_resident_model_closely():
    """The device cache computes the experts one by one (the MoE layer's `run` path); the resident
    model's small layers take the fused paths: the same sums in another order, within float32."""
    ids = torch.tensor(PROMPT)
    want_model = load("builtin:fixture", EngineConfig(), quiet=True).model
    loaded = build(_spec("builtin:fixture", "pinned", 2), quiet=True)
    with torch.inference_mode():
        want = want_model.forward(ids, want_model.make_cache(), all_logits=True)
        got = loaded.model.forward(ids, loaded.model.make_cache(), all_logits=True)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_device_slots_follow_the_plan():
    spec = _spec("builtin:fixture", "pinned", 3)
    plan = spec.gpu_plan
    assert device_slots(plan) == 3
    staged = dataclasses.replace(plan, staging_bytes=4 * plan.expert_extent_bytes + 1)
    assert device_slots(staged) == 7
    assert device_slots(dataclasses.replace(plan, vram_experts=0)) == 1


def test_resolve_load_plans_the_gpu_and_refuses_in_one_line(monkeypatch):
    """With --device cuda (torch's probe patched: resolve_load allocates nothing) --vram-gb is
    planned by the GPU planner: everything fits -> vram; a budget under the CUDA context does not
    fit; int4 experts cached in VRAM (converted in their slots) are planned, and refused only where
    this CPU's int4 layout is not understood (the host would hold portable nibbles)."""
    from latentkv.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = resolve_load("builtin:fixture", EngineConfig(device="cuda", vram_gb=64.0), max_model_len=64)
    assert spec.gpu_plan is not None and spec.gpu_plan.expert_home == "vram" and spec.plan is None
    with pytest.raises(UserError, match=r"--vram-gb 0\.5: dense weights, .* \(see `latentkv plan`\)"):
        resolve_load("builtin:fixture", EngineConfig(device="cuda", vram_gb=0.5), max_model_len=64)

    def tight(engine: EngineConfig) -> EngineConfig:
        """`engine` at a budget for its dense part, KV, activations and 12 experts of its format."""
        whole = resolve_load("builtin:fixture", engine, max_model_len=64).gpu_plan
        assert whole.expert_home == "vram"
        fixed = whole.dense_bytes + whole.kv_bytes + whole.activation_bytes
        return dataclasses.replace(engine, vram_gb=(fixed + 4 * 3 * whole.expert_extent_bytes) / 2**30)

    f32 = tight(EngineConfig(device="cuda", vram_gb=64.0, weight_dtype="f32"))
    plan = resolve_load("builtin:fixture", f32, max_model_len=64).gpu_plan
    assert plan.expert_home == "pinned" and device_slots(plan) == plan.vram_experts + 4  # + staging: 2k
    engine = tight(dataclasses.replace(f32, vram_gb=64.0, expert_dtype="int4"))
    in4 = resolve_load("builtin:fixture", engine, max_model_len=64).gpu_plan
    assert in4.expert_home == "pinned" and in4.expert_extent_bytes < plan.expert_extent_bytes  # sized as int4
    monkeypatch.setattr(int4, "layout", lambda: None)
    with pytest.raises(UserError, match="int4 experts cannot be cached in VRAM on this CPU"):
        resolve_load("builtin:fixture", engine, max_model_len=64)


def test_the_server_scheduler_reports_the_device_cache_on_metrics(tmp_path):
    """`serve`'s scheduler hands the cache's counters to /metrics (latentkv_device_expert_*), and
    its batched requests through the cache decode the resident model's tokens."""
    from latentkv.config import ServerConfig
    from latentkv.engine.request import Finished, Request
    from latentkv.engine.scheduler import Scheduler
    from latentkv.server.metrics import render

    want = _tokens(load("builtin:fixture", EngineConfig(), quiet=True).model, 5)
    loaded = build(_spec("builtin:fixture", "pinned", 2), quiet=True)
    config = ServerConfig(model="builtin:fixture", served_model_name="m", kv_dir=tmp_path)
    scheduler = Scheduler.for_server(config, loaded, 64)
    scheduler.start()
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=())
        handles = scheduler.submit_all([Request(PROMPT, params), Request(PROMPT[:3], params)])
        events = [list(h) for h in handles]
        assert all(isinstance(e[-1], Finished) for e in events)
        assert [t.token for t in events[0][:-1]] == want
        stats = scheduler.stats()
    finally:
        scheduler.shutdown()
    assert stats.device_experts["asked"] > 0 and stats.device_experts["slots"] == 2
    text = render("m", True, stats)
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"
    }
    assert samples["latentkv_device_expert_hits_total"] == stats.device_experts["hits"]
    assert samples["latentkv_device_expert_slots"] == 2
    assert "latentkv_device_expert" not in render("m", True, dataclasses.replace(stats, device_experts=None))
