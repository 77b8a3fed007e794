"""Sessions through the server: a named conversation resumes its KV, also after a restart.

Saved rows are the prompt and every generated token but the last (docs/sessions.md); a request
reuses the longest common prefix of those and its prompt, at most all but the prompt's last
token, and reports it as usage.prompt_tokens_details.cached_tokens.
"""

from __future__ import annotations

import signal

import httpx
import pytest

P = list(range(40, 100))  # 60 prompt tokens
Q = list(range(120, 130))


def _complete(server, prompt, session=None, max_tokens=4) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if session is not None:
        body["session"] = session
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _prompt_tokens_total(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("latentkv_prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no latentkv_prompt_tokens_total")


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


def test_a_session_survives_a_server_restart(serve, kv_dir):
    log = kv_dir / "server.log"
    first = serve("builtin:tiny", log, "--kv-dir", str(kv_dir))
    try:
        assert _cached(_complete(first, P, "agent", max_tokens=1)) == 0
        second = _complete(first, P + Q, "agent")
        assert _cached(second) == len(P)  # the saved prompt, not prefilled again
        plain = _complete(first, P + Q)  # no session: everything prefilled
        assert _cached(plain) == 0 and plain["choices"][0]["text"] == second["choices"][0]["text"]
    finally:
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it: the exit status says SIGTERM
        assert first.stop() in (0, -signal.SIGTERM)
    assert (kv_dir / "agent.kv").exists()

    restarted = serve("builtin:tiny", log, "--kv-dir", str(kv_dir))
    try:
        before = _prompt_tokens_total(restarted)
        again = _complete(restarted, P + Q, "agent")
        # Everything but the prompt's last token comes from the file; only that one is prefilled.
        assert _cached(again) == len(P + Q) - 1
        assert _prompt_tokens_total(restarted) - before == 1
        assert again["choices"][0]["text"] == second["choices"][0]["text"]
    finally:
        restarted.stop()
