"""What completions and chat completions share: sampling parameters, limits, usage, and the two
ways of answering (one JSON body, or an SSE stream).

    specs  = choice_specs(...)                          # per prompt, n choices with derived seeds
    runs   = submit_all(scheduler, specs, ...)          # 429 / 400 before anything is sent
    body   = await collect(request, runs) -> finals     # JSON: wait for every choice
    stream = stream_events(runs, to_chunks, usage_fn)   # SSE: chunks as pieces arrive

A client that disconnects cancels its choices: a stream's generator is closed by the server,
a JSON request is watched for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from latentkv.server import sse
from latentkv.server.choices import ChoiceRun, Piece, Spec, cancel_all, merged, refusal_error
from latentkv.server.errors import APIError, bad_request, error_body
from latentkv.server.protocol import PromptTokensDetails, Usage

log = logging.getLogger("latentkv.server")
DISCONNECT_POLL_S = 0.25
SEED_SPACE = 1 << 64


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_model(body_model: str | None, served: str) -> None:
    if body_model is not None and body_model != served:
        raise APIError(
            404,
            f"the model {body_model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def check_session(body, prompts: int) -> str | None:
    """The request's session name, validated; a session holds one sequence, so one choice."""
    from latentkv.engine.sessions import check_session_name

    if body.session is None:
        return None
    try:
        check_session_name(body.session)
    except ValueError as exc:
        raise bad_request(str(exc), param="session") from None
    if prompts > 1 or body.n > 1:
        raise bad_request("a session continues one sequence: use n = 1 and a single prompt", param="session")
    return body.session


