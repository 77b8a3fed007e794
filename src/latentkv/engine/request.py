"""What goes into the engine and what comes out: requests, their events, refusals, statistics.

    handle = client.submit(Request(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7)))
    for event in handle:          # TokenEvent ..., then exactly one Finished
        ...

These types cross the engine process's pipe (pickled), so they hold plain data only. The
sampling parameters are `latentkv.engine.sampling.SamplingParams`, the one set that `generate`,
the scheduler and the server share. `validate_request`, `check_group_size` and `check_room` are
the checks an `EngineClient` makes before it queues anything, in-process or across the pipe
alike, so both refuse the same requests with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

from latentkv.engine.sampling import SamplingParams
from latentkv.engine.sessions import check_session_name


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    session: str | None = None  # KV session name (file kv_dir/<name>.kv), resumed + saved
    id: int | None = None  # the caller's name for it (the engine process matches events by it)


@dataclass
class TokenEvent:
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was resumed from the session file (not prefilled)
    prompt_logprobs: (
        list[dict | None] | None
    )  # per prompt token: None for entry 0, else {"token","logprob","top"}
    error: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    queued_seconds: float = 0.0  # from submission to admission (waiting for a slot or its session)
    # never run: "invalid" | "queue_full" | "closed" | "session" (the server's 400/429/503/409)
    refused: str | None = None
    # with reason "error", a failure of the machine rather than of the request (the server's 503):
    # "expert_store_damaged" (an expert the model needed is damaged or unreadable on disk) or
    # "storage_unavailable" (the disk refused a session file: full, read-only, failing)
    code: str | None = None


def failure_code(exc: BaseException) -> str | None:
    """`Finished.code` for an exception a request failed with: a damaged expert store or a disk
    that refused (said in one line, no traceback), else None (a bug: logged with its traceback)."""
    from latentkv.experts.store_file import ExpertFileError
    from latentkv.fs import DiskError

    if isinstance(exc, ExpertFileError):
        return "expert_store_damaged"
    if isinstance(exc, DiskError):
        return "storage_unavailable"
    return None


class QueueFull(Exception):
    """The waiting queue is full (the server answers 429)."""


class SchedulerClosed(Exception):
    """The scheduler was shut down."""


def validate_request(request: Request, vocab: int, max_model_len: int, sessions: bool) -> None:
    """ValueError unless the request can run (`sessions`: whether session requests can)."""
    prompt, params = request.prompt, request.params
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if bad := [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]:
        raise ValueError(f"token ids out of range for a vocabulary of {vocab}: {bad[:5]}")
    if len(prompt) + params.max_tokens > max_model_len:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{len(prompt) + params.max_tokens} tokens, over the context limit of {max_model_len}"
        )
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(f"logprobs must be at most the vocabulary size {vocab} (got {params.logprobs})")
    if request.session is not None:
        check_session_name(request.session)
        if not sessions:
            raise ValueError("sessions need the scheduler's model_dir (the KV file records the weights)")


def context_problem(
    prompt_len: int, max_tokens: int, max_model_len: int, knob: str = "max_tokens"
) -> str | None:
    """Why a prompt of `prompt_len` tokens cannot have `max_tokens` more within `max_model_len`
    (None when it can): the words of the server's 400 and of `latentkv generate`'s refusal."""
    if prompt_len + max_tokens <= max_model_len:
        return None
    return (
        f"this model's maximum context length is {max_model_len} tokens; the request needs "
        f"{prompt_len + max_tokens} ({prompt_len} in the prompt + {max_tokens} to generate). "
        f"Shorten the prompt or lower {knob}."
    )


def check_group_size(count: int, max_num_seqs: int, max_queue: int) -> None:
    """ValueError when `count` sequences (one request's choices) can never be open at once."""
    if count > max_num_seqs + max_queue:
        raise ValueError(
            f"the request needs {count} sequences (n x prompts) but the server holds at most "
            f"{max_num_seqs + max_queue} ({max_num_seqs} running + {max_queue} waiting): lower n "
            "or send fewer prompts"
        )


def check_room(open_now: int, count: int, max_num_seqs: int, max_queue: int) -> None:
    """QueueFull unless `count` more sequences fit beside the `open_now` ones (running, being
    admitted or waiting): max_num_seqs run and max_queue wait."""
    if open_now + count > max_num_seqs + max_queue:
        waiting = max(0, open_now - max_num_seqs)
        raise QueueFull(
            f"{open_now} sequences are open ({waiting} waiting, max_queue {max_queue}) and this "
            f"request needs {count} more"
        )


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    prompt_tokens_total: int  # prefilled (cached tokens not counted)
    generation_tokens_total: int
    kv_bytes_in_use: int  # latent rows + indexer keys of the running sequences' caches
    kv_bytes_capacity: int  # what max_num_seqs caches of max_model_len tokens hold
    kv_cache_dtype: str
    experts: dict | None = None  # ExpertStreamer.snapshot() when the experts stream from disk
    device_experts: dict | None = None  # DeviceCache.snapshot() when experts are cached on the GPU
    # a cluster's head: {"status", "serving", "reason", "advice", "epoch", "ranks": [per-rank records]}
    cluster: dict | None = None
    speculative: dict | None = None  # `SpeculativeStats.as_dict()` over every request, when drafting
