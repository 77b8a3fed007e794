"""The server with experts streamed from disk (--ram-gb) answers concurrent greedy requests
(batched decode) with the tokens a fully resident server gives, and says so in its log."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from tests.server.conftest import start_server

MAX_TOKENS = 12
TOL = 1e-3  # logprob gap below which two paths may break a tie differently (fused vs grouped experts)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(2, 4000) for _ in range(rng.randrange(3, 40))] for _ in range(4)]


async def _together(server) -> list[dict]:
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    body["return_tokens_as_token_ids"] = True
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json={**body, "prompt": p}) for p in _prompts())
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["logprobs"] for r in replies]


@pytest.mark.slow
def test_streamed_server_matches_resident(tmp_path):
    env = {"LATENTKV_CACHE": str(tmp_path / "cache")}
    flags = ("--max-num-seqs", "4", "--max-model-len", "256")
    resident = start_server("builtin:fixture", tmp_path / "resident.log", *flags, env=env)
    try:
        want = asyncio.run(_together(resident))
    finally:
        resident.stop()
    streamed = start_server("builtin:fixture", tmp_path / "streamed.log", *flags, "--ram-gb", "1", env=env)
    try:
        got = asyncio.run(_together(streamed))
    finally:
        streamed.stop()
    assert "streaming experts from" in streamed.log_text()
    for a, b in zip(want, got, strict=True):
        for k in range(MAX_TOKENS):
            if a["tokens"][k] != b["tokens"][k]:
                best = sorted(a["top_logprobs"][k].values(), reverse=True)
                assert best[0] - best[1] < TOL, f"tokens part at {k} without a tie"
                break
            assert abs(a["token_logprobs"][k] - b["token_logprobs"][k]) < TOL
