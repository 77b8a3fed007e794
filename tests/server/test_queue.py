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


def test_n_counts_each_choice_against_seqs_plus_queue(one_slot_server):
    """One slot + one waiting place: n=2 fits an idle server (200), n=3 never can (400, param n)."""
    with one_slot_server.http() as http:
        ok = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
        never = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "n": 3})
        assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "one-process"])
def test_n_choices_that_fit_are_served_and_floods_get_only_200_or_429(tmp_path, serve, engine_process):
    """--max-num-seqs 4 --max-queue 4: n=8 fits (200), n=9 never can (400 naming n), and
    concurrent floods of n=1 and n=8 requests get only 200 or 429 (never a 500); the server
    serves afterwards. The HTTP process and the engine count open sequences alike."""
    import concurrent.futures

    flags = ["--max-num-seqs", "4", "--max-queue", "4"]
    if not engine_process:
        flags.append("--no-engine-process")
    server = serve("builtin:tiny", tmp_path / "server.log", *flags)
    try:
        with server.http() as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "n": 8}
            ok = http.post("/v1/completions", json=body)
            assert ok.status_code == 200, ok.text
            assert len(ok.json()["choices"]) == 8
            never = http.post("/v1/completions", json=body | {"n": 9})
            assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text

        def one(i: int) -> httpx.Response:
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "n": 8 if i % 5 == 0 else 1}
            with server.http() as http:
                return http.post("/v1/completions", json=body | {"stream": i % 3 == 0})

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(50)))
        codes = [a.status_code for a in answers]
        assert set(codes) <= {200, 429}, [a.text for a in answers if a.status_code not in (200, 429)]
        assert 200 in codes
        for a in answers:
            if a.status_code == 429:
                assert int(a.headers["retry-after"]) >= 1
            elif a.headers["content-type"].startswith("text/event-stream"):
                assert '"error"' not in a.text, a.text  # no in-band failure either
        with server.http() as http:
            assert (
                http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": 8}).status_code
                == 200
            )
    finally:
        server.stop()
