"""benchmarks/routing_trace.py and `benchmarks/experts.py --routing-trace`: a trace records the
routing and the prefetch of a trained model (builtin:fixture), and replayed on a random benchmark
model the streamer is asked for exactly the trace's experts and measures the trace's recall."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from tests.experts.test_bench_model import SMALL  # the benchmark model's small widths

from latentkv.experts.streamed import StreamConfig
from latentkv.models.registry import builtin_path
from latentkv.models.weights import load_model
from latentkv.streaming.attach import load_streamed
from latentkv.tokenizer import Tokenizer

BENCH = Path(__file__).parents[2] / "benchmarks"
TOKENS = 48


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rt():
    return _script("routing_trace")


@pytest.fixture(scope="module")
def trace(rt):
    fixture = builtin_path("fixture")
    ids = Tokenizer(fixture).encode((fixture / "heldout.txt").read_text(encoding="utf-8")[:3000])[:TOKENS]
    return rt.record(fixture, ids)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """A random benchmark model shaped like the fixture's routing: 3 MoE layers, 8 experts top-2."""
    out = tmp_path_factory.mktemp("bench") / "model"
    build = _script("build_expert_model")
    argv = [str(out), "--experts", "8", "--moe-layers", "3", "--top-k", "2", "--format", "f32"]
    assert build.main([*argv, "--config", json.dumps(SMALL)]) == 0
    return out


def test_the_trace_holds_the_models_own_routing(trace):
    """Chosen experts per token and layer equal the routers' picks in a plain decode of the same
    tokens (the resident model, no wiring); the first MoE layer has no early prediction."""
    model = load_model(builtin_path("fixture"), load_mtp=False, device="cpu")
    picks: dict[int, list[list[int]]] = {}
    for i in trace["moe_layers"]:
        mlp = model.blocks[i].mlp
        router = mlp.router

        def spy(x, router=router, i=i):
            idx, w = router(x)
            picks.setdefault(i, []).append(sorted(idx[0].tolist()))
            return idx, w

        mlp.router = spy
    cache = model.make_cache(model.tier("f32"))
    with torch.inference_mode():
        for t in trace["tokens"]:
            model.forward(torch.tensor([t]), cache)
    for i in trace["moe_layers"]:
        row = trace["layers"][str(i)]
        assert [sorted(e) for e in row["experts"]] == picks[i]
        assert all(len(p) == trace["top_k"] for p in row["late"])
    first = str(trace["moe_layers"][0])
    assert all(p is None for p in trace["layers"][first]["early"])
    assert all(p is not None for p in trace["layers"][str(trace["moe_layers"][1])]["early"])


def test_replay_asks_for_the_traces_experts_and_measures_its_recall(rt, trace, bench):
    """Replayed on the random bench model, each pass asks the streamer for the trace's experts (the
    usage history counts them), and the streamer's own recall equals the trace's recall computed
    from its predictions: the replay prefetches what the trained model's prefetch would."""
    model, streamer = load_streamed(
        bench, bench / "experts", StreamConfig(budget=1 << 30, history=True), device="cpu"
    )
    try:
        used = rt.attach(model, trace)
        cache = model.make_cache(model.tier("f32"))
        with torch.inference_mode():
            for t in range(TOKENS):
                model.forward(torch.tensor([t % 100]), cache)
        snap = streamer.snapshot()
        counts = streamer.history.counts
    finally:
        streamer.close()
    assert used == trace["moe_layers"]
    bench_layers = sorted(counts)
    for b, t in zip(bench_layers, used, strict=True):
        want = Counter(e for row in trace["layers"][str(t)]["experts"] for e in row)
        assert {e: n for e, n in enumerate(counts[b]) if n} == dict(want)
    hits = total = 0
    for t in used:
        row = trace["layers"][str(t)]
        for asked, early, late in zip(row["experts"], row["early"], row["late"], strict=True):
            hits += len(set(asked) & (set(early or []) | set(late or [])))
            total += len(asked)
    assert snap["recalled"] == hits and snap["predicted"] == total


def test_experts_bench_replays_a_trace(rt, trace, bench, tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    experts = _script("experts")
    out = tmp_path / "run.json"
    argv = [str(bench), "--no-limit", "--no-drop-caches", "--fractions", "0.25", "--tokens", "4"]
    assert experts.main([*argv, "--routing-trace", str(path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["routing_trace"]["layers_used"] == trace["moe_layers"]
    assert result["runs"][0]["decode"]["asked"] == 4 * 3 * trace["top_k"]
    assert "routing: trace" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    assert experts.main([*argv, "--routing-trace", str(bad)]) == 2
    assert "is not a routing trace" in capsys.readouterr().err


def test_stats_measure_skew_and_recall(rt):
    row = {
        "experts": [[0, 1], [0, 2], [0, 1], [0, 3]],
        "weights": [[0.5, 0.5]] * 4,
        "early": [None, [0, 2], [0, 5], [6, 7]],
        "late": [[0, 1], [0, 2], [0, 1], [0, 7]],
    }
    s = rt.layer_stats(row, 4)
    assert s["recall_early"] == pytest.approx(3 / 6) and s["recall_late"] == pytest.approx(7 / 8)
    assert s["recall"] == pytest.approx(7 / 8) and s["last_token_recall"] == pytest.approx(3 / 6)
    assert s["max_over_mean"] == pytest.approx(4 / 8 * 4) and s["unused"] == 0
