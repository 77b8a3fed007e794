"""Slow clients: headers or a body that do not arrive within --request-timeout get 408 (OpenAI's
error shape) and the connection is closed; a client that keeps pace is served as usual."""

from __future__ import annotations

import json
import socket
import time

import pytest
from tests.server.conftest import start_server

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    live = start_server(
        "builtin:tiny",
        root / "server.log",
        "--request-timeout",
        str(TIMEOUT_S),
        "--no-engine-process",
        key=None,
    )
    yield live
    live.stop()


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10 * TIMEOUT_S + 10)
    return s


def _answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _check_408(raw: bytes, what: str) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), raw[:200]
    error = json.loads(body)["error"]
    assert (
        error["code"] == "request_timeout"
        and f"request's {what} did not arrive within 1 s" in error["message"]
    )


def _dribble(s: socket.socket, data: bytes, every: float) -> bool:
    """Send a byte at a time; False once the server has closed the connection."""
    for i in range(len(data)):
        try:
            s.sendall(data[i : i + 1])
        except OSError:
            return False
        time.sleep(every)
    return True


def test_a_connection_that_sends_nothing_is_closed(server):
    t0 = time.monotonic()
    with _connect(server) as s:
        raw = _answer(s)
    assert TIMEOUT_S * 0.9 <= time.monotonic() - t0 < TIMEOUT_S + 5
    _check_408(raw, "headers")


def test_headers_a_byte_at_a_time_are_cut_off(server):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nUser-Agent: slow\r\n\r\n"
    with _connect(server) as s:
        t0 = time.monotonic()
        finished = _dribble(s, request, every=TIMEOUT_S / 4)  # the whole would take 13 s
        raw = _answer(s)
    assert not finished or raw.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    _check_408(raw, "headers")


def test_a_body_a_byte_at_a_time_is_cut_off(server):
    body = json.dumps({"prompt": "hello there", "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with _connect(server) as s:
        s.sendall(head)
        t0 = time.monotonic()
        _dribble(s, body, every=TIMEOUT_S / 4)
        raw = _answer(s)
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    _check_408(raw, "body")


def test_a_client_that_keeps_pace_is_served(server):
    with server.http() as http:
        assert http.get("/health").status_code == 200
        reply = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        time.sleep(TIMEOUT_S * 1.5)  # a kept-alive connection idle past the request timeout
        assert http.get("/health").status_code == 200
    assert "Traceback" not in server.log_text()
