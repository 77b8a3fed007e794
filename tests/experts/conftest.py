"""Shared by the device expert cache's tests."""

from __future__ import annotations

import copy

import pytest
import torch

from latentkv.experts.base import Expert
from latentkv.models.moe import MoE
from latentkv.models.registry import resolve
from latentkv.models.weights import load_model
from latentkv.weights.base import make_linear


@pytest.fixture(scope="module")
def layer():
    """builtin:fixture's first MoE layer, its router picking 4 of 8 experts (more per pass)."""
    model = load_model(resolve("builtin:fixture"), device=torch.device("cpu"))
    mlp = next(b.mlp for b in model.blocks if isinstance(b.mlp, MoE))
    stacked = mlp.experts.stacked
    experts = {
        e: Expert(make_linear(stacked.gate_up[e], "f32"), make_linear(stacked.down[e], "f32"))
        for e in range(stacked.gate_up.shape[0])
    }
    router = copy.copy(mlp.router)
    router.top_k = 4
    return router, mlp.shared, experts