def token_budget(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    """max_tokens, checked against the context; None means all the room the context leaves."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise context_error(prompt_len, 1, max_model_len, param)
        return room
    if prompt_len + max_tokens > max_model_len:
        raise context_error(prompt_len, max_tokens, max_model_len, param)
    return max_tokens


def context_error(prompt_len: int, max_tokens: int, max_model_len: int, param: str) -> APIError:
    from latentkv.engine.request import context_problem

    message = context_problem(prompt_len, max_tokens, max_model_len) or "the request does not fit"
    return bad_request(message, param=param, code="context_length_exceeded")


def sampling_params(
    body, ready, max_tokens: int, choice: int, logprobs: int | None, prompt_logprobs: bool, grammar=None
):
    """The scheduler's SamplingParams for choice `choice` of a prompt (seed + choice), decoded
    under `grammar` (engine.grammar.GrammarSpec) when the request asks for structured output.

    With prompt_logprobs (echo scoring) the stop tokens are left to the ChoiceRun, which lists
    a sampled stop token in the logprobs where the scheduler would drop it."""
    from latentkv.engine.sampling import SamplingParams

    stop_ids = () if prompt_logprobs else tuple(sorted(stop_ids_of(body, ready)))
    seed = None if body.seed is None else (body.seed + choice) % SEED_SPACE
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=seed,
            stop_token_ids=stop_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=getattr(exc, "param", None)) from None


def stop_ids_of(body, ready) -> frozenset[int]:
    ids = set() if body.ignore_eos else set(ready.stop_ids)
    return frozenset(ids | set(body.stop_token_ids or ()))


@dataclass
class ChoiceResult:
    """A finished choice: its text and tokens in order, the reason, the scheduler's Finished."""

    index: int
    text: str
    tokens: list
    finish_reason: str
    finished: object | None
    completion_tokens: int


def usage(prompt_lens: list[int], n: int, results: list[ChoiceResult]) -> Usage:
    """Prompt tokens once per prompt; cached = prompt tokens resumed from a session, not prefilled."""
    completion = sum(r.completion_tokens for r in results)
    cached = 0
    for p in range(len(prompt_lens)):
        finished = [r.finished for r in results if r.index // n == p and r.finished is not None]
        cached += max((f.cached_tokens for f in finished), default=0)
    prompt = sum(prompt_lens)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def collect(request: Request, runs: list[ChoiceRun]) -> list[ChoiceResult] | None:
    """Every choice to its end (JSON answers); None if the client disconnected (choices cancelled).

    A choice the scheduler failed becomes a 500."""
    gather = asyncio.create_task(_gather(runs))
    watch = asyncio.create_task(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
        if gather not in done:
            cancel_all(runs)
            gather.cancel()
            return None
        return gather.result()
    finally:
        watch.cancel()


async def _gather(runs: list[ChoiceRun]) -> list[ChoiceResult]:
    parts: dict[int, list[Piece]] = {run.spec.index: [] for run in runs}
    async for piece in merged(runs):
        parts[piece.index].append(piece)
    results = []
    for index, pieces in sorted(parts.items()):
        last = pieces[-1]
        if (refused := refusal_error(last.finished)) is not None:
            raise refused
        if last.error is not None or last.finish_reason == "error":
            raise failure_error(last)
        tokens = [t for p in pieces for t in p.tokens]
        text = "".join(p.text for p in pieces)
        results.append(
            ChoiceResult(index, text, tokens, last.finish_reason, last.finished, last.completion_tokens)
        )
    return results


FAILURE_RETRY_S = 10  # what a 503 for a damaged store or a refusing disk tells the client to wait


def failure_error(piece: Piece) -> APIError:
    """The answer for a choice the engine failed: 503 naming the cause when the machine is at
    fault (a damaged expert store, a disk that refused a session file: `Finished.code`), else 500."""
    message = f"generation failed: {piece.error or 'unknown error'}"
    code = getattr(piece.finished, "code", None)
    if code is not None:
        return APIError(503, message, code=code, headers={"Retry-After": str(FAILURE_RETRY_S)})
    return APIError(500, message, code="generation_failed")


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def stream(
    runs: list[ChoiceRun],
    head: list,
    chunks: Callable[[Piece], list],
    tail: Callable[[list[ChoiceResult]], list],
) -> StreamingResponse:
    """SSE: the `head` chunks, chunks(piece) for each piece, tail(results) (the usage chunk), [DONE].

    A failure (the scheduler's or ours) after the stream started is an error event, then [DONE].
    """
    return StreamingResponse(
        _events(runs, head, chunks, tail), media_type="text/event-stream", headers=sse.HEADERS
    )


async def _events(runs, head, chunks, tail) -> AsyncIterator[str]:
    results: list[ChoiceResult] = []
    try:
        for chunk in head:
            yield sse.event(chunk)
        async for piece in merged(runs):
            if (refused := refusal_error(piece.finished)) is not None:
                yield sse.event(refused.body())
                yield sse.DONE
                return
            if piece.finish_reason == "error" or piece.error is not None:
                yield sse.event(failure_error(piece).body())
                yield sse.DONE
                return
            for chunk in chunks(piece):
                yield sse.event(chunk)
            if piece.finish_reason is not None:
                results.append(
                    ChoiceResult(
                        piece.index, "", [], piece.finish_reason, piece.finished, piece.completion_tokens
                    )
                )
        for chunk in tail(results):
            yield sse.event(chunk)
    except (asyncio.CancelledError, GeneratorExit):
        cancel_all(runs)  # the client went away
        raise
    except APIError as exc:
        yield sse.event(exc.body())
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        log.exception("stream failed")
        yield sse.event(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"))
    yield sse.DONE


def specs_for(
    prompts: list[list[int]],
    n: int,
    params_for,
    session: str | None,
    stop: list[str],
    keep_special: bool = False,
) -> list[Spec]:
    """n choices per prompt; choice index = prompt * n + j, params_for(prompt_ids, j)."""
    return [
        Spec(p * n + j, ids, params_for(ids, j), session, stop, keep_special)
        for p, ids in enumerate(prompts)
        for j in range(n)
    ]
