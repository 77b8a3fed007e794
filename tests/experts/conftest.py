"""Shared by the device expert cache's tests."""

from __future__ import annotations

import pytest
from tests.conftest import fixture_moe


@pytest.fixture(scope="module")
def layer():
    """builtin:fixture's first MoE layer, its router picking 4 of 8 experts (more per pass)."""
    mlp, router, experts = fixture_moe(top_k=4)
    return router, mlp.shared, experts
