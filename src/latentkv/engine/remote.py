"""The scheduler in its own process, so HTTP work and model steps do not share one GIL.

`latentkv serve` keeps its event loop (HTTP parsing, SSE chunks, detokenization) in the main
process and runs the model, with the scheduler's worker thread, in a child process started with
`spawn` (the engine process). On a small model a decode step is a few hundred short torch ops
that each need the GIL back; in one process every SSE chunk the event loop writes holds that
GIL while the worker waits, so eight streams cost the decode loop eight chunks' worth of Python
per step. Split, the two sides run on two cores and meet once per step.

`EngineProcess` and `Scheduler` are both an `EngineClient` (latentkv.engine.client: start, submit
-> handle, stats, shutdown): the server code is the same either way (`--no-engine-process` keeps
one process).

Messages over one multiprocessing Pipe (pickled tuples):

    parent -> child   ("submit", Request)    Request.id set by the parent
                      ("cancel", id)
                      ("shutdown",)          the child finishes what runs ("cancelled"), saves
                                             sessions, answers ("bye",) and exits
    child -> parent   ("ready", SchedulerStats) or ("failed", message)    once, after loading
                      ("events", [(id, TokenEvent | Finished), ...], SchedulerStats)
                                             once per scheduler step, in order
                      ("stats", SchedulerStats)    after each command, and every
                                             HEALTH_EVERY_S while the expert store is degraded
                      ("refused", id, message, kind)    a submit the child's scheduler refused
                                             (kind: "invalid" | "queue_full" | "closed", so the
                                             server answers 400 / 429 / 503, never 500)

Without --threads the engine process uses one torch thread fewer than the machine has cores:
the HTTP process needs one, and torch's intra-op threads spin on the cores they share with it.
With `pin_cpus` (`--pin-cpus`, Linux, off by default) the two processes get disjoint CPU sets
(`cpu_split`): the engine the last --threads CPUs this process may use, the HTTP process the
others. On the 2-vCPU VM it did not measurably help (builtin:tiny, 8 streaming clients with
the load generator kept off the engine's CPU: 4.2-5.1x one client's tok/s pinned, 4.6-5.3x
not; docs/performance.md), and two pinned servers would share the same CPUs, so it is opt-in.

The parent validates requests and applies the queue bound itself, so a 400 or a 429 never
waits for the child. Both count open requests (submitted, Finished not yet seen) against
max_num_seqs + max_queue; the parent sees a Finished only after the child, so its count is
never below the child's and the child does not refuse what the parent accepted. Should it
refuse anyway, the Finished says why (`refused`) and the client still gets 400/429/503.
If the child dies (killed, out of memory), every open request ends with an error (`Finished.code`
"engine_stopped": the server's 503) and a new child is started and loads the model again;
meanwhile submits raise SchedulerClosed (503 with the reason). Sessions lose nothing: a turn is
saved before its request finishes. A child that dies RESTARTS times within RESTART_WINDOW_S is
not started again (`failure` says to restart the server). The child exits when the parent's end
of the pipe closes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import replace

from latentkv.config import ServerConfig
from latentkv.engine.delivery import Outbox, RequestHandle
from latentkv.engine.request import (
    Finished,
    QueueFull,
    Request,
    SchedulerClosed,
    SchedulerStats,
    check_group_size,
    check_room,
    validate_request,
)
from latentkv.engine.scheduler import Scheduler
from latentkv.errors import user_message
from latentkv.runtime import load

log = logging.getLogger("latentkv.engine")
SHUTDOWN_TIMEOUT_S = 60  # for the child to finish its requests and save their sessions
RESTARTS, RESTART_WINDOW_S = 3, 600  # an engine process that dies more often is not started again
HEALTH_EVERY_S = 2.0  # while the expert store is degraded, the child's stats (and health) this often


class EngineFailed(RuntimeError):
    """The engine process could not load the model (the message says why)."""


class _RemoteHandle(RequestHandle):
    def __init__(self, request: Request, engine: EngineProcess):
        super().__init__(request, engine._wake, engine._outbox)
        self._engine = engine

    def cancel(self) -> None:
        if not self.cancelled:
            super().cancel()
            self._engine._send(("cancel", self.request.id))


class EngineProcess:
    """An `EngineClient` (latentkv.engine.client) whose Scheduler and model run in a child process."""

    def __init__(self, config: ServerConfig, max_model_len: int, vocab_size: int):
        self.max_num_seqs, self.max_queue = config.max_num_seqs, config.max_queue
        self.max_model_len = max_model_len
        self._vocab = vocab_size
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._handles: dict[int, _RemoteHandle] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self.failure: str | None = None  # set when the child is gone without being asked to stop
        self._outbox = Outbox()
        self._wake = threading.Condition()  # RequestHandle.cancel notifies it; nothing waits on it here
        # (engine CPUs, HTTP CPUs), or None: placement left to the OS
        self.cpus = cpu_split(config.engine.threads) if config.pin_cpus else None
        self._config = config
        self._restarts: list[float] = []  # when the engine process was started again
        self.restarting = False  # the engine process died and a new one is loading
        self._start_child()
        if self.cpus is not None:
            _pin_process(self.cpus[1])
            engine_cpus, http_cpus = (",".join(map(str, c)) for c in self.cpus)
            print(
                f"latentkv serve: engine process on CPU {engine_cpus}, HTTP on CPU {http_cpus} (--pin-cpus)",
                file=sys.stderr,
            )
        self._reader = threading.Thread(target=self._read, name="latentkv-engine-reader", daemon=True)
        self._reader.start()

    def _start_child(self) -> None:
        """Start the engine process and wait until it serves (EngineFailed if it cannot)."""
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        engine_cpus = None if self.cpus is None else self.cpus[0]
        process = context.Process(
            target=_engine_main,
            args=(child, self._config, self.max_model_len, engine_cpus),
            name="latentkv-engine",
            daemon=True,
        )
        process.start()  # the child starts with this process's CPUs and then takes its own
        child.close()
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            process.join(5)
            conn.close()
            raise EngineFailed(
                f"the engine process exited while loading ({_exit(process.exitcode)})"
            ) from None
        if kind != "ready":
            process.join(5)
            conn.close()
            raise EngineFailed(payload)
        with self._send_lock:
            self._process, self._conn = process, conn
        self._stats: SchedulerStats = payload

    # --- the EngineClient interface ------------------------------------------------------

    def start(self) -> None:
        """The child's worker is already running (it starts once the model is loaded)."""

    def submit(self, request: Request) -> RequestHandle:
        """As `Scheduler.submit`."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[RequestHandle]:
        """As `Scheduler.submit_all`: every request or none; ValueError, QueueFull (the open
        requests, counted as the child counts them, at max_num_seqs + max_queue),
        SchedulerClosed. An open request is one whose Finished has not reached this process,
        so this count is never below the child's and the child never refuses on its queue."""
        for request in requests:
            validate_request(request, self._vocab, self.max_model_len, sessions=True)
        check_group_size(len(requests), self.max_num_seqs, self.max_queue)
        with self._lock:
            if self._closing or self.failure is not None:
                raise SchedulerClosed(self.failure or "the scheduler is shut down")
            check_room(len(self._handles), len(requests), self.max_num_seqs, self.max_queue)
            handles = []
            for request in requests:
                request = replace(request, id=next(self._ids))
                handles.append(_RemoteHandle(request, self))
                self._handles[request.id] = handles[-1]
        for handle in handles:
            if not self._send(("submit", handle.request)):
                self._end(handle.request.id, "error", "the engine process stopped")
        self._outbox.flush()
        return handles

    def stats(self) -> SchedulerStats:
        return self._stats

    def shutdown(self) -> None:
        """Stop the child: what still runs finishes "cancelled" (sessions saved), then it exits."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._send(("shutdown",))
        self._reader.join(SHUTDOWN_TIMEOUT_S)
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        self._conn.close()

    # --- the pipe ---------------------------------------------------------------------

    def _send(self, message: tuple) -> bool:
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):  # the child is gone (or the pipe closed)
                return False

    def _read(self) -> None:
        """The reader thread: deliver each step's events; if the engine process dies, end the
        open requests with an error and start it again (at most RESTARTS times in RESTART_WINDOW_S)."""
        while True:
            self._pump()
            if self._closing:
                break
            self._process.join(1)  # for its exit code; not under the lock submitters take
            stopped = f"the engine process stopped ({_exit(self._process.exitcode)})"
            self.failure, self.restarting = f"{stopped}; restarting it", True
            self._end_open(stopped)
            if not self._may_restart():
                self.failure = (
                    f"{stopped}, {RESTARTS} times in {RESTART_WINDOW_S // 60} minutes: restart the server"
                )
                break
            log.error("%s; restarting it (open requests ended with an error)", stopped)
            try:
                self._start_child()
            except EngineFailed as exc:
                self.failure = f"{stopped}, and starting it again failed: {exc}"
                break
            finally:
                self.restarting = False
            log.error("the engine process serves again")
            self.failure = None
        self._end_open(self.failure or "the engine process stopped")

    def _may_restart(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        if len(self._restarts) >= RESTARTS:
            return False
        self._restarts.append(now)
        return True

    def _end_open(self, why: str) -> None:
        """The engine process is gone: nobody will finish the open requests but this."""
        with self._lock:
            open_ids = list(self._handles)
        for rid in open_ids:
            self._end(rid, "cancelled" if self._closing else "error", why, code="engine_stopped")
        self._outbox.flush()

    def _pump(self) -> None:
        """Deliver each step's events, one wake-up per event loop per step, until the pipe ends."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "events":
                    _, events, self._stats = message
                    with self._lock:  # once per step; a Finished frees its id
                        routed = [
                            (
                                self._handles.pop(rid, None)
                                if isinstance(e, Finished)
                                else self._handles.get(rid),
                                e,
                            )
                            for rid, e in events
                        ]
                    for handle, event in routed:
                        if handle is not None:
                            handle.emit(event)
                elif kind == "stats":
                    self._stats = message[1]
                elif kind == "refused":
                    self._end(message[1], "error", message[2], refused=message[3])
                elif kind == "bye":
                    break
                self._outbox.flush()
        except (EOFError, OSError):
            pass

    def _end(
        self, rid: int, reason: str, error: str | None, refused: str | None = None, code: str | None = None
    ) -> None:
        with self._lock:
            handle = self._handles.pop(rid, None)
        if handle is not None:
            prompt = len(handle.request.prompt)
            code = code if reason == "error" else None
            handle.emit(Finished(reason, prompt, 0, 0, None, error=error, refused=refused, code=code))


