"""The benchmark model builder, on small widths: the checkpoint holds no routed expert, the
expert store holds every one under the checkpoint's fingerprint, and each expert is exactly the
one its seed draws."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from latentkv.experts.reader import ExpertReader
from latentkv.experts.streamed import ExpertStreamer, StreamConfig
from latentkv.models.loader import Checkpoint
from latentkv.streaming.bench_model import bench_config, random_expert

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
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
SCRIPT = Path(__file__).parents[2] / "benchmarks" / "build_expert_model.py"


def test_build_writes_dense_checkpoint_and_every_expert(tmp_path):
    out = tmp_path / "bench"
    spec = importlib.util.spec_from_file_location("build_expert_model", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = [str(out), "--experts", "6", "--moe-layers", "2", "--top-k", "2", "--format", "f32"]
    assert script.main([*argv, "--config", json.dumps(SMALL)]) == 0
    assert script.main([str(tmp_path / "x"), "--format", "nope", "--config", json.dumps(SMALL)]) == 2
    ckpt = Checkpoint(out)
    assert not [n for n in ckpt.keys() if ".mlp.experts." in n]  # noqa: SIM118
    assert "model.layers.1.mlp.gate.weight" in ckpt and "model.layers.0.mlp.gate_proj.weight" in ckpt
    cfg = bench_config(6, 2, 2, **SMALL)
    with ExpertReader(out / "experts", ckpt.fingerprint()) as r:
        assert sorted(r.manifest.layers) == [1, 2]
        assert all(e.n_experts == 6 for e in r.manifest.layers.values())
    s = ExpertStreamer(out / "experts", ckpt.fingerprint(), StreamConfig(budget=0, history=False))
    got = s.layer(2).get([5])[5]
    want = random_expert(cfg, 2, 5, "f32", 0)
    assert torch.equal(got.gate_up.dequantize(), want.gate_up.dequantize())
    assert torch.equal(got.down.dequantize(), want.down.dequantize())
    assert not torch.equal(want.down.dequantize(), random_expert(cfg, 2, 4, "f32", 0).down.dequantize())
    s.close()
