"""`EngineClient`: what the server (or any caller) needs from an engine, wherever it runs.

Two implementations: `Scheduler` (latentkv.engine.scheduler), whose worker thread runs in this
process, and `EngineProcess` (latentkv.engine.remote), which runs a Scheduler in a child process
and forwards requests and events over a pipe. Code written against this protocol works with
either; `latentkv serve --no-engine-process` picks the first.
"""

from __future__ import annotations

from typing import Protocol

from latentkv.engine.delivery import RequestHandle
from latentkv.engine.request import Request, SchedulerStats


class EngineClient(Protocol):
    max_num_seqs: int
    max_queue: int
    max_model_len: int
    failure: str | None  # why it can no longer serve (an engine process that died), else None

    def start(self) -> None:
        """Start serving (idempotent)."""

    def submit(self, request: Request) -> RequestHandle:
        """Queue one request; never blocks. ValueError for an invalid request, QueueFull when
        it does not fit, SchedulerClosed after shutdown."""

    def submit_all(self, requests: list[Request]) -> list[RequestHandle]:
        """Queue every request or none (one HTTP request's choices), with submit's errors."""

    def stats(self) -> SchedulerStats:
        """Counters for /metrics and the load balancer."""

    def shutdown(self) -> None:
        """Stop: what still waits or runs finishes "cancelled" (sessions saved)."""
