"""The benchmark model that does not fit its budget: GLM-5's real widths, many experts, random
weights, its routed experts written straight into an expert store (never a float checkpoint of
them: one expert in memory at a time).

Default: 1 dense + 3 MoE layers, 64 experts top-8 (about 7B parameters; int4 experts about
4 GB, one expert about 19.5 MB, about 470 MB of expert reads per cold token). Random routers
have no locality, so this is the worst case for any cache.

    python benchmarks/build_expert_model.py OUT [--experts 64] [--moe-layers 3] [--format int4]
"""

from __future__ import annotations

from pathlib import Path

import torch

from latentkv.experts.base import Expert
from latentkv.experts.extent import codec_for
from latentkv.experts.store_file import Manifest
from latentkv.models.loader import Checkpoint
from latentkv.models.synthetic import SLICE_CONFIG, write_random_checkpoint
from latentkv.streaming.convert import write_store
from latentkv.streaming.planner import EXPERTS_DIR
from latentkv.weights.base import make_linear

INIT_STD = 0.02  # as the dense weights of `models.synthetic`


def bench_config(experts: int = 64, moe_layers: int = 3, top_k: int = 8, **overrides) -> dict:
    """GLM-5 widths (the slice's), 1 dense layer then `moe_layers` MoE layers."""
    layers = 1 + moe_layers
    cfg = dict(SLICE_CONFIG)
    cfg.update(
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        mlp_layer_types=["dense"] + ["sparse"] * moe_layers,
        indexer_types=["full"] * layers,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
    )
    cfg.update(overrides)
    return cfg


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def random_expert(cfg: dict, layer: int, e: int, fmt: str, seed: int) -> Expert:
    """Expert e of `layer`, drawn from its own seed (the same whichever order they are built in)."""
    D, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer) * 65_537 + e)
    gate_up = torch.randn(2 * I, D, generator=g) * INIT_STD
    down = torch.randn(D, I, generator=g) * INIT_STD
    return Expert(make_linear(gate_up, fmt), make_linear(down, fmt))


def build_bench_model(
    out: str | Path, cfg: dict, fmt: str = "int4", seed: int = 0, progress: bool = True
) -> Manifest:
    """config.json + safetensors of everything but the routed experts, and OUT/experts/ (format
    `fmt`) whose fingerprint is the checkpoint's."""
    out = Path(out)
    codec_for(fmt)  # refuse a format that cannot stream before writing gigabytes
    write_random_checkpoint(cfg, out, seed, exclude=_is_routed_expert)
    fingerprint = Checkpoint(out).fingerprint()
    sparse = [i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "sparse"]
    E = cfg["n_routed_experts"]
    layers = [(i, E, lambda e, i=i: random_expert(cfg, i, e, fmt, seed)) for i in sparse]
    meta = {
        "model_type": cfg["model_type"],
        "weight_format": fmt,
        "source": "random (bench_model)",
        "seed": seed,
    }
    return write_store(out / EXPERTS_DIR, fingerprint, layers, meta, replace=True, progress=progress)
