"""One request's choices: scheduler handles -> text pieces with their tokens, merged across choices.

    runs = submit_all(scheduler, specs)                  # all or none: QueueFull -> 429, invalid -> 400
    async for piece in merged(runs):                     # Piece(index, text, tokens, finish...)
        ...

A choice is one scheduler request (n choices of a prompt are n requests with derived seeds).
Its events become text through `tokenizer.Detokenizer` and `tokenizer.StopStrings`; reaching a
stop string cancels the handle, trims the text and reports finish_reason "stop". A Piece carries
the tokens consumed since the previous piece, so streamed logprobs line up with streamed text.

The scheduler ends a request on a sampled stop token without yielding it. Where the token must
be listed (echoed logprobs: lm-evaluation-harness counts one entry per generated token), the
request is submitted without stop tokens and its ChoiceRun stops on them instead: the token is
yielded, listed in the logprobs, left out of the text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from latentkv.server.errors import APIError, bad_request
from latentkv.tokenizer import Detokenizer, StopStrings

if TYPE_CHECKING:
    from latentkv.engine.sampling import SamplingParams

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


@dataclass
class Spec:
    """What to submit for one choice."""

    index: int
    prompt: list[int]
    params: SamplingParams
    session: str | None = None
    stop: list[str] = field(default_factory=list)
    keep_special: bool = False  # special tokens stay in the text (tool-call markers may be special)


@dataclass
class Piece:
    index: int
    text: str
    tokens: list  # TokenEvents behind `text` (stop tokens included, tokens after a stop string not)
    finish_reason: str | None = None  # set on the choice's last piece
    finished: object | None = None  # the scheduler's Finished, on the last piece
    completion_tokens: int = 0  # on the last piece
    error: str | None = None  # on the last piece, when the scheduler failed the request


class ChoiceRun:
    def __init__(self, spec: Spec, handle, tokenizer, stop_ids: frozenset[int], timer=None):
        self.spec = spec
        self.handle = handle
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.timer = timer  # metrics.RequestTimer, started at submission (None: not measured)

    def cancel(self) -> None:
        self.handle.cancel()

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's pieces; its timings reach the server's metrics as they come."""
        last = None
        try:
            async for piece in self._pieces():
                last = piece
                yield piece
        finally:
            if self.timer is not None:  # the reader may have left early (a disconnect)
                done = last is not None and last.finish_reason is not None
                self.timer.finish(
                    last.finished if done else None, last.finish_reason if done else "cancelled"
                )

    async def _pieces(self) -> AsyncIterator[Piece]:
        from latentkv.engine.request import Finished

        index = self.spec.index
        detok = (
            Detokenizer(self.tokenizer, skip_special_tokens=not self.spec.keep_special)
            if self.tokenizer is not None
            else None
        )
        stops = StopStrings(self.spec.stop)
        pending: list = []
        consumed = 0
        stopped = False  # by a stop string or a listed stop token: the rest is cancelled
        tail = ""
        finished = None
        async for event in self.handle:
            if isinstance(event, Finished):
                finished = event
                break
            if stopped:
                continue  # events the worker produced before it saw the cancel
            consumed += 1
            pending.append(event)
            if self.timer is not None:
                self.timer.token()
            if event.token in self.stop_ids:
                stopped, tail = True, _final_text(detok, stops)
            else:
                text, stopped = stops.push(detok.push(event.token) if detok else "")
                if stopped:
                    tail = text
                elif text:
                    yield Piece(index, text, pending)
                    pending = []
            if stopped:
                self.handle.cancel()
        if finished is None:  # the handle ended without a Finished: the worker went away
            yield Piece(index, "", pending, "error", None, consumed, "the scheduler stopped")
        elif stopped:
            yield Piece(index, tail, pending, "stop", finished, consumed)
        else:
            text = _final_text(detok, stops)
            yield Piece(
                index, text, pending, finished.reason, finished, finished.completion_tokens, finished.error
            )


def _final_text(detok: Detokenizer | None, stops: StopStrings) -> str:
    """What is still held back once the output ends (cut at a stop string it completes)."""
    text, hit = stops.push(detok.flush() if detok else "")
    return text if hit else text + stops.flush()


def submit_all(
    scheduler, specs: list[Spec], tokenizer, stop_ids: frozenset[int], metrics=None
) -> list[ChoiceRun]:
    """Submit every choice, or none: a refusal cancels what was already submitted. With
    `metrics` (server.metrics.Metrics) each choice's timings are observed into it."""
    from latentkv.engine.request import QueueFull, Request, SchedulerClosed

    requests = [Request(spec.prompt, spec.params, session=spec.session) for spec in specs]
    timers = [metrics.timer() if metrics is not None else None for _ in specs]
    try:
        handles = scheduler.submit_all(requests)
    except QueueFull as exc:
        raise queue_full(str(exc)) from None
    except SchedulerClosed:
        raise closed() from None
    except ValueError as exc:
        raise bad_request(str(exc), param="n" if "sequences (n x prompts)" in str(exc) else None) from None
    return [
        ChoiceRun(spec, handle, tokenizer, stop_ids, timer)
        for spec, handle, timer in zip(specs, handles, timers, strict=True)
    ]


def queue_full(message: str) -> APIError:
    return APIError(
        429,
        f"the server is busy: {message or 'the request queue is full'}; retry shortly",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def closed() -> APIError:
    return APIError(503, "the server is shutting down", headers={"Retry-After": "5"})


def refusal_error(finished) -> APIError | None:
    """The answer for a request the engine refused before running it (None: it was not refused)."""
    refused = getattr(finished, "refused", None)
    if refused == "queue_full":
        return queue_full(finished.error or "")
    if refused == "closed":
        return closed()
    if refused == "session":
        busy = "in use by another process" in (finished.error or "")
        return APIError(
            409,
            finished.error or "the session is unavailable",
            param="session",
            code="session_busy" if busy else "session_unavailable",
        )
    if refused == "invalid":
        return bad_request(finished.error or "invalid request")
    if refused == "unavailable":  # a cluster rank is gone (docs/distributed.md)
        return APIError(
            503,
            finished.error or "the model is unavailable",
            code="unavailable",
            headers={"Retry-After": "30"},
        )
    return None


def cancel_all(runs: list[ChoiceRun]) -> None:
    for run in runs:
        run.cancel()


async def merged(runs: list[ChoiceRun]) -> AsyncIterator[Piece]:
    """Every choice's pieces as they come; leaving early (a disconnect) cancels every choice."""
    if len(runs) == 1:
        try:
            async for piece in runs[0].pieces():
                yield piece
        finally:
            cancel_all(runs)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for piece in run.pieces():
                await queue.put(piece)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
        for task in tasks:
            task.result()  # re-raise a pump's exception, if any
    finally:
        cancel_all(runs)
        for task in tasks:
            task.cancel()
