"""The scheduler with MTP drafting: every running sequence's drafts verified in one batched pass
(ragged: pending token + n drafts each), rollback per sequence; greedy output identical to the
plain engine's, alone and beside others joining and leaving mid-flight."""

from __future__ import annotations

import json

import pytest
import torch

from latentkv.engine import sampling
from latentkv.engine.generate import generate
from latentkv.engine.scheduler import Finished, Request, SamplingParams, Scheduler, TokenEvent
from latentkv.engine.speculative import SpeculativeConfig
from latentkv.models.registry import builtin_path
from latentkv.models.synthetic import write_random_checkpoint
from latentkv.models.weights import load_model
from latentkv.server.metrics import render
from latentkv.tokenizer import Tokenizer

FIXTURE = builtin_path("fixture")


@pytest.fixture(scope="module")
def fixture_model():
    return load_model(FIXTURE, device="cpu")


@pytest.fixture(scope="module")
def heldout() -> list[int]:
    return Tokenizer(FIXTURE).encode((FIXTURE / "heldout.txt").read_text(encoding="utf-8")[:30000])


@pytest.fixture(scope="module")
def random_mtp_model(tmp_path_factory):
    cfg = json.loads((builtin_path("tiny") / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, index_topk=8)
    return load_model(
        write_random_checkpoint(cfg, tmp_path_factory.mktemp("tiny-mtp"), seed=23), device="cpu"
    )


def _collect(handle) -> tuple[list[int], Finished]:
    events = list(handle)
    assert isinstance(events[-1], Finished) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return [e.token for e in events[:-1]], events[-1]


def _alone(model, prompt, n, tier):
    cache = model.make_cache(model.tier(tier))
    return generate(model, prompt, n, sampling.SamplingParams(), cache=cache, stop_ids=()).tokens


def _run(model, tier, requests, max_num_seqs, draft_tokens):
    scheduler = Scheduler(
        model,
        model.tier(tier),
        max_num_seqs=max_num_seqs,
        speculative=SpeculativeConfig(draft_tokens=draft_tokens, adaptive=False),
    )
    scheduler.start()
    try:
        handles = [
            scheduler.submit(Request(p, SamplingParams(max_tokens=n, temperature=0.0))) for p, n in requests
        ]
        return [_collect(h) for h in handles], scheduler.stats()
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("tier", ["f32", "tq4"])
def test_batched_verify_greedy_matches_alone_on_the_fixture(fixture_model, heldout, tier):
    requests = [(heldout[300 * i : 300 * i + 20 + 3 * i], 10 + 2 * i) for i in range(6)]
    results, stats = _run(fixture_model, tier, requests, max_num_seqs=4, draft_tokens=2)
    for (prompt, n), (tokens, finished) in zip(requests, results, strict=True):
        assert tokens == _alone(fixture_model, prompt, n, tier)
        assert (finished.reason, finished.completion_tokens) == ("length", n)
    spec = stats.speculative
    assert spec is not None and spec["verify_steps"] > 0 and spec["tokens_per_verify"] > 1.2
    assert stats.generation_tokens_total == sum(n for _, n in requests)
    text = render("fixture", True, stats, (0.0, 0.0))
    assert "latentkv_speculative_tokens_per_verify" in text
    assert 'latentkv_speculative_acceptance{model_name="fixture",position="2"}' in text


def test_batched_verify_greedy_matches_alone_with_random_drafts(random_mtp_model):
    """Drafts mostly wrong (random MTP layer), DSA selecting (index_topk 8): rollbacks everywhere."""
    requests = [
        (torch.randint(2, 256, (4 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist(), 6 + i)
        for i in range(8)
    ]
    results, stats = _run(random_mtp_model, "f32", requests, max_num_seqs=5, draft_tokens=3)
    for (prompt, n), (tokens, _) in zip(requests, results, strict=True):
        assert tokens == _alone(random_mtp_model, prompt, n, "f32")
    assert stats.speculative["acceptance_per_position"][0] < 0.5


def test_a_scheduler_refuses_drafting_without_an_mtp_layer(ours):
    with pytest.raises(ValueError, match="MTP"):
        Scheduler(ours("glm5-tiny"), ours("glm5-tiny").tier(), speculative=SpeculativeConfig())