def _exit(code: int | None) -> str:
    """How a process ended, in words: 'exit code 1', 'killed by signal 9 (SIGKILL)'."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


def refusal_kind(exc: Exception) -> str:
    """What a refused submit maps to: "queue_full" (429), "closed" (503), "invalid" (400)."""
    if isinstance(exc, QueueFull):
        return "queue_full"
    return "closed" if isinstance(exc, SchedulerClosed) else "invalid"


def cpu_split(threads: int | None) -> tuple[list[int], list[int]] | None:
    """(engine CPUs, HTTP CPUs) of the CPUs this process may use: the engine the last `threads`
    (default: all but one), the HTTP process the rest. None when there is nothing to split: one
    CPU, `threads` covering them all, or no sched_setaffinity (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    n = threads if threads is not None else default_engine_threads()
    if not 1 <= n < len(cpus):
        return None
    return cpus[-n:], cpus[:-n]


def default_engine_threads() -> int:
    """Without --threads: one torch thread fewer than the CPUs this process may use (the HTTP
    process needs one, and intra-op threads spin on the CPUs they share with it)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, usable - 1)


def _pin_process(cpus: list[int]) -> None:
    """Every thread of this process onto `cpus` (affinity is per thread on Linux; threads started
    later inherit their creator's)."""
    tasks = "/proc/self/task"
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else [0]:
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


STATS_PUSH_S = 2.0  # a cluster's head sends its stats this often, so /health sees a lost rank


def _push_stats(send, scheduler: Scheduler) -> None:
    while True:
        time.sleep(STATS_PUSH_S)
        send(("stats", scheduler.stats()))


def _thread_locks_for_progress() -> None:
    """tqdm's progress bars (the first --ram-gb run converts experts with one) lock with a
    threading lock here, not its default process-shared semaphore: a semaphore of an engine
    process that is SIGKILLed is never released, and the resource tracker warns about it (with a
    source line) when the server stops."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return
    tqdm.set_lock(threading.RLock())


def _engine_main(conn, config: ServerConfig, max_model_len: int, cpus: list[int] | None = None) -> None:
    """The child: load the model, run a Scheduler whose events go down the pipe, obey commands.
    `cpus`: run on these (`cpu_split`), with one torch thread each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    _thread_locks_for_progress()
    if cpus is not None:
        _pin_process(cpus)
    send_lock = threading.Lock()
    handles: dict[int, RequestHandle] = {}  # open requests, for cancels
    finished: set[int] = set()  # ended before the command loop recorded them
    handles_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock, contextlib.suppress(OSError, ValueError):  # the parent gone: the loop sees EOF
            conn.send(message)

    def sink(events: list) -> None:
        out = []
        for handle, event in events:
            out.append((handle.request.id, event))
            if isinstance(event, Finished):
                with handles_lock:
                    if handles.pop(handle.request.id, None) is None:
                        finished.add(handle.request.id)
        send(("events", out, scheduler.stats()))

    try:
        engine = config.engine
        if engine.threads is None:  # leave a core to the HTTP process (torch would take them all)
            engine = replace(engine, threads=len(cpus) if cpus else default_engine_threads())
        loaded = load(
            config.model,
            engine,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            draft_tokens=config.speculative_draft_tokens,
        )
        scheduler = Scheduler.for_server(config, loaded, max_model_len, sink=sink)
        scheduler.start()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which reports it to the user
        send(("failed", user_message(exc)))
        return
    send(("ready", scheduler.stats()))
    if loaded.cluster is not None:  # a rank can be lost (or come back) while nothing runs
        threading.Thread(
            target=_push_stats, args=(send, scheduler), name="latentkv-stats", daemon=True
        ).start()
    while True:
        try:
            if not conn.poll(HEALTH_EVERY_S):
                if scheduler.streamer is not None and scheduler.streamer.health.degraded:
                    send(("stats", scheduler.stats()))  # rechecks the damage: /health sees a repair
                continue
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "submit":
            request = message[1]
            try:
                handle = scheduler.submit(request)
            except (ValueError, QueueFull, SchedulerClosed) as exc:
                send(("refused", request.id, str(exc), refusal_kind(exc)))
            else:
                with handles_lock:
                    if request.id in finished:
                        finished.discard(request.id)
                    else:
                        handles[request.id] = handle
            send(("stats", scheduler.stats()))
        elif kind == "cancel":
            with handles_lock:
                handle = handles.get(message[1])
            if handle is not None:
                handle.cancel()
        elif kind == "shutdown":
            break
    scheduler.shutdown()
    send(("bye",))
