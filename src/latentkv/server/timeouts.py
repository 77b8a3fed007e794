"""Slow clients: a request whose headers or body do not arrive within `--request-timeout` seconds
is answered 408 and its connection closed, so a client sending a byte a second (a slow-loris)
cannot hold a connection, and the server's memory for it, forever.

Two clocks, each of `timeout` seconds:
- headers: from the connection opening, or from the first byte of the next request on a kept-alive
  connection, until the request's headers are complete (`protocol`, a subclass of uvicorn's h11
  protocol; the ASGI app does not exist before the headers do);
- body: from the headers until the last byte of the body (`read_body`, used by the app's gate).

Idle kept-alive connections are uvicorn's (`timeout_keep_alive`, 5 s).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from latentkv.server.errors import APIError

DEFAULT_TIMEOUT_S = 30.0


def timeout_error(timeout: float, what: str) -> APIError:
    return APIError(
        408,
        f"the request's {what} did not arrive within {timeout:g} s (--request-timeout): closing the connection",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's headers."""

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._headers_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of a request: its headers' clock runs
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are in (or the request failed)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._headers_timer is None:
                self._headers_timer = self.loop.call_later(timeout, self._late)

        def _disarm(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _late(self) -> None:
            self._headers_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response still going out (pipelining): its own clocks apply
            error = timeout_error(timeout, "headers")
            body = json.dumps(error.body()).encode()
            head = (
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            self.transport.close()

    return TimedH11Protocol


async def read_body(receive, timeout: float, limit: int) -> list[dict] | None:
    """The request body read whole within `timeout` seconds (asyncio.TimeoutError when it is
    late), as the one message to replay (or the disconnect that cut it short); None past
    `limit` bytes."""
    return await asyncio.wait_for(_read(receive, limit), timeout)


async def _read(receive, limit: int) -> list[dict] | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: the app sees that next
            return [message]
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
