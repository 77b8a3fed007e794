"""Continuous batching: one worker thread owns the model; requests come and go between steps.

    scheduler = Scheduler(model, model.tier("tq4"), max_num_seqs=8, kv_dir=..., model_dir=...)
    scheduler.start()
    handle = scheduler.submit(Request(prompt_ids, SamplingParams(max_tokens=64)))  # never blocks
    for event in handle:            # (or `async for`): TokenEvent ..., then exactly one Finished
        ...
    scheduler.shutdown()            # what is still queued or running finishes "cancelled"

This module is the front: the queue, the lock, the worker thread and its loop, `submit` and
`stats`. The worker's half, the running sequences from admission to finish (the model steps,
sampling, sessions saved), is `running` (`Running`; `Drafting` with --speculative). Around them:
`request` (Request, its events, the checks made before queueing), `delivery` (handles and the
outbox that wakes their readers), `sessions` (session names and files, shared with
`--session`), `logprobs`, and `client` (the `EngineClient` protocol this class and
`remote.EngineProcess` implement).

Every step of the worker:
    1. drop cancelled requests (waiting or running): they finish "cancelled", their slot frees
    2. admit waiting requests while fewer than max_num_seqs run: resume the session if any,
       prefill what is not cached (the requests admitted together in one `Model.prefill_batch`
       pass; prompt_logprobs requests with `Model.forward`), sample the first token from its logits
    3. one `Model.decode_batch` over every running sequence (each its own cache), sample each
       sequence's next token; a sequence that samples a stop token or reaches max_tokens leaves.
       With the f32 tier the running caches are placed in one `SlotPool` (their rows side by
       side, one write per layer and step); a leaving sequence's cache gets its own buffers back.

With `speculative` (serve --speculative mtp), step 3 is `running.Drafting.step` instead: each running
sequence drafts with the MTP layer (all draft passes batched), one `Model.verify_batch` pass
checks every sequence's drafts, and each keeps its accepted prefix and rolls its cache back
(`latentkv.engine.speculative`); the counters reach `SchedulerStats.speculative`.

Submitting never blocks: the waiting queue is bounded (QueueFull). HTTP handlers only submit
and read handles; they never run model steps.

Tokens. A sampled stop token ends the request with reason "stop": it is not yielded as a
TokenEvent, but it counts in `completion_tokens` (it was sampled, as vLLM counts it). Logprobs
are of the model's own distribution, log_softmax(logits), whatever the temperature / top_p.

Sampling is `latentkv.engine.sampling.sample` with a generator per request, so a seeded request
draws the same numbers whatever else runs. Batching changes the logits only within float32
rounding (see `latentkv.models.batch`), so greedy and seeded requests give the tokens they give
alone unless two candidates tie within that rounding.

Sessions. A request naming a session resumes `kv_dir/NAME.kv` (`sessions.SessionFiles`, the same
files as `latentkv generate --session NAME --kv-dir DIR`), keeps the saved tokens its prompt starts
with (`cached_tokens`: not prefilled again), and saves the cache's rows when it finishes (also
when cancelled; not after an error), so a finished turn survives a crash or restart. Two
requests on one session never run together: the later one waits in the queue (requests behind
it are admitted meanwhile) and then resumes what the earlier one saved. A file held by another
process finishes the request with "error" and `refused` "session" (so does a session path that is a
directory or not readable): the server answers 409. prompt_logprobs needs every prompt position's logits,
so such a request prefills its whole prompt (cached_tokens 0) and still saves the session.

Errors inside the worker finish the request that raised with reason "error" (a failing batched
step is retried one sequence at a time to find it); the worker and the other requests go on.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from latentkv.engine import sessions
from latentkv.engine.delivery import Outbox, RequestHandle, Sink
from latentkv.engine.grammar import Grammars
from latentkv.engine.request import (
    Finished,
    Request,
    SchedulerClosed,
    SchedulerStats,
    TokenEvent,
    check_group_size,
    check_room,
    validate_request,
)
from latentkv.engine.running import Drafting, Running, Sequence
from latentkv.engine.sampling import SamplingParams
from latentkv.engine.speculative import SpeculativeConfig, check_model

if TYPE_CHECKING:
    from latentkv.cluster.head import Cluster
    from latentkv.experts.device_cache import DeviceCache
    from latentkv.experts.streamed import ExpertStreamer
    from latentkv.kv.cache import KVTier

# the request types, importable from here as from engine.request (tests and callers do)
__all__ = ["Finished", "Request", "SamplingParams", "Scheduler", "SchedulerClosed", "TokenEvent"]


class Scheduler:
    """The in-process `EngineClient` (latentkv.engine.client): the worker thread runs here."""

    failure: str | None = None  # why it can no longer serve (an engine process that died; never here)

    def __init__(
        self,
        model,
        tier: KVTier,
        *,
        max_num_seqs: int = 8,
        max_queue: int = 64,
        max_model_len: int | None = None,
        kv_dir: Path | None = None,
        model_dir: Path | None = None,
        sink: Sink | None = None,
        streamer: ExpertStreamer | None = None,
        device_cache: DeviceCache | None = None,
        speculative: SpeculativeConfig | None = None,
        cluster: Cluster | None = None,
        on_shutdown: Callable[[], None] | None = None,
        grammars: Grammars | None = None,
    ):
        """`sink`: deliver every step's events to this callable as [(handle, event), ...] instead
        of to the handles' iterators (see `delivery.Outbox`). `streamer`: the ExpertStreamer
        serving the model's experts from disk, whose telemetry `stats` reports (and
        `device_cache`'s, the experts' cache on the GPU). `speculative`:
        every running sequence drafts with the MTP layer and all of them are verified in one
        batched pass per step. `grammars`: the model tokenizer's constraints, for requests with
        a grammar (structured output)."""
        limit = model.cfg.max_position_embeddings
        if max_num_seqs < 1 or max_queue < 0:
            raise ValueError(
                f"max_num_seqs must be >= 1 and max_queue >= 0 (got {max_num_seqs}, {max_queue})"
            )
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 1 and the model's context of {limit}")
        self.model = model
        self.tier = tier  # every sequence's cache is made in it (resolved once, by the caller)
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.max_model_len = max_model_len or limit
        self.kv_dir = Path(kv_dir) if kv_dir is not None else None
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.streamer = streamer
        self.device_cache = device_cache
        self.cluster = cluster  # the head of a cluster: its status and every rank's telemetry in stats
        self.speculative = speculative
        self.grammars = grammars
        self._on_shutdown = on_shutdown  # after the worker stops (the server's: `Loaded.close`)
        # sessions need the weights' fingerprint for the KV file header, hence model_dir
        self._sessions = (
            sessions.SessionFiles(model, tier, self.model_dir, self.kv_dir) if model_dir else None
        )
        self._cond = threading.Condition()
        self._outbox = Outbox(sink)
        # the worker's half: admission, the model steps, finishing (engine/running.py)
        shared = dict(lock=self._cond, outbox=self._outbox, on_leave=self._left, session_files=self._sessions)
        self._running = (
            Running(model, tier, max_num_seqs, grammars=grammars, **shared)
            if speculative is None
            else Drafting(model, tier, max_num_seqs, speculative, grammars=grammars, **shared)
        )
        self._capacity = self._running.bytes_per_token * self.max_model_len * max_num_seqs
        if speculative is not None:
            check_model(model)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._busy_sessions: set[str] = set()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._open_count = 0  # submitted and not finished: waiting, being admitted or running

    @classmethod
    def for_server(cls, config, loaded, max_model_len: int, sink: Sink | None = None) -> Scheduler:
        """The scheduler `latentkv serve` runs: config a ServerConfig, loaded the
        `runtime.Loaded` model."""
        from latentkv.config import sessions_dir
        from latentkv.runtime import stop_ids

        tokenizer_json = loaded.directory / "tokenizer.json"
        grammars = (
            Grammars(
                tokenizer_json, loaded.model.cfg.vocab_size, stop_ids(loaded.model.cfg, loaded.directory)
            )
            if tokenizer_json.is_file()
            else None
        )

        return cls(
            loaded.model,
            loaded.tier,
            max_num_seqs=config.max_num_seqs,
            max_queue=config.max_queue,
            max_model_len=max_model_len,
            kv_dir=config.kv_dir if config.kv_dir is not None else sessions_dir(),
            model_dir=loaded.directory,
            sink=sink,
            streamer=loaded.streamer,
            device_cache=loaded.device_cache,
            cluster=loaded.cluster,
            on_shutdown=loaded.close,
            speculative=(
                SpeculativeConfig(draft_tokens=config.speculative_draft_tokens)
                if config.speculative_draft_tokens
                else None
            ),
            grammars=grammars,
        )

    # --- the client side --------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (once)."""
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler was shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="latentkv-scheduler", daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        """Stop the worker; what is still waiting or running finishes with reason "cancelled"."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        else:  # never started: nothing runs, finish what was queued here
            self._finish_all("cancelled")
        hook, self._on_shutdown = self._on_shutdown, None
        if hook is not None:  # a cluster's workers are told the head ends; the usage history is saved
            hook()
        if self.grammars is not None:
            self.grammars.close()

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request; never blocks. ValueError for an invalid request, QueueFull when the
        queue is full, SchedulerClosed after shutdown."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[RequestHandle]:
        """Queue every request or none (a request's n choices); never blocks. The bound is on
        open requests (running, being admitted or waiting): `capacity` = max_num_seqs +
        max_queue. QueueFull when they do not fit now, ValueError when they never can."""
        for request in requests:
            self._validate(request)
        check_group_size(len(requests), self.max_num_seqs, self.max_queue)
        now = time.monotonic()
        seqs = [
            Sequence(
                RequestHandle(r, self._cond, self._outbox),
                r.params,
                list(r.prompt),
                generated=[],
                submitted=now,
            )
            for r in requests
        ]
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler is shut down")
            check_room(self._open_count, len(seqs), self.max_num_seqs, self.max_queue)
            self._open_count += len(seqs)
            self._waiting.extend(seqs)
            self._cond.notify_all()
        return [seq.handle for seq in seqs]

    def stats(self) -> SchedulerStats:
        running = self._running
        with self._cond:
            return SchedulerStats(
                running=len(running.seqs),
                waiting=len(self._waiting),
                prompt_tokens_total=running.prompt_total,
                generation_tokens_total=running.generation_total,
                kv_bytes_in_use=running.kv_in_use,
                kv_bytes_capacity=self._capacity,
                kv_cache_dtype=self.tier.name,
                experts=self.streamer.snapshot() if self.streamer is not None else None,
                device_experts=self.device_cache.snapshot() if self.device_cache is not None else None,
                speculative=running.spec_snapshot,
                cluster=self._cluster_stats(),
            )

    def _cluster_stats(self) -> dict | None:
        """The cluster's status and every rank's latest telemetry (no network: the cluster's
        monitor refreshes the workers' records every few seconds)."""
        if self.cluster is None:
            return None
        return {**self.cluster.status(), "ranks": self.cluster.report(self.streamer, refresh=False)}

    def _validate(self, request: Request) -> None:
        validate_request(request, self.model.cfg.vocab_size, self.max_model_len, self._sessions is not None)
        if request.params.grammar is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer.json")
            if self.speculative is not None:
                raise ValueError("structured output cannot run with --speculative mtp")

    # --- the worker -------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._running.seqs and not self._waiting:
                    self._cond.wait()
                if self._closing:
                    break
                admitted = self._take_admissible()
            try:
                self._step(admitted)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave clients waiting forever
                self._running.fail_all(admitted, exc)
        self._finish_all("cancelled")

    def _step(self, admitted: list[Sequence]) -> None:
        """Drop what was cancelled, start what was admitted, one step of everything running."""
        running = self._running
        with self._cond:
            gone = [s for s in self._waiting if s.handle.cancelled]
            self._waiting = collections.deque(s for s in self._waiting if not s.handle.cancelled)
        running.drop_cancelled(gone)
        running.admit(admitted)
        if running.seqs:
            running.step()
        self._outbox.flush()
        running.update_kv_bytes()

    def _take_admissible(self) -> list[Sequence]:
        """Under the lock: waiting requests to start now (free slots; not on a busy session)."""
        taken, kept = [], collections.deque()
        free = self.max_num_seqs - len(self._running.seqs)
        while self._waiting:
            seq = self._waiting.popleft()
            name = seq.handle.request.session
            if (
                seq.handle.cancelled
                or len(taken) >= free
                or (name is not None and name in self._busy_sessions)
            ):
                kept.append(seq)
                continue
            if name is not None:
                self._busy_sessions.add(name)
            seq.queued_seconds = time.monotonic() - seq.submitted
            taken.append(seq)
        self._waiting = kept
        return taken

    def _left(self, seq: Sequence) -> None:
        """A sequence finished (`Running.finish`): its place in the queue and its session free up."""
        with self._cond:
            self._busy_sessions.discard(seq.handle.request.session)
            self._open_count -= 1
            self._cond.notify_all()

    def _finish_all(self, reason: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        self._running.finish_all(waiting, reason)
