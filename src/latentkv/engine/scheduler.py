"""Continuous batching: one worker thread owns the model; requests come and go between steps.

    scheduler = Scheduler(model, model.tier("tq4"), max_num_seqs=8, kv_dir=..., model_dir=...)
    scheduler.start()
    handle = scheduler.submit(Request(prompt_ids, SamplingParams(max_tokens=64)))  # never blocks
    for event in handle:            # (or `async for`): TokenEvent ..., then exactly one Finished
        ...
    scheduler.shutdown()            # what is still queued or running finishes "cancelled"

This module is the worker's loop. Around it: `request` (Request, its events, the checks made
before queueing), `delivery` (handles and the outbox that wakes their readers), `sessions`
(session names and files, shared with `--session`), `logprobs`, and `client` (the
`EngineClient` protocol this class and `remote.EngineProcess` implement).

Every step of the worker:
    1. drop cancelled requests (waiting or running): they finish "cancelled", their slot frees
    2. admit waiting requests while fewer than max_num_seqs run: resume the session if any,
       prefill what is not cached (the requests admitted together in one `Model.prefill_batch`
       pass; prompt_logprobs requests with `Model.forward`), sample the first token from its logits
    3. one `Model.decode_batch` over every running sequence (each its own cache), sample each
       sequence's next token; a sequence that samples a stop token or reaches max_tokens leaves.
       With the f32 tier the running caches are placed in one `SlotPool` (their rows side by
       side, one write per layer and step); a leaving sequence's cache gets its own buffers back.

With `speculative` (serve --speculative mtp), step 3 is `_verify_step` instead: each running
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
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from latentkv.engine import sessions
from latentkv.engine.delivery import Outbox, RequestHandle, Sink
from latentkv.engine.grammar import Constraint, GrammarError, Grammars
from latentkv.engine.logprobs import prompt_logprobs, token_logprobs
from latentkv.engine.request import (
    Finished,
    Request,
    SchedulerClosed,
    SchedulerStats,
    TokenEvent,
    check_group_size,
    check_room,
    failure_code,
    validate_request,
)
from latentkv.engine.sampling import SamplingParams, sample
from latentkv.engine.speculative import (
    SpeculativeConfig,
    SpeculativeDecoder,
    SpeculativeStats,
    check_model,
    draft_together,
)
from latentkv.errors import Unavailable
from latentkv.kv.slots import SlotPool

if TYPE_CHECKING:
    from latentkv.cluster.head import Cluster
    from latentkv.experts.streamed import ExpertStreamer
    from latentkv.kv.cache import KVTier

log = logging.getLogger("latentkv.engine")


@dataclass
class _Sequence:
    """A request while the worker holds it."""

    handle: RequestHandle
    params: SamplingParams
    prompt: list[int]
    generator: torch.Generator | None = None
    cache: object = None
    session: object = None  # latentkv.kv.store_session.Session, when the request names one
    cached_tokens: int = 0
    generated: list[int] | None = None  # sampled tokens, the stop token included
    pending: int | None = None  # the last sampled token, not yet in the cache
    prompt_logprobs: list[dict | None] | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    submitted: float = 0.0  # time.monotonic() at submission
    queued_seconds: float = 0.0  # from submission to admission
    finished: bool = False
    drafter: SpeculativeDecoder | None = None  # with --speculative mtp, after the first token
    constraint: Constraint | None = None  # the request's grammar (engine.grammar), from admission


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
        speculative: SpeculativeConfig | None = None,
        cluster: Cluster | None = None,
        on_shutdown: Callable[[], None] | None = None,
        grammars: Grammars | None = None,
    ):
        """`sink`: deliver every step's events to this callable as [(handle, event), ...] instead
        of to the handles' iterators (see `delivery.Outbox`). `streamer`: the ExpertStreamer
        serving the model's experts from disk, whose telemetry `stats` reports. `speculative`:
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
        self.cluster = cluster  # the head of a cluster: its status and every rank's telemetry in stats
        self._on_shutdown = on_shutdown  # after the worker stops (the server's: `Loaded.close`)
        # sessions need the weights' fingerprint for the KV file header, hence model_dir
        self._sessions = (
            sessions.SessionFiles(model, tier, self.model_dir, self.kv_dir) if model_dir else None
        )
        probe = model.make_cache(tier)  # fails here, not per request, if the tier is not the model's
        per_token = probe.bytes_per_token_layer() * model.cfg.num_layers + probe.index_bytes_per_token()
        self._capacity = per_token * self.max_model_len * max_num_seqs
        # float32 caches of running sequences live side by side (one write per layer and step)
        self._pool = SlotPool(probe.layout, max_num_seqs) if tier.poolable else None
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._busy_sessions: set[str] = set()
        self._outbox = Outbox(sink)
        self._closing = False
        self._thread: threading.Thread | None = None
        self._prompt_total = 0
        self._generation_total = 0
        self._kv_in_use = 0
        self._open_count = 0  # submitted and not finished: waiting, being admitted or running
        self.speculative = speculative
        if speculative is not None:
            check_model(model)
        self._spec_stats = SpeculativeStats(speculative.draft_tokens) if speculative else None
        self._spec_snapshot: dict | None = None
        self.grammars = grammars

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
            _Sequence(
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
        with self._cond:
            return SchedulerStats(
                running=len(self._running),
                waiting=len(self._waiting),
                prompt_tokens_total=self._prompt_total,
                generation_tokens_total=self._generation_total,
                kv_bytes_in_use=self._kv_in_use,
                kv_bytes_capacity=self._capacity,
                kv_cache_dtype=self.tier.name,
                experts=self.streamer.snapshot() if self.streamer is not None else None,
                speculative=self._spec_snapshot,
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
                while not self._closing and not self._running and not self._waiting:
                    self._cond.wait()
                if self._closing:
                    break
                admitted = self._take_admissible()
            try:
                self._step(admitted)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave clients waiting forever
                for seq in admitted + self._running:
                    if not seq.finished:
                        self._fail(seq, exc)
                self._outbox.flush()
        self._finish_all("cancelled")

    def _step(self, admitted: list[_Sequence]) -> None:
        self._drop_cancelled()
        self._admit(admitted)
        if self._running:
            self._decode_step()
        self._outbox.flush()
        self._update_kv_bytes()

    def _take_admissible(self) -> list[_Sequence]:
        """Under the lock: waiting requests to start now (free slots; not on a busy session)."""
        taken, kept = [], collections.deque()
        free = self.max_num_seqs - len(self._running)
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

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [s for s in self._waiting if s.handle.cancelled]
            self._waiting = collections.deque(s for s in self._waiting if not s.handle.cancelled)
        for seq in gone + [s for s in self._running if s.handle.cancelled]:
            self._finish(seq, "cancelled")

    def _guarded(self, seq: _Sequence, step, *args):
        """Run one sequence's step and return what it returns; an exception finishes that
        request with reason "error" (and returns None)."""
        try:
            return step(seq, *args)
        except sessions.SessionUnavailable as exc:  # not a failure of the model: the client is told 409
            self._finish(seq, "error", str(exc), refused="session")
            return None
        except Unavailable as exc:  # a cluster rank is gone: the client is told 503, with the reason
            self._finish(seq, "error", str(exc), refused="unavailable")
            return None
        except GrammarError as exc:  # the request's grammar, not the model: the client is told 400
            self._finish(seq, "error", str(exc), refused="invalid" if not seq.generated else None)
            return None
        except Exception as exc:  # noqa: BLE001 - the worker must outlive any one request
            self._fail(seq, exc)
            return None

    def _fail(self, seq: _Sequence, exc: Exception) -> None:
        """Finish `seq` with reason "error": a damaged expert store or a refusing disk is one log
        line and a `Finished.code` (the server's 503); anything else is a bug, with its traceback."""
        code = failure_code(exc)
        if code is None:
            traceback.print_exception(exc)
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
        else:
            log.error("request failed (%s): %s", code, exc)
            self._finish(seq, "error", str(exc), code=code)

    def _admit(self, admitted: list[_Sequence]) -> None:
        """Start the admitted requests: open (or resume) each one's cache, prefill what is not
        cached, sample the first token. Those that need only their last logits are prefilled
        together in one pass (`Model.prefill_batch`); prompt_logprobs requests, and all of them
        when the batched pass fails (so the one that fails is found), one at a time."""
        opened = [(seq, todo) for seq in admitted if (todo := self._guarded(seq, self._open)) is not None]
        together = [(seq, todo) for seq, todo in opened if not seq.params.prompt_logprobs]
        if len(together) > 1 and self._prefill_together(together):
            opened = [(seq, todo) for seq, todo in opened if seq.params.prompt_logprobs]
        for seq, todo in opened:
            self._guarded(seq, self._prefill, todo)
            self._outbox.flush()  # its first token now, not after the others' prefills

    def _prefill_together(self, together: list[tuple[_Sequence, list[int]]]) -> bool:
        """One `Model.prefill_batch` pass for these; False (nothing committed) if it fails."""
        t0 = time.perf_counter()
        try:
            prompts = [torch.tensor(todo, dtype=torch.long) for _, todo in together]
            caches = [seq.cache for seq, _ in together]
            if self.speculative:
                logits, h = self.model.prefill_batch(prompts, caches, hidden=True)
                hidden = list(h.split([len(todo) for _, todo in together]))
            else:
                logits, hidden = self.model.prefill_batch(prompts, caches), [None] * len(together)
        except Unavailable as exc:
            self._fail_unavailable([seq for seq, _ in together], exc)
            return True
        except Exception:  # noqa: BLE001 - the caller prefills each on its own, which finds the culprit
            return False
        seconds = time.perf_counter() - t0
        for (seq, todo), row, h in zip(together, logits, hidden, strict=True):
            self._guarded(seq, self._start, todo, row[None], seconds, h)
        self._outbox.flush()
        return True

    def _open(self, seq: _Sequence) -> list[int]:
        """The request's generator and cache (its session resumed); returns the tokens to prefill."""
        seq.generator = None if seq.params.greedy else seq.params.generator()
        if seq.params.grammar is not None:
            seq.constraint = self.grammars.constraint(seq.params.grammar)
        return self._open_cache(seq)

    def _prefill(self, seq: _Sequence, todo: list[int]) -> None:
        t0 = time.perf_counter()
        ids = torch.tensor(todo, dtype=torch.long)
        all_logits = seq.params.prompt_logprobs
        if self.speculative is not None:
            logits, hidden = self.model.forward(ids, seq.cache, all_logits=all_logits, hidden=True)
        else:
            logits, hidden = self.model.forward(ids, seq.cache, all_logits=all_logits), None
        self._start(seq, todo, logits, time.perf_counter() - t0, hidden)

    def _start(
        self,
        seq: _Sequence,
        todo: list[int],
        logits: torch.Tensor,
        seconds: float,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """After its prefill (logits [S or 1, vocab]; with drafting, the prompt's hidden states
        [S, D]): the sequence runs, or finishes at once."""
        params = seq.params
        seq.prefill_seconds = seconds
        with self._cond:
            self._prompt_total += len(todo)
        if params.prompt_logprobs:
            seq.prompt_logprobs = prompt_logprobs(seq.prompt, logits, params.logprobs)
        if self._pool is not None:
            self._pool.place(seq.cache)  # False (left in its own buffers) only past the pool's bound
        self._running.append(seq)
        if params.max_tokens == 0:
            self._finish(seq, "length")
            return
        self._advance(seq, logits[-1])
        if self.speculative is not None and not seq.finished:
            seq.drafter = SpeculativeDecoder(
                self.model, seq.cache, seq.params, self.speculative, self._spec_stats, seq.generator
            )
            seq.drafter.begin(todo, hidden, seq.pending)

    def _open_cache(self, seq: _Sequence) -> list[int]:
        """The sequence's cache (resumed from its session, if any); returns the tokens to prefill."""
        name = seq.handle.request.session
        if name is None:
            seq.cache = self.model.make_cache(self.tier)
            return seq.prompt
        seq.session, seq.cache = self._sessions.open(name)
        todo = sessions.resume(seq.session, seq.cache, seq.prompt, reuse=not seq.params.prompt_logprobs)
        seq.cached_tokens = len(seq.prompt) - len(todo)
        return todo

    def _decode_step(self) -> None:
        """One batched decode over every running sequence, then each samples its next token."""
        if self.speculative is not None:
            self._verify_step()
            return
        seqs = list(self._running)
        tokens = torch.tensor([s.pending for s in seqs], dtype=torch.long)
        if self.grammars is not None:  # the constrained sequences' masks, computed during the pass
            self.grammars.prepare([s.constraint for s in seqs if s.constraint is not None])
        t0 = time.perf_counter()
        try:
            rows = list(self.model.decode_batch(tokens, [s.cache for s in seqs], self._pool))
        except Unavailable as exc:  # the whole step is lost (no retry: its caches are half written)
            self._fail_unavailable(seqs, exc)
            return
        except Exception:  # noqa: BLE001 - find the sequence that fails; the others go on
            rows = [self._decode_alone(s) for s in seqs]
        seconds = time.perf_counter() - t0
        for seq, logits in zip(seqs, rows, strict=True):
            if logits is not None:
                seq.decode_seconds += seconds
                self._guarded(seq, self._advance, logits)

    def _fail_unavailable(self, seqs: list[_Sequence], exc: Unavailable) -> None:
        """A step that needed a lost cluster rank: every sequence in it fails (503 with the
        reason; their session files keep the last saved turn)."""
        for seq in seqs:
            self._finish(seq, "error", str(exc), refused="unavailable")

    def _decode_alone(self, seq: _Sequence) -> torch.Tensor | None:
        try:
            return self.model.decode_batch(torch.tensor([seq.pending]), [seq.cache])[0]
        except Unavailable as exc:
            self._finish(seq, "error", str(exc), refused="unavailable")
            return None
        except Exception as exc:  # noqa: BLE001
            self._fail(seq, exc)
            return None

    def _verify_step(self) -> None:
        """Speculative decoding: each running sequence drafts (or, paused, feeds its pending
        token alone), one batched pass verifies every sequence's segment, and each keeps its
        accepted prefix (`latentkv.engine.speculative`)."""
        counts = {}
        for seq in list(self._running):
            n = self._guarded(seq, lambda s: s.drafter.decide(s.params.max_tokens - len(s.generated)))
            if n is not None:
                counts[id(seq)] = (seq, n)
        seqs = [seq for seq, _ in counts.values()]
        if not seqs:
            return
        # every sequence's draft-layer passes together (a failure here is the worker's: all fail)
        draft_together(self.model, [s.drafter for s in seqs], [n for _, n in counts.values()])
        segments = [torch.tensor(s.drafter.feed(), dtype=torch.long) for s in seqs]
        t0 = time.perf_counter()
        try:
            logits, h = self.model.verify_batch(segments, [s.cache for s in seqs])
            sizes = [len(seg) for seg in segments]
            outs = list(zip(logits.split(sizes), h.split(sizes), strict=True))
        except Unavailable as exc:
            self._fail_unavailable(seqs, exc)
            return
        except Exception:  # noqa: BLE001 - find the sequence that fails; the others go on
            outs = [self._verify_alone(s, seg) for s, seg in zip(seqs, segments, strict=True)]
        seconds = time.perf_counter() - t0
        for seq, seg, out in zip(seqs, segments, outs, strict=True):
            if out is not None:
                seq.decode_seconds += seconds
                self._guarded(seq, self._settle, out, len(seg), seconds)

    def _verify_alone(self, seq: _Sequence, segment: torch.Tensor):
        try:
            return self.model.verify_batch([segment], [seq.cache])
        except Unavailable as exc:
            self._finish(seq, "error", str(exc), refused="unavailable")
            return None
        except Exception as exc:  # noqa: BLE001
            self._fail(seq, exc)
            return None

    def _settle(
        self, seq: _Sequence, out: tuple[torch.Tensor, torch.Tensor], fed: int, seconds: float
    ) -> None:
        """A verified segment's logits and hidden states -> the tokens it yields, each taken in turn."""
        logits, hidden = out
        tokens = seq.drafter.settle(logits, hidden)
        seq.drafter.record(fed - 1, len(tokens), seconds)
        for row, token in zip(logits, tokens, strict=False):  # token j was chosen from row j
            self._take(seq, token, row)
            if seq.finished:
                break

    def _advance(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """Sample the next token from logits [vocab] (only what its grammar allows, if it has
        one): yield it, or finish."""
        allowed = logits if seq.constraint is None else seq.constraint.allow(logits)
        self._take(seq, sample(allowed, seq.params, seq.generator), logits)

    def _take(self, seq: _Sequence, token: int, logits: torch.Tensor) -> None:
        """`token`, chosen from logits [vocab]: yield it, or finish."""
        params = seq.params
        seq.generated.append(token)
        with self._cond:
            self._generation_total += 1
        if token in params.stop_token_ids:
            self._finish(seq, "stop")
            return
        logprob, top = None, None
        if params.logprobs is not None:
            logprob, top = token_logprobs(logits, token, params.logprobs)
        seq.handle.emit(TokenEvent(token, logprob, top))
        if seq.constraint is not None:
            seq.constraint.consume(token)
            if seq.constraint.stopped:  # the grammar is complete: nothing but the end may follow
                self._finish(seq, "stop")
                return
        if len(seq.generated) >= params.max_tokens:
            self._finish(seq, "length")
        else:
            seq.pending = token

    def _finish(
        self,
        seq: _Sequence,
        reason: str,
        error: str | None = None,
        refused: str | None = None,
        code: str | None = None,
    ) -> None:
        """The request leaves: save its session (unless it failed), free its slot, tell the client."""
        if seq.finished:
            return
        seq.finished = True
        if seq.drafter is not None and seq.generated:  # verified tokens past the end: as plain decoding
            seq.cache.trim(min(seq.cache.length, len(seq.prompt) + len(seq.generated) - 1))
        if seq in self._running:
            self._running.remove(seq)
        if self._pool is not None and seq.cache is not None:
            self._pool.release(seq.cache)
        if seq.session is not None and (failed := self._close_session(seq, save=reason != "error")):
            error, code = failed
        name = seq.handle.request.session
        with self._cond:
            self._busy_sessions.discard(name)
            self._open_count -= 1
            self._cond.notify_all()
        seq.handle.emit(
            Finished(
                reason="error" if error else reason,
                prompt_tokens=len(seq.prompt),
                completion_tokens=len(seq.generated or ()),
                cached_tokens=seq.cached_tokens,
                prompt_logprobs=seq.prompt_logprobs,
                error=error,
                prefill_seconds=seq.prefill_seconds,
                decode_seconds=seq.decode_seconds,
                queued_seconds=seq.queued_seconds,
                refused=refused,
                code=code if error else None,
            )
        )

    def _close_session(self, seq: _Sequence, save: bool) -> tuple[str, str | None] | None:
        """Save the cache's rows (prompt + every generated token fed back) and close the file;
        (error, Finished.code) when saving failed (the file keeps its last commit)."""
        session, seq.session = seq.session, None
        try:
            if save:
                sessions.save(session, seq.prompt + seq.generated, seq.cache)
            return None
        except Exception as exc:  # noqa: BLE001
            code = failure_code(exc)
            text = f"saving session {seq.handle.request.session!r} failed: {exc}"
            if code is None:
                traceback.print_exception(exc)
            else:
                log.error("%s", text)
            return text, code
        finally:
            session.close()

    def _finish_all(self, reason: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in list(self._running) + waiting:
            self._finish(seq, reason)
        self._outbox.flush()
        self._update_kv_bytes()

    def _update_kv_bytes(self) -> None:
        total = sum(s.cache.nbytes() + s.cache.index_nbytes() for s in self._running)
        spec = self._spec_stats.as_dict() if self._spec_stats is not None else None
        with self._cond:
            self._kv_in_use = total
            self._spec_snapshot = spec
