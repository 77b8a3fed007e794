"""POST /v1/completions: text, texts, token ids or a batch of id lists; echo, logprobs, n, stream.

`echo` with `logprobs` scores the prompt (entry 0 `null`), which is how lm-evaluation-harness's
`local-completions` computes log-likelihoods; `max_tokens: 0` with echo scores without generating.
"""

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
from latentkv.server.logprobs import CompletionLogprobsBuilder, TokenStrings, join
from latentkv.server.prompts import Prompt, completion_prompts
from latentkv.server.protocol import Completion, CompletionChoice, CompletionRequest
from latentkv.server.structured import response_grammar


async def create_completion(body: CompletionRequest, request: Request, ready, served: str):
    check_model(body.model, served)
    prompts = completion_prompts(body.prompt, ready.tokenizer, ready.cfg.vocab_size)
    session = check_session(body, len(prompts))
    if body.stream and body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported when streaming; drop stream", param="echo")
    prompt_logprobs = body.echo and body.logprobs is not None
    grammar = response_grammar(body, ready)

    def params_for(ids: list[int], choice: int):  # every spec is built (and checked) before any submit
        budget = token_budget(len(ids), body.max_tokens, ready.max_model_len, "max_tokens")
        return sampling_params(body, ready, budget, choice, body.logprobs, prompt_logprobs, grammar)

    specs = specs_for([p.ids for p in prompts], body.n, params_for, session, body.stop_strings())
    runs = submit_all(ready.scheduler, specs, ready.tokenizer, stop_ids_of(body, ready), ready.metrics)
    answer = _Answer(body, prompts, ready, served)
    if body.stream:
        return stream(runs, answer.head(), answer.chunks, answer.tail)
    results = await collect(request, runs)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return answer.whole(results)


class _Answer:
    """The response objects of one completion request."""

    def __init__(self, body: CompletionRequest, prompts: list[Prompt], ready, served: str):
        self.req = body
        self.prompts = prompts
        self.n = body.n
        self.strings = TokenStrings(ready.tokenizer, body.return_tokens_as_token_ids)
        self.tokenizer = ready.tokenizer
        self.id, self.created, self.model = new_id("cmpl"), now(), served
        self.builders = {i: CompletionLogprobsBuilder(self.strings) for i in range(len(prompts) * self.n)}

    def _completion(self, choices: list[CompletionChoice], usage_=None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage_)

    def echo_text(self, index: int) -> str:
        prompt = self.prompts[index // self.n]
        if prompt.text is not None:
            return prompt.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(prompt.ids, skip_special_tokens=False)

    # --- one JSON body --------------------------------------------------------------------
    def whole(self, results: list[ChoiceResult]) -> Completion:
        choices = []
        for r in results:
            prompt = self.prompts[r.index // self.n]
            logprobs = None
            if self.req.logprobs is not None:
                builder = self.builders[r.index]
                parts = []
                if self.req.echo:
                    parts.append(builder.prompt(prompt.ids, getattr(r.finished, "prompt_logprobs", None)))
                parts.append(builder.generated(r.tokens))
                logprobs = join(parts)
            text = (self.echo_text(r.index) if self.req.echo else "") + r.text
            choices.append(
                CompletionChoice(index=r.index, text=text, logprobs=logprobs, finish_reason=r.finish_reason)
            )
        return self._completion(choices, usage([len(p.ids) for p in self.prompts], self.n, results))

    # --- a stream ---------------------------------------------------------------------------
    def head(self) -> list[Completion]:
        if not self.req.echo:
            return []
        return [
            self._completion([CompletionChoice(index=i, text=self.echo_text(i))])
            for i in range(len(self.prompts) * self.n)
        ]

    def chunks(self, piece: Piece) -> list[Completion]:
        if not piece.text and piece.finish_reason is None:
            return []
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self.builders[piece.index].generated(piece.tokens)
        choice = CompletionChoice(
            index=piece.index, text=piece.text, logprobs=logprobs, finish_reason=piece.finish_reason
        )
        return [self._completion([choice])]

    def tail(self, results: list[ChoiceResult]) -> list[Completion]:
        if not self.req.include_usage:
            return []
        return [self._completion([], usage([len(p.ids) for p in self.prompts], self.n, results))]
