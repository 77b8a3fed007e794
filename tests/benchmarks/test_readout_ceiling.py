"""benchmarks/readout_ceiling.py: its fits find what they are built to find, on weights made so
that the answer is known (a head tied to the embeddings: a linear map names every token; a head
unrelated to the embeddings, with far more tokens than dimensions: no linear map does, while a
free vector per token still can)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import readout_ceiling  # noqa: E402

V, D = 512, 32


def _weights(tied: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, D, generator=g)
    head = emb.clone() if tied else torch.randn(V, D, generator=g)
    return emb, head, torch.full((D,), 3.0), 1e-5


@pytest.mark.parametrize("seed", [0, 1])
def test_fits_find_the_known_answers(seed):
    emb, head, norm, eps = _weights(tied=True, seed=seed)
    tied = readout_ceiling.fit("linear map", emb, head, norm, eps, steps=150)
    assert tied["nats"] < 0.5 and tied["named_within_1_nat"] > 0.9, tied

    emb, head, norm, eps = _weights(tied=False, seed=seed)
    free = readout_ceiling.fit("free vector", emb, head, norm, eps, steps=150)
    linear = readout_ceiling.fit("linear map", emb, head, norm, eps, steps=150)
    moved = readout_ceiling.fit("linear map", emb, head, norm, eps, steps=150, lam=0.01)
    assert free["nats"] < 0.5, free
    assert linear["nats"] > 2.0 and linear["named_within_1_nat"] < 0.2, linear
    assert moved["nats"] < linear["nats"] - 1.0 and moved["embedding_move"] > 0.1, moved


def test_bad_flags_are_one_line():
    with pytest.raises(SystemExit, match="bad --lambdas"):
        readout_ceiling.main(["builtin:tiny", "--lambdas", "x"])
    with pytest.raises(SystemExit, match="--steps must be"):
        readout_ceiling.main(["builtin:tiny", "--steps", "0"])
