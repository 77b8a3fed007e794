"""`latentkv serve builtin:fixture --speculative mtp`: concurrent greedy completions are
token-identical to a server without drafting, and /metrics reports the drafting."""

from __future__ import annotations

import concurrent.futures

import pytest

from latentkv.models.registry import builtin_path
from latentkv.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # two fixture servers (~30 s on a busy machine)


def _prompts() -> list[list[int]]:
    path = builtin_path("fixture")
    ids = Tokenizer(path).encode((path / "heldout.txt").read_text(encoding="utf-8")[:20000])
    return [ids[400 * i : 400 * i + 24 + 5 * i] for i in range(6)]


def _complete(server, prompts: list[list[int]]) -> list[list[int]]:
    def one(prompt):
        with server.http() as http:
            body = {"model": "builtin:fixture", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            body["return_token_ids"] = True
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, prompts))


def test_server_greedy_identical_with_drafting(serve, tmp_path):
    prompts = _prompts()
    plain = serve("builtin:fixture", tmp_path / "plain.log", "--max-num-seqs", "4")
    try:
        want = _complete(plain, prompts)
    finally:
        plain.stop()
    spec = serve(
        "builtin:fixture",
        tmp_path / "spec.log",
        "--max-num-seqs",
        "4",
        "--speculative",
        "mtp",
        "--draft-tokens",
        "2",
    )
    try:
        got = _complete(spec, prompts)
        with spec.http() as http:
            metrics = http.get("/metrics").text
    finally:
        spec.stop()
    assert got == want
    assert "latentkv_speculative_verify_steps_total" in metrics
    assert 'latentkv_speculative_acceptance{model_name="builtin:fixture",position="1"}' in metrics
