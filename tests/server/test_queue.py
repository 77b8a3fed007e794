"""A full queue is 429 + Retry-After: one batch slot, one waiting place, a third request refused."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory, serve):
    root = tmp_path_factory.mktemp("queue")
    server = serve("builtin:tiny", root / "server.log", "--max-num-seqs", "1", "--max-queue", "1")
    yield server
    server.stop()


def _first_chunk(stream: httpx.Response):
    """Read up to the first chunk; returns the line iterator, which must stay referenced: dropping
    it closes the connection, and the server cancels a request whose client went away."""
    lines = stream.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            return lines
    raise AssertionError("the stream ended without a chunk")


def test_a_request_beyond_the_queue_is_429_with_retry_after(one_slot_server):
    server = one_slot_server
    long = {"prompt": [5, 6], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with server.http() as a, server.http() as b, a.stream("POST", "/v1/completions", json=long) as running:
        lines = _first_chunk(running)  # it holds the only slot now
        with b.stream("POST", "/v1/completions", json=long) as waiting:
            assert waiting.status_code == 200  # queued: its headers come before its first token
            refused = httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=server.headers
            )
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        del lines
    # Both streams were closed early: their requests are cancelled and the server serves again.
    again = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=server.headers
    )
    assert again.status_code == 200
