"""builtin:fixture, the trained model: it is what tools/train_fixture.py says, it computes what
transformers computes, and its held-out quality stays in a stated band, so that a regression in
the model code or in a codec shows up in CI (random-weight models cannot show it: their logits
are nearly tied)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from latentkv.eval.ppl import load_token_counts, make_windows, unigram_ppl
from latentkv.models.registry import builtin_path
from latentkv.tokenizer import Tokenizer

FIXTURE = builtin_path("fixture")

# Held-out slice: 4 windows of 256 tokens spread over heldout.txt (`make_windows(..., 4)`).
# f32 perplexity measured on it when the fixture was trained (docs/fixture.md): PPL_F32.
# The band is +-2%: f32 CPU arithmetic reproduces it to ~1e-5, so leaving the band means the
# model computes something else.
PPL_F32 = 49.09
PPL_BAND = 0.02
# fp8 against f32 on the same tokens: the goal is 0.5% and mean KLD <= 0.005 over the
# whole held-out split, and the bounds here (measured on this slice: 1.0003 and 0.0006).
FP8_MAX_PPL_RATIO = 1.005
FP8_MAX_KLD = 0.005


@pytest.fixture(scope="module")
def fixture_model():
    from latentkv.models.weights import load_model

    return load_model(FIXTURE, device="cpu")


@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    return Tokenizer(FIXTURE).encode((FIXTURE / "heldout.txt").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def windows(heldout_ids) -> torch.Tensor:
    return make_windows(heldout_ids, 256, max_windows=4)


def _nll_and_logits(model, windows: torch.Tensor, tier: str):
    """Summed next-token NLL over the windows and each window's logits, through the tier's cache."""
    nll, logits = 0.0, []
    for w in windows:
        out = model.forward(w, model.make_cache(model.tier(tier)), all_logits=True)[:-1]
        nll -= float(torch.log_softmax(out.double(), -1).gather(1, w[1:, None]).sum())
        logits.append(out)
    return nll, logits


def test_fixture_is_what_the_training_script_describes():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa"
    for key in ("kv_lora_rank", "qk_rope_head_dim"):  # the rotated tiers need powers of two
        assert cfg[key] & (cfg[key] - 1) == 0, key
    assert cfg["n_shared_experts"] >= 1 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["index_topk"] < cfg["max_position_embeddings"], "DSA must select on long contexts"
    assert (FIXTURE / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for part in (
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    ):
        assert mtp + part in names, f"MTP layer tensor {mtp + part} missing"


def test_fixture_matches_transformers_on_heldout_text(fixture_model, heldout_ids):
    """Trained weights, real text, 512 tokens (DSA selecting past index_topk): our logits are
    transformers' within 1e-3 and every teacher-forced argmax agrees."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    ids = torch.tensor(heldout_ids[1000:1512])
    ours = fixture_model.forward(ids, fixture_model.make_cache(), all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3
    # Portable on any CPU: every position's top logit leads by >= 2e-3 (2.5e-3 measured), so
    # two engines within 1e-3 of each other cannot pick different tokens.
    top2 = ref.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_heldout_perplexity_stays_in_its_band(fixture_model, windows):
    assert PPL_F32 is not None, "record PPL_F32 after training the fixture"
    nll, _ = _nll_and_logits(fixture_model, windows, "f32")
    ppl = math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))
    assert abs(ppl / PPL_F32 - 1) < PPL_BAND, f"f32 held-out perplexity {ppl:.3f}, recorded {PPL_F32}"


def test_fixture_is_far_better_than_a_unigram_model(fixture_model, windows):
    counts = load_token_counts(FIXTURE / "train_token_counts.json", fixture_model.cfg.vocab_size)
    unigram = unigram_ppl(np.asarray(counts), [w[1:] for w in windows])
    nll, _ = _nll_and_logits(fixture_model, windows, "f32")
    ppl = math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))
    assert ppl < unigram / 5, f"model {ppl:.1f} vs unigram {unigram:.1f}"


def test_fp8_stays_within_its_bound_of_f32(fixture_model, windows):
    nll32, ref = _nll_and_logits(fixture_model, windows, "f32")
    nll8, got = _nll_and_logits(fixture_model, windows, "fp8")
    assert math.exp((nll8 - nll32) / (windows.shape[0] * (windows.shape[1] - 1))) < FP8_MAX_PPL_RATIO
    kld = []
    for p, q in zip(ref, got, strict=True):
        lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
        kld.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
    assert np.mean(kld) < FP8_MAX_KLD
