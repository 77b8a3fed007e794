"""The GGUF twin's pure parts (benchmarks/expert_twin.py, llamacpp_experts.py): the expert tensor
names llama.cpp's converter and files use, the projections read from a small int4 expert store
(against the store's own expert, against the seed's float weights, and through SwiGLU against
our expert's forward), and the llama-bench report parsing. Building a twin needs the llama.cpp
build and is not tested here."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from latentkv.experts.extent import expert_from_extent
from latentkv.experts.reader import ExpertReader
from latentkv.streaming.bench_model import bench_config, build_bench_model, random_expert

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
twin = importlib.import_module("expert_twin")

SMALL = {
    "hidden_size": 128,
    "intermediate_size": 96,
    "moe_intermediate_size": 96,  # not a multiple of int4's group (64): the padded columns go
    "vocab_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
}


def test_names():
    assert twin.hf_expert_name(3, 17, "up_proj") == "model.layers.3.mlp.experts.17.up_proj.weight"
    assert twin.gguf_expert_name(2, "gate_proj") == "blk.2.ffn_gate_exps.weight"
    assert twin.gguf_expert_name(1, "down_proj") == "blk.1.ffn_down_exps.weight"
    with pytest.raises(ValueError):
        twin.hf_expert_name(1, 0, "gate_up")
    assert twin.NEAREST["int4"] == "q4_K"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("twin") / "bench"
    cfg = bench_config(4, 2, 2, **SMALL)
    build_bench_model(out, cfg, "int4", seed=3, progress=False)
    return out / "experts", cfg


def test_projections_are_the_store_experts(store):
    directory, cfg = store
    D, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    with ExpertReader(directory, direct=None, threads=1) as r:
        shapes = twin.projection_shapes(r)
        assert shapes[1] == {"gate_proj": (inter, D), "up_proj": (inter, D), "down_proj": (D, inter)}
        for layer, e in [(1, 0), (2, 3)]:
            got = {p: twin.read_projection(r, layer, e, p, torch.float32) for p in twin.PROJECTIONS}
            ours = expert_from_extent(r.read(layer, e))  # the store's expert, as our engine runs it
            want = twin.expert_projections(ours)
            for p in twin.PROJECTIONS:
                assert got[p].shape == shapes[layer][p]
                assert torch.equal(got[p], want[p]), (layer, e, p)
            # the seed's float weights: int4 is within a few percent (relative RMS)
            orig = random_expert(cfg, layer, e, "f32", 3)
            gu, down = orig.gate_up.dequantize(), orig.down.dequantize()
            for p, w in (("gate_proj", gu[:inter]), ("up_proj", gu[inter:]), ("down_proj", down)):
                rel = (got[p] - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
                assert 0 < rel < 0.15, (layer, e, p, float(rel))
            # SwiGLU on the twin's three matrices (float64) vs our expert's forward
            x = torch.randn(5, D, generator=torch.Generator().manual_seed(layer * 10 + e))
            g64, u64, d64 = (got[p].double() for p in twin.PROJECTIONS)
            ref = (F.silu(x.double() @ g64.T) * (x.double() @ u64.T)) @ d64.T
            out = ours(x)
            assert torch.allclose(out.double(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


def test_projection_bf16_matches_float(store):
    directory, _cfg = store
    with ExpertReader(directory, direct=None, threads=1) as r:
        a = twin.read_projection(r, 2, 1, "down_proj", torch.float16)
        b = twin.read_projection(r, 2, 1, "down_proj", torch.float32)
    assert a.dtype == torch.float16
    assert torch.allclose(a.float(), b, rtol=1e-3, atol=1e-6)
