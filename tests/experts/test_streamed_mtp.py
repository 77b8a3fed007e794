"""MTP drafting with experts streamed from disk: the MTP layer's routed experts are one more
layer of the expert store (converted, planned and cached with the others), greedy output is
token-identical with drafting on and off at a budget of one expert per layer (single sequence
and batched), and a store converted before the MTP layer's experts were written is refused in
one line when drafting is asked.

Two models: builtin:fixture (a trained MTP layer, fused expert tensors: drafts mostly right) and
builtin:tiny's shape with random weights and a random MTP layer (per-expert tensors, drafts
mostly wrong: many rollbacks).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from latentkv.cli import main
from latentkv.config import EngineConfig, ModelConfig
from latentkv.engine.generate import generate
from latentkv.engine.sampling import SamplingParams
from latentkv.engine.scheduler import Finished, Request, Scheduler
from latentkv.engine.scheduler import SamplingParams as RequestSampling
from latentkv.engine.speculative import SpeculativeConfig
from latentkv.errors import UserError
from latentkv.experts.extent import expert_from_extent
from latentkv.experts.history import UsageHistory
from latentkv.experts.reader import SPARE_BUFFERS, ExpertReader
from latentkv.experts.store_file import read_manifest
from latentkv.experts.streamed import StreamConfig
from latentkv.models.loader import Checkpoint
from latentkv.models.registry import builtin_path, resolve
from latentkv.models.synthetic import write_random_checkpoint
from latentkv.models.weights import load_model
from latentkv.streaming.attach import default_store_dir, load_streamed
from latentkv.streaming.convert import convert_experts
from latentkv.streaming.planner import make_plan

N_TOKENS = 20


@pytest.fixture(scope="module", params=["fixture", "random-tiny"])
def converted(request, tmp_path_factory):
    """(model folder, its expert store, a prompt) for each model."""
    if request.param == "fixture":
        model_dir = resolve("builtin:fixture")
        text = (model_dir / "heldout.txt").read_text(encoding="utf-8")[:3000]
        from latentkv.tokenizer import Tokenizer

        prompt = Tokenizer(model_dir).encode(text)[100:140]
    else:
        cfg = json.loads((builtin_path("tiny") / "config.json").read_text())
        cfg.update(num_nextn_predict_layers=1, index_topk=8)
        model_dir = write_random_checkpoint(cfg, tmp_path_factory.mktemp("tiny-mtp"), seed=29)
        prompt = [5, 17, 99, 3, 42, 7, 11, 64, 2, 8]
    store = tmp_path_factory.mktemp("store") / "experts"
    convert_experts(model_dir, store, "f32")
    return model_dir, store, prompt


def _streamed(model_dir, store, experts_per_layer: int = 1):
    """The model with every MoE layer's experts (the MTP layer's too) streamed from `store`,
    with a cache of `experts_per_layer` experts per store layer."""
    m = read_manifest(store)
    stride = max(e.layout.stride for e in m.layers.values())
    config = StreamConfig(budget=experts_per_layer * len(m.layers) * stride, history=False)
    return load_streamed(model_dir, store, config, device="cpu")


def _tokens(model, prompt, spec=None, tier="f32") -> tuple[list[int], object]:
    out = generate(
        model,
        prompt,
        N_TOKENS,
        SamplingParams(),
        cache=model.make_cache(model.tier(tier)),
        stop_ids=(),
        speculative=spec,
    )
    return out.tokens, out.stats.speculative


def test_convert_writes_the_mtp_layers_experts(converted):
    """Layer num_hidden_layers is in the store, and each of its experts computes what the
    checkpoint's tensors compute (float64 reference)."""
    model_dir, store, _ = converted
    cfg = ModelConfig.from_hf(model_dir)
    manifest = read_manifest(store)
    mtp = cfg.num_layers
    main_layers = {i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"}
    assert set(manifest.layers) == main_layers | {mtp}
    assert manifest.meta["mtp_layer"] == mtp
    ckpt = Checkpoint(model_dir)
    p = f"model.layers.{mtp}.mlp.experts."
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    I = cfg.moe_intermediate_size
    with ExpertReader(store, ckpt.fingerprint()) as reader:
        for e in range(cfg.n_routed_experts):
            if p + "gate_up_proj" in ckpt:
                gate_up, down = ckpt.get(p + "gate_up_proj")[e], ckpt.get(p + "down_proj")[e]
            else:
                q = f"{p}{e}."
                gate_up = torch.cat([ckpt.get(q + "gate_proj.weight"), ckpt.get(q + "up_proj.weight")])
                down = ckpt.get(q + "down_proj.weight")
            h = x.double() @ gate_up.double().T
            want = (F.silu(h[:, :I]) * h[:, I:]) @ down.double().T
            got = expert_from_extent(reader.submit(mtp, e).result())(x)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_streamed_draft_layer_matches_the_resident_one(converted):
    """The MTP layer's logits with its experts streamed (a one-expert-per-layer cache) against the
    resident model's, on the same hidden states (fused vs per-expert paths: tolerance 1e-4)."""
    model_dir, store, prompt = converted
    resident = load_model(model_dir, device="cpu")
    model, streamer = _streamed(model_dir, store)
    try:
        ids = torch.tensor(prompt)
        outs = []
        for m in (resident, model):
            _, h = m.forward(ids, m.make_cache(m.tier("f32")), hidden=True)
            outs.append(m.draft(ids[1:], h[:-1], m.make_draft_cache(m.tier("f32")), 0)[0])
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        t = streamer.snapshot()
        assert t["draft_asked"] > 0 and t["resident_bytes"] <= t["budget"]
    finally:
        streamer.close()


@pytest.mark.parametrize(
    ("draft_tokens", "tier"), [(1, "f32"), (3, "f32"), (2, "q8s"), (2, "q4s")]
)  # q8s and q4s: the tiers the README recommends
def test_streamed_drafting_is_token_identical(converted, draft_tokens, tier):
    model_dir, store, prompt = converted
    reference, _ = _tokens(load_model(model_dir, device="cpu"), prompt, tier=tier)  # resident, no drafting
    model, streamer = _streamed(model_dir, store)
    try:
        plain, _ = _tokens(model, prompt, tier=tier)
        spec = SpeculativeConfig(draft_tokens=draft_tokens, adaptive=False)
        drafted, stats = _tokens(model, prompt, spec, tier=tier)
        t = streamer.snapshot()
    finally:
        streamer.close()
    assert plain == reference
    assert drafted == plain
    assert stats.rounds > 0 and t["draft_asked"] > 0  # the MTP layer's experts were streamed
    assert t["resident_bytes"] <= t["budget"]
    if "fixture" in str(model_dir):  # a trained MTP layer computed on streamed experts: drafts land
        assert stats.acceptance[0] > 0.2


@pytest.mark.parametrize("tier", ["f32", pytest.param("tq4-r8", marks=pytest.mark.slow)])
def test_streamed_drafting_batched_is_token_identical(converted, tier):
    """The scheduler verifying three sequences' drafts in one pass, experts streamed at one per
    layer: each sequence's tokens are those it gets alone without drafting."""
    model_dir, store, prompt = converted
    prompts = [prompt, prompt[3:17], prompt[-6:]]
    model, streamer = _streamed(model_dir, store)
    try:
        alone = [_tokens(model, p, tier=tier)[0] for p in prompts]
        scheduler = Scheduler(
            model,
            model.tier(tier),
            max_num_seqs=3,
            speculative=SpeculativeConfig(draft_tokens=2, adaptive=False),
        )
        scheduler.start()
        try:
            handles = [
                scheduler.submit(Request(p, RequestSampling(max_tokens=N_TOKENS, temperature=0.0)))
                for p in prompts
            ]
            batched = []
            for handle in handles:
                events = list(handle)
                assert isinstance(events[-1], Finished) and not events[-1].error
                batched.append([e.token for e in events[:-1]])
            stats = scheduler.stats().speculative
        finally:
            scheduler.shutdown()
        t = streamer.snapshot()
    finally:
        streamer.close()
    assert batched == alone
    assert stats["verify_steps"] > 0 and t["draft_asked"] > 0
    assert t["resident_bytes"] <= t["budget"]


def test_plan_counts_the_mtp_layers_experts(capsys):
    d = resolve("builtin:fixture")
    cfg = ModelConfig.from_hf(d)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    p = make_plan(cfg, d, 8 << 30)
    extent = p.expert_extent_bytes
    assert (p.moe_layers, p.mtp_layers) == (3, 1)
    assert p.experts_total == 4 * E and p.expert_bytes == 4 * E * extent
    assert p.draft_cold_bytes_per_token == k * extent
    assert p.cold_bytes_per_token == k * 3 * extent  # plain decoding never reads the MTP layer
    # The same budget: a cache holding every main layer's expert misses the MTP layer's.
    fixed = p.dense_bytes + p.kv_bytes + p.activation_bytes + p.working_bytes
    tight = make_plan(cfg, d, fixed + 3 * E * extent)
    assert tight.cached_experts == 3 * E and not tight.all_experts_fit
    assert make_plan(cfg, d, fixed + 4 * E * extent).all_experts_fit
    # A verify pass of N + 1 tokens per sequence widens the working set.
    spare = SPARE_BUFFERS  # free read buffers kept for reuse
    assert p.working_bytes == (min(E, k) + k + spare) * extent
    assert make_plan(cfg, d, 8 << 30, draft_tokens=2).working_bytes == (min(E, 3 * k) + k + spare) * extent
    tiny = resolve("builtin:tiny")
    assert make_plan(ModelConfig.from_hf(tiny), tiny, 8 << 30).mtp_layers == 0

    assert main(["plan", "builtin:fixture", "--ram-gb", "1"]) == 0
    assert "MTP draft layer" in capsys.readouterr().out
    assert main(["plan", "builtin:fixture", "--speculative", "mtp", "--draft-tokens", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mtp_layers"] == 1 and plan["draft_tokens"] == 2 and plan["experts_total"] == 4 * E


@pytest.fixture
def old_store(tmp_path, monkeypatch):
    """builtin:fixture's experts converted as latentkv did before the MTP layer's were written,
    where --ram-gb looks for them (the user cache)."""
    import latentkv.streaming.convert as convert

    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    model_dir = resolve("builtin:fixture")
    store = default_store_dir(model_dir, "f32")
    with monkeypatch.context() as m:
        m.setattr(convert, "routed_layer", lambda cfg, names: None)
        convert.convert_experts(model_dir, store, "f32")
    assert ModelConfig.from_hf(model_dir).num_layers not in read_manifest(store).layers
    return model_dir, store


def test_a_store_without_the_mtp_experts_is_refused_in_one_line(old_store, capsys):
    model_dir, store = old_store
    base = ["generate", "builtin:fixture", "--prompt-ids", "5,17,99,3", "--max-tokens", "6", "--json"]
    for cmd in (
        [*base, "--ram-gb", "1", "--speculative", "mtp"],
        ["plan", "builtin:fixture", "--speculative", "mtp", "--ram-gb", "1"],
    ):
        assert main(cmd) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "MTP layer" in lines[0] and "experts convert" in lines[0]
        assert str(store) in lines[0]
    # Without drafting the old store still runs: the model loads without its draft layer.
    assert main(base) == 0
    resident = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*base, "--ram-gb", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == resident
    model, streamer = load_streamed(
        model_dir, store, StreamConfig(budget=1 << 24, history=False), device="cpu"
    )
    assert model.mtp is None and any("MTP layer" in n for n in streamer.notes)
    streamer.close()
    # The load boundary refuses too (callers that skip the flag check, e.g. bench speculative).
    from latentkv.runtime import load

    with pytest.raises(UserError, match="MTP layer"):
        load("builtin:fixture", EngineConfig(ram_gb=1.0), quiet=True, draft_tokens=1)


@pytest.mark.parametrize("budget", [["--ram-gb", "1"], ["--expert-share", "0.25"]])
def test_bench_speculative_runs_streamed(capsys, tmp_path, monkeypatch, budget):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    argv = ["bench", "speculative", "--model", "builtin:fixture", *budget, "--draft-tokens", "1"]
    argv += ["--concurrency", "1,2", "--prompt-tokens", "16", "--decode-tokens", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    if budget[0] == "--expert-share":  # a quarter of the 4 x 8 experts (the MTP layer's included)
        store = default_store_dir(resolve("builtin:fixture"), "f32")
        stride = max(e.layout.stride for e in read_manifest(store).layers.values())
        assert all(r["experts"]["budget_bytes"] // stride == 8 for r in rows)
    assert [(r["concurrency"], r["draft_tokens"]) for r in rows] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert all(r["same_tokens"] and r["experts"] is not None for r in rows)
    assert all((r["experts"]["draft_hit_rate"] is None) == (r["draft_tokens"] == 0) for r in rows)
    assert all(0 <= r["experts"]["main_hit_rate"] <= 1 for r in rows)


def test_the_hot_set_never_pins_the_draft_layer(converted):
    """However often the history saw the MTP layer's experts, pinning picks main layers' only."""
    model_dir, store, _ = converted
    cfg = ModelConfig.from_hf(model_dir)
    model, streamer = _streamed(model_dir, store, experts_per_layer=4)
    try:
        main_layer = min(i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse")
        streamer.history = UsageHistory(
            streamer.manifest.fingerprint, {i: e.n_experts for i, e in streamer.manifest.layers.items()}
        )
        for _ in range(50):
            streamer.history.record(cfg.num_layers, [0, 1, 2])
        streamer.history.record(main_layer, [3])
        pinned = streamer.pin_hot_set()
    finally:
        streamer.history = None  # nothing saved into the shared store
        streamer.close()
    assert streamer.draft_layer == cfg.num_layers
    assert pinned == [(main_layer, 3)]


@pytest.mark.slow
def test_streamed_server_drafts_and_matches_plain(tmp_path):
    """serve --ram-gb --speculative mtp (the engine process, batched verify) answers concurrent
    greedy requests with the tokens the streamed server without drafting gives."""
    import asyncio

    import httpx
    from tests.server.conftest import start_server

    prompts = [[5, 17, 99, 3, 42], [300, 12, 12, 7], [1000, 2000, 3, 4, 5, 6, 7]]

    async def together(server) -> list[list[int]]:
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}
        body["logprobs"] = 1
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts)
            )
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["logprobs"]["tokens"] for r in replies]

    env = {"LATENTKV_CACHE": str(tmp_path / "cache")}
    flags = ("--max-num-seqs", "3", "--max-model-len", "128", "--ram-gb", "1")
    tokens = []
    for extra in ((), ("--speculative", "mtp", "--draft-tokens", "2")):
        server = start_server("builtin:fixture", tmp_path / f"{len(extra)}.log", *flags, *extra, env=env)
        try:
            tokens.append(asyncio.run(together(server)))
        finally:
            server.stop()
    assert tokens[1] == tokens[0]
    assert "drafting with streamed experts" in server.log_text()
