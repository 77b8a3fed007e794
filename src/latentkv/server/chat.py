"""POST /v1/chat/completions: messages rendered by the model's chat template, then one prompt."""

from __future__ import annotations

from fastapi import Request, Response

from latentkv.server.choices import Piece, submit_all
from latentkv.server.generation import (
    ChoiceResult,
    check_model,
    check_session,
    collect,
    new_id,
    now,
    sampling_params,
    specs_for,
    stop_ids_of,
    stream,
    token_budget,
    usage,
)
from latentkv.server.logprobs import TokenStrings, chat_logprobs
from latentkv.server.prompts import check_ids
from latentkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Delta,
)


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ready, served: str):
    check_model(body.model, served)
    session = check_session(body, 1)
    ids = check_ids(ready.chat.prompt_ids(ready.tokenizer, body.messages), ready.cfg.vocab_size, "messages")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    budget = token_budget(
        len(ids), body.token_budget, ready.max_model_len, param if body.token_budget else "messages"
    )
    top = (body.top_logprobs or 0) if body.logprobs else None

    def params_for(prompt: list[int], choice: int):
        return sampling_params(body, ready, budget, choice, top, False)

    specs = specs_for([ids], body.n, params_for, session, body.stop_strings())
    runs = submit_all(ready.scheduler, specs, ready.tokenizer, stop_ids_of(body, ready), ready.metrics)
    answer = _Answer(body, len(ids), ready, served)
    if body.stream:
        return stream(runs, answer.head(), answer.chunks, answer.tail)
    results = await collect(request, runs)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return answer.whole(results)


class _Answer:
    def __init__(self, body: ChatCompletionRequest, prompt_len: int, ready, served: str):
        self.req = body
        self.prompt_len = prompt_len
        self.strings = TokenStrings(ready.tokenizer, body.return_tokens_as_token_ids)
        self.top = body.top_logprobs or 0
        self.id, self.created, self.model = new_id("chatcmpl"), now(), served

    def _logprobs(self, tokens: list):
        return chat_logprobs(self.strings, tokens, self.top) if self.req.logprobs else None

    def whole(self, results: list[ChoiceResult]) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=r.index,
                message=AssistantMessage(content=r.text),
                logprobs=self._logprobs(r.tokens),
                finish_reason=r.finish_reason,
            )
            for r in results
        ]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage([self.prompt_len], self.req.n, results),
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage_=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage_
        )

    def head(self) -> list[ChatCompletionChunk]:
        """The role first, one chunk per choice, as OpenAI streams it."""
        return [
            self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
            for i in range(self.req.n)
        ]

    def chunks(self, piece: Piece) -> list[ChatCompletionChunk]:
        out = []
        if piece.text or (self.req.logprobs and piece.tokens):
            delta = Delta(content=piece.text)
            out.append(
                self._chunk(
                    [ChatChunkChoice(index=piece.index, delta=delta, logprobs=self._logprobs(piece.tokens))]
                )
            )
        if piece.finish_reason is not None:
            out.append(
                self._chunk(
                    [ChatChunkChoice(index=piece.index, delta=Delta(), finish_reason=piece.finish_reason)]
                )
            )
        return out

    def tail(self, results: list[ChoiceResult]) -> list[ChatCompletionChunk]:
        if not self.req.include_usage:
            return []
        return [self._chunk([], usage([self.prompt_len], self.req.n, results))]
