"""Events from the worker thread to whoever waits for them: a blocking iterator, an asyncio
event loop, or a sink (the engine process's pipe).

The worker calls `handle._emit(event)` for each event and `outbox.flush()` once per step: events
for an event loop wait in the outbox until then, so a loop wakes once per step for all its
handles, not once per token. A blocking iterator gets each event at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

from latentkv.engine.request import Finished, Request, TokenEvent

Sink = Callable[[list[tuple["RequestHandle", "TokenEvent | Finished"]]], None]


class RequestHandle:
    """The client's side of one request: iterate it (blocking or async) for its events."""

    def __init__(self, request: Request, wake: threading.Condition, outbox: Outbox):
        self.request = request
        self._wake = wake
        self._outbox = outbox
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_events: asyncio.Queue | None = None
        self._pending: list[TokenEvent | Finished] = []  # for the event loop, not handed over yet
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop this request (e.g. the client went away); the worker frees its slot at the next step."""
        self._cancelled.set()
        with self._wake:
            self._wake.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: TokenEvent | Finished) -> None:
        """Called by the worker; hands the event to whichever iterator reads this handle. Events
        for an event loop wait in the outbox until the worker's step ends (one wake-up per loop
        per step, not one per token)."""
        if self._outbox.sink is not None:  # the events leave the process (latentkv.engine.remote)
            self._outbox.add_event(self, event)
            return
        with self._lock:
            if self._async_events is None:
                self._events.put(event)
                return
            self._pending.append(event)
            first = len(self._pending) == 1
        if first:
            self._outbox.add(self)

    def _deliver(self) -> None:
        """On the event loop: move the pending events to the async iterator."""
        with self._lock:
            events, self._pending = self._pending, []
        for event in events:
            self._async_events.put_nowait(event)

    def __iter__(self):
        while True:
            event = self._events.get()
            yield event
            if isinstance(event, Finished):
                return

    async def __aiter__(self):
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._async_events = asyncio.Queue()
            while not self._events.empty():  # what the worker sent before we attached
                self._async_events.put_nowait(self._events.get())
        while True:
            event = await self._async_events.get()
            yield event
            if isinstance(event, Finished):
                return


class Outbox:
    """Handles with events for their event loops; `flush` wakes each loop once for all of them.

    With a `sink`, events are instead collected in order and handed to it once per flush as
    [(handle, event), ...] (the engine process sends them to the HTTP process that way)."""

    def __init__(self, sink: Sink | None = None):
        self._lock = threading.Lock()
        self._handles: list[RequestHandle] = []
        self.sink = sink
        self._events: list[tuple[RequestHandle, TokenEvent | Finished]] = []

    def add(self, handle: RequestHandle) -> None:
        with self._lock:
            self._handles.append(handle)

    def add_event(self, handle: RequestHandle, event: TokenEvent | Finished) -> None:
        with self._lock:
            self._events.append((handle, event))

    def flush(self) -> None:
        if self.sink is not None:
            with self._lock:
                events, self._events = self._events, []
            if events:
                self.sink(events)
            return
        with self._lock:
            handles, self._handles = self._handles, []
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestHandle]] = {}
        for handle in handles:
            by_loop.setdefault(handle._loop, []).append(handle)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, group)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for handle in group:
                    handle._cancelled.set()


def _deliver_all(handles: list[RequestHandle]) -> None:
    for handle in handles:
        handle._deliver()
