"""runtime: a load resolves the flags once (LoadSpec, no weight read), then builds downward."""

from __future__ import annotations

import pytest
import torch

from latentkv.config import CacheConfig, EngineConfig
from latentkv.errors import UserError
from latentkv.models import loader
from latentkv.runtime import build, load, resolve_load


def test_resolve_load_decides_everything_without_reading_a_weight(monkeypatch):
    def no_reads(*args, **kwargs):
        raise AssertionError("resolve_load opened the checkpoint")

    monkeypatch.setattr(loader.Checkpoint, "__init__", no_reads)
    spec = resolve_load(
        "builtin:tiny", EngineConfig(weight_dtype="bf16", expert_dtype="int8"), max_num_seqs=3
    )
    assert spec.device == torch.device("cpu") and spec.plan is None
    assert (spec.weight_format, spec.expert_format) == ("bf16", "int8")
    assert spec.model_cfg.model_type == "glm_moe_dsa" and (spec.directory / "config.json").is_file()
    assert spec.max_model_len == min(spec.model_cfg.max_position_embeddings, 4096) and spec.max_num_seqs == 3


def test_resolve_load_refuses_before_any_weight_is_read(monkeypatch):
    monkeypatch.setattr(loader.Checkpoint, "__init__", lambda *a, **k: pytest.fail("read the checkpoint"))
    with pytest.raises(UserError, match="unknown weight format 'fp4'"):
        resolve_load("builtin:tiny", EngineConfig(expert_dtype="fp4"))
    with pytest.raises(UserError, match="unknown builtin model 'nope'"):
        resolve_load("builtin:nope", EngineConfig())


def test_build_is_load():
    """load = build(resolve_load(...)): the same model, logit for logit."""
    ids = torch.tensor([3, 1, 4, 1, 5])
    engine = EngineConfig(cache=CacheConfig("fp8"))
    models = [
        load("builtin:tiny", engine, quiet=True).model,
        build(resolve_load("builtin:tiny", engine), True).model,
    ]
    with torch.inference_mode():
        a, b = (m.forward(ids, m.make_cache(m.tier(engine.cache)), all_logits=True) for m in models)
    assert torch.equal(a, b)
