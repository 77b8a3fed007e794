"""The GGUF twin's pure parts (benchmarks/expert_twin.py, llamacpp_experts.py): the expert tensor
names llama.cpp's converter and files use, the projections read from a small int4 expert store
(against the store's own expert, against the seed's float weights, and through SwiGLU against
our expert's forward), and the llama-bench report parsing. Building a twin needs the llama.cpp
build and is not tested here."""

from __future__ import annotations

import importlib
import importlib.util
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


lce = importlib.import_module("llamacpp_experts")

BENCH_JSON = """load_backend: loaded CPU backend
[
  {"model_type": "glm-dsa 7B", "n_prompt": 16, "n_gen": 0, "avg_ts": 41.5, "stddev_ts": 0.0},
  {"model_type": "glm-dsa 7B", "n_prompt": 0, "n_gen": 32, "avg_ts": 0.25, "stddev_ts": 0.0}
]
"""


def _run(**kw):
    base = {"returncode": 0, "timed_out": False, "peak": 5 << 30, "oom_kills": 0, "seconds": 9.0}
    return {**base, "stdout": BENCH_JSON, "stderr": "", **kw}


def test_parse_bench_takes_generation_speed():
    got = lce.parse_bench(BENCH_JSON)
    assert got == {"tok_s": 0.25, "pp_tok_s": 41.5, "n_gen": 32, "n_prompt": 16}
    with pytest.raises(ValueError):
        lce.parse_bench('[{"n_prompt": 16, "n_gen": 0, "avg_ts": 3.0}]')
    with pytest.raises(ValueError):
        lce.parse_bench("error: failed to load model")


def test_outcome_reports_every_ending():
    assert lce.outcome(_run())["status"] == "ok" and lce.outcome(_run())["tok_s"] == 0.25
    killed = lce.outcome(_run(returncode=-9, oom_kills=1, stdout=""))
    assert killed["status"] == "oom-killed" and killed["tok_s"] is None
    slow = lce.outcome(_run(returncode=-9, timed_out=True, stdout=""))
    assert slow["status"] == "timeout" and slow["tok_s"] is None
    failed = lce.outcome(_run(returncode=1, stdout="", stderr="GGML_ASSERT(x) failed"))
    assert failed["status"] == "failed" and "GGML_ASSERT" in failed["error"]
    garbled = lce.outcome(_run(stdout="[{"))
    assert garbled["status"] == "failed"


def test_ratio_and_table():
    assert lce.ratio(0.5, 0.25) == 2.0
    assert lce.ratio(None, 0.25) is None and lce.ratio(0.5, None) is None
    ok = {"label": "0.25 of experts", "limit": 6 << 30, "tok_s": 0.5, "ours_vs_llamacpp": 2.0}
    ok["llamacpp"] = {**lce.outcome(_run())}
    bad = {"label": "0.125 of experts", "limit": 5 << 30, "tok_s": 0.4, "ours_vs_llamacpp": None}
    bad["llamacpp"] = lce.outcome(_run(returncode=-9, oom_kills=2, stdout=""))
    lines = lce.table([ok, bad]).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| 0.25 of experts | 6.00 | ok (9 s) | 5.00 | 0.250 | 0.500 | 2.00x |"
    assert "oom-killed" in lines[3] and lines[3].endswith("| - | 0.400 | - |")


def test_bench_cmd_keeps_mmap_and_no_repack(monkeypatch, tmp_path):
    monkeypatch.setattr(lce.llamacpp, "binary", lambda name: tmp_path / name)
    cmd = lce.bench_cmd(tmp_path / "t.gguf", 32, 16, 2)
    assert cmd[0].endswith("llama-bench")
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert flags["-lm"] == "mmap" and flags["--repack"] == "0" and flags["-t"] == "2"
    assert flags["-n"] == "32" and flags["-p"] == "16" and flags["-o"] == "json"


def test_experts_bench_refuses_a_missing_twin(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_experts_script", Path(__file__).parents[2] / "benchmarks" / "experts.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["builtin:tiny", "--no-limit", "--llamacpp", str(tmp_path / "none.gguf")]
    assert script.main(argv) == 2
    assert "no GGUF twin" in capsys.readouterr().err
