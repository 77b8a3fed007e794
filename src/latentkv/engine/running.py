"""The worker's half of the scheduler: the sequences on the model, from admission to finish.

`Scheduler` (engine/scheduler.py) is the front: the queue, the lock, the worker thread and its
loop, `submit` and `stats`. Each step it hands `Running` what it admitted and asks for one step:

    admit     open each request's cache (its session resumed), prefill what is not cached (those
              that need only their last logits together, in one `Model.prefill_batch` pass),
              sample the first token
    step      one `Model.decode_batch` over every running sequence and a token for each;
              `Drafting` (--speculative mtp) drafts with the MTP layer instead and verifies every
              sequence in one `Model.verify_batch` pass (`latentkv.engine.speculative`)
    finish    save the session (unless it failed), free the slot, emit `Finished`, and tell the
              front (`on_leave`), which frees the request's place in the queue and its session

Only the worker thread calls a `Running`. The totals the front's `stats` reads (prompt and
generated tokens, KV bytes in use, the drafting counters) are written under the front's lock.

Failures stay with the request that raised: a failing batched pass is retried one sequence at a
time to find it. A lost cluster rank (`Unavailable`) fails every sequence of the step it hit,
with no retry (their caches are half written): the client is told 503 with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from latentkv.engine import sessions
from latentkv.engine.delivery import Outbox, RequestHandle
from latentkv.engine.grammar import Constraint, GrammarError, Grammars
from latentkv.engine.logprobs import prompt_logprobs, token_logprobs
from latentkv.engine.request import Finished, TokenEvent, failure_code
from latentkv.engine.sampling import SamplingParams, sample
from latentkv.engine.speculative import (
    SpeculativeConfig,
    SpeculativeDecoder,
    SpeculativeStats,
    draft_together,
)
from latentkv.errors import Unavailable
from latentkv.kv.cache import KVTier
from latentkv.kv.slots import SlotPool

log = logging.getLogger("latentkv.engine")


@dataclass
class Sequence:
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


class Running:
    """The running sequences and the model steps over them (see the module's docstring)."""

    prefill_hidden = False  # whether prefill keeps the prompt's hidden states (drafting reads them)

    def __init__(
        self,
        model,
        tier: KVTier,
        max_num_seqs: int,
        *,
        lock: threading.Condition,
        outbox: Outbox,
        on_leave: Callable[[Sequence], None],
        session_files: sessions.SessionFiles | None = None,
        grammars: Grammars | None = None,
    ):
        self.model = model
        self.tier = tier  # every sequence's cache is made in it
        self.seqs: list[Sequence] = []
        probe = model.make_cache(tier)  # fails here, not per request, if the tier is not the model's
        self.bytes_per_token = tier.bytes_per_token
        # float32 caches of running sequences live side by side (one write per layer and step)
        self.pool = SlotPool(probe.layout, max_num_seqs) if tier.poolable else None
        self._lock = lock
        self._outbox = outbox
        self._on_leave = on_leave
        self._sessions = session_files
        self.grammars = grammars
        self._spec_stats: SpeculativeStats | None = None  # drafting's counters (`Drafting`)
        # read by the front's `stats`, written under `lock`
        self.prompt_total = 0
        self.generation_total = 0
        self.kv_in_use = 0
        self.spec_snapshot: dict | None = None

    # --- admission ----------------------------------------------------------------------

    def admit(self, admitted: list[Sequence]) -> None:
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

    def _prefill_together(self, together: list[tuple[Sequence, list[int]]]) -> bool:
        """One `Model.prefill_batch` pass for these; False (nothing committed) if it fails."""
        t0 = time.perf_counter()
        try:
            prompts = [torch.tensor(todo, dtype=torch.long, device=self.model.device) for _, todo in together]
            caches = [seq.cache for seq, _ in together]
            if self.prefill_hidden:
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

    def _open(self, seq: Sequence) -> list[int]:
        """The request's generator and cache (its session resumed); returns the tokens to prefill."""
        seq.generator = None if seq.params.greedy else seq.params.generator()
        if seq.params.grammar is not None:
            seq.constraint = self.grammars.constraint(seq.params.grammar)
        return self._open_cache(seq)

    def _open_cache(self, seq: Sequence) -> list[int]:
        """The sequence's cache (resumed from its session, if any); returns the tokens to prefill."""
        name = seq.handle.request.session
        if name is None:
            seq.cache = self.model.make_cache(self.tier)
            return seq.prompt
        seq.session, seq.cache = self._sessions.open(name)
        todo = sessions.resume(seq.session, seq.cache, seq.prompt, reuse=not seq.params.prompt_logprobs)
        seq.cached_tokens = len(seq.prompt) - len(todo)
        return todo

    def _prefill(self, seq: Sequence, todo: list[int]) -> None:
        t0 = time.perf_counter()
        ids = torch.tensor(todo, dtype=torch.long, device=self.model.device)
        all_logits = seq.params.prompt_logprobs
        if self.prefill_hidden:
            logits, hidden = self.model.forward(ids, seq.cache, all_logits=all_logits, hidden=True)
        else:
            logits, hidden = self.model.forward(ids, seq.cache, all_logits=all_logits), None
        self._start(seq, todo, logits, time.perf_counter() - t0, hidden)

    def _start(
        self,
        seq: Sequence,
        todo: list[int],
        logits: torch.Tensor,
        seconds: float,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """After its prefill (logits [S or 1, vocab]; with drafting, the prompt's hidden states
        [S, D]): the sequence runs, or finishes at once."""
        params = seq.params
        seq.prefill_seconds = seconds
        with self._lock:
            self.prompt_total += len(todo)
        if params.prompt_logprobs:
            seq.prompt_logprobs = prompt_logprobs(seq.prompt, logits, params.logprobs)
        if self.pool is not None:
            self.pool.place(seq.cache)  # False (left in its own buffers) only past the pool's bound
        self.seqs.append(seq)
        if params.max_tokens == 0:
            self.finish(seq, "length")
            return
        self._advance(seq, logits[-1])
        if not seq.finished:
            self._on_first_token(seq, todo, hidden)

    def _on_first_token(self, seq: Sequence, todo: list[int], hidden: torch.Tensor | None) -> None:
        """The sequence has its first token and runs on (`Drafting` gives it a drafter here)."""

    # --- one step of every running sequence -------------------------------------------

    def step(self) -> None:
        """One batched decode over every running sequence, then each samples its next token."""
        seqs = list(self.seqs)
        tokens = torch.tensor([s.pending for s in seqs], dtype=torch.long, device=self.model.device)
        if self.grammars is not None:  # the constrained sequences' masks, computed during the pass
            self.grammars.prepare([s.constraint for s in seqs if s.constraint is not None])
        t0 = time.perf_counter()
        try:
            rows = list(self.model.decode_batch(tokens, [s.cache for s in seqs], self.pool))
        except Unavailable as exc:  # the whole step is lost (no retry: its caches are half written)
            self._fail_unavailable(seqs, exc)
            return
        except Exception:  # noqa: BLE001 - find the sequence that fails; the others go on
            rows = [self._guarded(s, self._decode_alone) for s in seqs]
        seconds = time.perf_counter() - t0
        for seq, logits in zip(seqs, rows, strict=True):
            if logits is not None:
                seq.decode_seconds += seconds
                self._guarded(seq, self._advance, logits)

    def _decode_alone(self, seq: Sequence) -> torch.Tensor:
        """One sequence's decode pass on its own (run through `_guarded` after a batch failed)."""
        one = torch.tensor([seq.pending], device=self.model.device)
        return self.model.decode_batch(one, [seq.cache])[0]

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token from logits [vocab] (only what its grammar allows, if it has
        one): yield it, or finish."""
        allowed = logits if seq.constraint is None else seq.constraint.allow(logits)
        self._take(seq, sample(allowed, seq.params, seq.generator), logits)

    def _take(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """`token`, chosen from logits [vocab]: yield it, or finish."""
        params = seq.params
        seq.generated.append(token)
        with self._lock:
            self.generation_total += 1
        if token in params.stop_token_ids:
            self.finish(seq, "stop")
            return
        logprob, top = None, None
        if params.logprobs is not None:
            logprob, top = token_logprobs(logits, token, params.logprobs)
        seq.handle.emit(TokenEvent(token, logprob, top))
        if seq.constraint is not None:
            seq.constraint.consume(token)
            if seq.constraint.stopped:  # the grammar is complete: nothing but the end may follow
                self.finish(seq, "stop")
                return
        if len(seq.generated) >= params.max_tokens:
            self.finish(seq, "length")
        else:
            seq.pending = token

    # --- failures and finishing --------------------------------------------------------

    def _guarded(self, seq: Sequence, step, *args):
        """Run one sequence's step and return what it returns; an exception finishes that
        request with reason "error" (and returns None)."""
        try:
            return step(seq, *args)
        except sessions.SessionUnavailable as exc:  # not a failure of the model: the client is told 409
            self.finish(seq, "error", str(exc), refused="session")
            return None
        except Unavailable as exc:  # a cluster rank is gone: the client is told 503, with the reason
            self.finish(seq, "error", str(exc), refused="unavailable")
            return None
        except GrammarError as exc:  # the request's grammar, not the model: the client is told 400
            self.finish(seq, "error", str(exc), refused="invalid" if not seq.generated else None)
            return None
        except Exception as exc:  # noqa: BLE001 - the worker must outlive any one request
            self.fail(seq, exc)
            return None

    def _fail_unavailable(self, seqs: list[Sequence], exc: Unavailable) -> None:
        """A step that needed a lost cluster rank: every sequence in it fails (503 with the
        reason; their session files keep the last saved turn)."""
        for seq in seqs:
            self.finish(seq, "error", str(exc), refused="unavailable")

    def fail(self, seq: Sequence, exc: Exception) -> None:
        """Finish `seq` with reason "error": a damaged expert store or a refusing disk is one log
        line and a `Finished.code` (the server's 503); anything else is a bug, with its traceback."""
        code = failure_code(exc)
        if code is None:
            traceback.print_exception(exc)
            self.finish(seq, "error", f"{type(exc).__name__}: {exc}")
        else:
            log.error("request failed (%s): %s", code, exc)
            self.finish(seq, "error", str(exc), code=code)

    def fail_all(self, admitted: list[Sequence], exc: Exception) -> None:
        """A step that raised past every guard (a bug): whatever it held fails, so no client waits
        forever."""
        for seq in admitted + self.seqs:
            if not seq.finished:
                self.fail(seq, exc)
        self._outbox.flush()

    def drop_cancelled(self, waiting: list[Sequence]) -> None:
        """Finish `waiting` (cancelled before admission) and every cancelled running sequence."""
        for seq in waiting + [s for s in self.seqs if s.handle.cancelled]:
            self.finish(seq, "cancelled")

    def finish_all(self, waiting: list[Sequence], reason: str) -> None:
        """Finish every running sequence and `waiting` (the front's queue) with `reason`."""
        for seq in list(self.seqs) + waiting:
            self.finish(seq, reason)
        self._outbox.flush()
        self.update_kv_bytes()

    def finish(
        self,
        seq: Sequence,
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
        if seq in self.seqs:
            self.seqs.remove(seq)
        if self.pool is not None and seq.cache is not None:
            self.pool.release(seq.cache)
        if seq.session is not None and (failed := self._close_session(seq, save=reason != "error")):
            error, code = failed
        self._on_leave(seq)
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

    def _close_session(self, seq: Sequence, save: bool) -> tuple[str, str | None] | None:
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

    def update_kv_bytes(self) -> None:
        """Refresh what `stats` reports of the running caches and the drafting counters."""
        total = sum(s.cache.nbytes() + s.cache.index_nbytes() for s in self.seqs)
        spec = self._spec_stats.as_dict() if self._spec_stats is not None else None
        with self._lock:
            self.kv_in_use = total
            self.spec_snapshot = spec


class Drafting(Running):
    """`Running` with MTP speculative decoding (`serve --speculative mtp`): every sequence drafts
    after its first token, and a step verifies all of them in one batched pass."""

    prefill_hidden = True

    def __init__(self, model, tier: KVTier, max_num_seqs: int, speculative: SpeculativeConfig, **kw):
        super().__init__(model, tier, max_num_seqs, **kw)
        self.speculative = speculative
        self._spec_stats = SpeculativeStats(speculative.draft_tokens)

    def _on_first_token(self, seq: Sequence, todo: list[int], hidden: torch.Tensor | None) -> None:
        seq.drafter = SpeculativeDecoder(
            self.model, seq.cache, seq.params, self.speculative, self._spec_stats, seq.generator
        )
        seq.drafter.begin(todo, hidden, seq.pending)

    def step(self) -> None:
        """Speculative decoding: each running sequence drafts (or, paused, feeds its pending
        token alone), one batched pass verifies every sequence's segment, and each keeps its
        accepted prefix (`latentkv.engine.speculative`)."""
        counts = {}
        for seq in list(self.seqs):
            n = self._guarded(seq, lambda s: s.drafter.decide(s.params.max_tokens - len(s.generated)))
            if n is not None:
                counts[id(seq)] = (seq, n)
        seqs = [seq for seq, _ in counts.values()]
        if not seqs:
            return
        # every sequence's draft-layer passes together (a failure here is the worker's: all fail)
        draft_together(self.model, [s.drafter for s in seqs], [n for _, n in counts.values()])
        segments = [torch.tensor(s.drafter.feed(), dtype=torch.long, device=self.model.device) for s in seqs]
        t0 = time.perf_counter()
        try:
            logits, h = self.model.verify_batch(segments, [s.cache for s in seqs])
            sizes = [len(seg) for seg in segments]
            outs = list(zip(logits.split(sizes), h.split(sizes), strict=True))
        except Unavailable as exc:
            self._fail_unavailable(seqs, exc)
            return
        except Exception:  # noqa: BLE001 - find the sequence that fails; the others go on
            outs = [self._guarded(s, self._verify_alone, seg) for s, seg in zip(seqs, segments, strict=True)]
        seconds = time.perf_counter() - t0
        for seq, seg, out in zip(seqs, segments, outs, strict=True):
            if out is not None:
                seq.decode_seconds += seconds
                self._guarded(seq, self._settle, out, len(seg), seconds)

    def _verify_alone(self, seq: Sequence, segment: torch.Tensor):
        """One sequence's verify pass on its own (run through `_guarded` after a batch failed)."""
        return self.model.verify_batch([segment], [seq.cache])

    def _settle(
        self, seq: Sequence, out: tuple[torch.Tensor, torch.Tensor], fed: int, seconds: float
    ) -> None:
        """A verified segment's logits and hidden states -> the tokens it yields, each taken in turn."""
        logits, hidden = out
        tokens = seq.drafter.settle(logits, hidden)
        seq.drafter.record(fed - 1, len(tokens), seconds)
        for row, token in zip(logits, tokens, strict=False):  # token j was chosen from row j
            self._take(seq, token, row)
            if seq.finished:
                break
