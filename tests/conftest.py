"""Shared fixtures: the oracle's tiny checkpoints (built once per session), our models and transformers'.

Every checkpoint comes from a fixed seed through transformers itself (`oracle.build`), except
glm5-tiny, which is the bundled builtin:tiny (tests/eval/test_oracle.py checks that the bundled
weights are exactly what `oracle.build` makes). Nothing here touches the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from latentkv.eval import oracle
from latentkv.models.registry import builtin_path

SPEC_NAMES = list(oracle.SPECS)


def pytest_configure(config):
    # The tiny models' ops take microseconds: a second thread only adds synchronisation, and on a
    # shared machine a starved worker thread makes each op wait for it (decode ran 50x slower).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where a Triton kernel's tensors live in a test: the CPU under triton's interpreter
    (TRITON_INTERPRET=1, set by the kernel tests' modules), else the GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device")
    return "cuda"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The bundled builtin:tiny checkpoint (GLM-5 architecture, the glm5-tiny oracle spec)."""
    return builtin_path("tiny")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tiny_dir) -> Callable[[str], Path]:
    """name -> directory of that oracle spec's checkpoint, built on first use."""
    built: dict[str, Path] = {"glm5-tiny": tiny_dir}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = oracle.build(oracle.SPECS[name], tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def ours(checkpoint) -> Callable[[str], object]:
    """name -> our f32 Model for that spec, loaded once. Tests must not mutate it."""
    from latentkv.models.weights import load_model

    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(checkpoint(name), device="cpu")
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def hf(checkpoint) -> Callable[[str], object]:
    """name -> transformers' model for that spec (float32, eval), loaded once."""
    import transformers

    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint(name), dtype=torch.float32
            ).eval()
        return loaded[name]

    return get


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [S, vocab] for one sequence, without a cache."""
    with torch.no_grad():
        return model(ids[None], use_cache=False).logits[0].float()


def random_ids(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    """Fresh token ids (never 0/1, the tiny models' BOS/EOS) from a seed of the test's own."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g)


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's recipe: per tile, s = amax / 448, w_fp8 = w / s; returns (w_fp8, scale_inv = s)."""
    out_dim, in_dim = w.shape
    bo, bi = block
    scales = torch.empty(-(-out_dim // bo), -(-in_dim // bi), dtype=torch.float32)
    q = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].float()
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scales[i, j] = s
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (tile / s).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_reference64(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Float64, tile by tile."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bo, bi = block
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].double()
            out[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = tile * scales[i, j].double()
    return out


@pytest.fixture(scope="session")
def helpers():
    """Plain helper functions, as a fixture so test modules need no package imports."""

    class Helpers:
        hf_logits = staticmethod(hf_logits)
        random_ids = staticmethod(random_ids)
        read_config = staticmethod(read_config)
        quantize_fp8_blocks = staticmethod(quantize_fp8_blocks)
        dequantize_reference64 = staticmethod(dequantize_reference64)

    return Helpers


@pytest.fixture
def torch_ops(monkeypatch):
    """Weight formats built under this fixture decode with torch's int8/int4 ops, as where
    latentkv's own kernels cannot be built (no C++ compiler): the fallback path, and the op's
    packed layout for int4."""
    from latentkv import native

    monkeypatch.setattr(native, "kernels", lambda: None)


@pytest.fixture(params=["native", "torch"])
def decode_kernels(request):
    """Run the test with latentkv's kernels (where they build here) and with torch's ops."""
    if request.param == "torch":
        request.getfixturevalue("torch_ops")
    else:
        from latentkv import native

        if native.kernels() is None:
            pytest.skip(f"latentkv's kernels are not built here: {native.unavailable()}")
    return request.param


def fixture_moe(top_k: int):
    """builtin:fixture's first MoE layer as (the layer, its router picking `top_k` experts, its
    experts one by one as f32 Linears): what the expert-store tests route through."""
    import copy

    from latentkv.experts.base import Expert
    from latentkv.models.moe import MoE
    from latentkv.models.registry import resolve
    from latentkv.models.weights import load_model
    from latentkv.weights.base import make_linear

    model = load_model(resolve("builtin:fixture"), device=torch.device("cpu"))
    mlp = next(b.mlp for b in model.blocks if isinstance(b.mlp, MoE))
    stacked = mlp.experts.stacked
    experts = {
        e: Expert(make_linear(stacked.gate_up[e], "f32"), make_linear(stacked.down[e], "f32"))
        for e in range(stacked.gate_up.shape[0])
    }
    router = copy.copy(mlp.router)
    router.top_k = top_k
    return mlp, router, experts
