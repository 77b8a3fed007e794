"""Fixtures for the command tests: a clean KV environment and a model the rotated tiers refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from latentkv.eval import oracle

KV_ENV = ("KV8", "KV_TQ", "KV_TQ_POLAR")


@pytest.fixture(autouse=True)
def clean_kv_env(monkeypatch):
    """No seed-system KV switch leaks in from the caller's shell."""
    for name in KV_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def lora24_dir(tmp_path_factory) -> Path:
    """A tiny transformers GLM-5 whose latent is 24 wide: not a power of two (rope stays 8)."""
    import transformers

    from latentkv.tokenizer import byte_level_tokenizer_json

    directory = tmp_path_factory.mktemp("glm5-lora24")
    config = dict(oracle.SPECS["glm5-tiny"].config, kv_lora_rank=24)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GlmMoeDsaConfig(**config), dtype=torch.float32
    )
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return directory
