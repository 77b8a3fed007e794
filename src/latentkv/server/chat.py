"""POST /v1/chat/completions: messages rendered by the model's chat template, then one prompt."""

from __future__ import annotations

from fastapi import Request, Response

from latentkv.server.choices import Piece, submit_all
from latentkv.server.errors import bad_request
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
from latentkv.server.structured import response_grammar
from latentkv.server.tools import ToolUse


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ready, served: str):
    check_model(body.model, served)
    session = check_session(body, 1)
    tools = ToolUse.of(body, ready)
    ids = check_ids(
        ready.chat.prompt_ids(ready.tokenizer, body.messages, tools=tools.definitions),
        ready.cfg.vocab_size,
        "messages",
    )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    budget = token_budget(
        len(ids), body.token_budget, ready.max_model_len, param if body.token_budget else "messages"
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    grammar = response_grammar(body, ready)
    if tools.grammar is not None:
        if grammar is not None:
            raise bad_request(
                "response_format cannot be combined with a tool_choice that forces a call",
                param="tool_choice",
            )
        grammar = tools.grammar

    def params_for(prompt: list[int], choice: int):
        return sampling_params(body, ready, budget, choice, top, False, grammar)

    specs = specs_for([ids], body.n, params_for, session, body.stop_strings(), tools.format is not None)
    runs = submit_all(ready.scheduler, specs, ready.tokenizer, stop_ids_of(body, ready), ready.metrics)
    answer = _Answer(body, len(ids), ready, served, tools)
    if body.stream:
        return stream(runs, answer.head(), answer.chunks, answer.tail)
    results = await collect(request, runs)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return answer.whole(results)


class _Answer:
    def __init__(self, body: ChatCompletionRequest, prompt_len: int, ready, served: str, tools: ToolUse):
        self.req = body
        self.tools = tools
        self.parsers = {i: tools.stream_parser() for i in range(body.n)}
        self.prompt_len = prompt_len
        self.strings = TokenStrings(ready.tokenizer, body.return_tokens_as_token_ids)
        self.top = body.top_logprobs or 0
        self.id, self.created, self.model = new_id("chatcmpl"), now(), served

    def _logprobs(self, tokens: list):
        return chat_logprobs(self.strings, tokens, self.top) if self.req.logprobs else None

    def whole(self, results: list[ChoiceResult]) -> ChatCompletion:
        choices = []
        for r in results:
            content, calls = self.tools.parse(r.text)
            reason = "tool_calls" if calls and r.finish_reason == "stop" else r.finish_reason
            message = AssistantMessage(
                content=content if content or not calls else None,
                tool_calls=[c.openai() for c in calls] or None,
            )
            choices.append(
                ChatChoice(
                    index=r.index, message=message, logprobs=self._logprobs(r.tokens), finish_reason=reason
                )
            )
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
        parser = self.parsers[piece.index]
        text, calls = (parser.push(piece.text), []) if parser is not None else (piece.text, [])
        if parser is not None and piece.finish_reason is not None:
            rest, calls = parser.finish()
            text += rest
        if text or (self.req.logprobs and piece.tokens):
            delta = Delta(content=text)
            out.append(
                self._chunk(
                    [ChatChunkChoice(index=piece.index, delta=delta, logprobs=self._logprobs(piece.tokens))]
                )
            )
        if calls:
            delta = Delta(tool_calls=[c.openai(i) for i, c in enumerate(calls)])
            out.append(self._chunk([ChatChunkChoice(index=piece.index, delta=delta)]))
        if piece.finish_reason is not None:
            reason = "tool_calls" if calls and piece.finish_reason == "stop" else piece.finish_reason
            out.append(self._chunk([ChatChunkChoice(index=piece.index, delta=Delta(), finish_reason=reason)]))
        return out

    def tail(self, results: list[ChoiceResult]) -> list[ChatCompletionChunk]:
        if not self.req.include_usage:
            return []
        return [self._chunk([], usage([self.prompt_len], self.req.n, results))]
