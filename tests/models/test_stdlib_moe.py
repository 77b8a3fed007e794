"""builtin:stdlib-moe, the trained MoE: it is what tools/train_moe.py says (64 experts top-8, DSA,
an MTP layer, context 4096), it computes what transformers computes with DSA selecting, its
held-out perplexity stays in a stated band and far below a unigram model's."""

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

MODEL = builtin_path("stdlib-moe")

# Perplexity on 4 held-out windows of 256 tokens (`make_windows(..., 4)`), computed by
# transformers' GlmMoeDsaForCausalLM in float32 when the model was exported (32.309; the fixture
# scores 49.09 on the same tokens). +-2% band: leaving it means latentkv computes something else.
PPL_F32 = 32.31
PPL_BAND = 0.02


@pytest.fixture(scope="module")
def model():
    from latentkv.models.weights import load_model

    return load_model(MODEL, device="cpu")


@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    return Tokenizer(MODEL).encode((MODEL / "heldout.txt").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def windows(heldout_ids) -> torch.Tensor:
    return make_windows(heldout_ids, 256, max_windows=4)


def _ppl(model, windows: torch.Tensor) -> float:
    nll = 0.0
    for w in windows:
        out = model.forward(w, model.make_cache(model.tier("f32")), all_logits=True)[:-1]
        nll -= float(torch.log_softmax(out.double(), -1).gather(1, w[1:, None]).sum())
    return math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))


def test_it_is_what_the_training_script_describes():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa"
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]) == (64, 8, 1)
    assert cfg["max_position_embeddings"] == 4096 and cfg["index_topk"] < 4096  # DSA selects
    assert cfg["num_nextn_predict_layers"] == 1
    for key in ("kv_lora_rank", "qk_rope_head_dim"):  # the rotated tiers need powers of two
        assert cfg[key] & (cfg[key] - 1) == 0, key
    assert (MODEL / "model.safetensors").stat().st_size <= 50 * 1024 * 1024
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    assert {mtp + "eh_proj.weight", mtp + "shared_head.norm.weight"} <= names
    log = json.loads((MODEL / "training_log.json").read_text())
    assert log["phase"] == "done" and log["indexer_steps"] > 0  # the indexer was distilled


@pytest.mark.slow  # ~17 s; the default suite keeps the perplexity band, transformers' number
def test_it_matches_transformers_with_dsa_selecting(model, heldout_ids):
    """Trained weights, real text, 1100 tokens (past index_topk 1024, so DSA selects): our logits
    are transformers' within 1e-3 and the teacher-forced argmaxes agree wherever transformers' top
    logit leads by more than that."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    ids = torch.tensor(heldout_ids[2000:3100])
    ours = model.forward(ids, model.make_cache(), all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2e-3
    assert clear.float().mean() > 0.99
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_heldout_perplexity_stays_in_its_band(model, windows):
    ppl = _ppl(model, windows)
    assert abs(ppl / PPL_F32 - 1) < PPL_BAND, f"f32 held-out perplexity {ppl:.3f}, recorded {PPL_F32}"


def test_it_is_far_better_than_a_unigram_model(model, windows):
    counts = load_token_counts(MODEL / "train_token_counts.json", model.cfg.vocab_size)
    unigram = unigram_ppl(np.asarray(counts), [w[1:] for w in windows])
    ppl = _ppl(model, windows)
    assert ppl < unigram / 5, f"model {ppl:.1f} vs unigram {unigram:.1f}"
