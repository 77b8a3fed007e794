"""The OpenAI wire format: request models (validated; unknown fields ignored) and response models.

Requests accept what the `openai` client, lm-evaluation-harness and vLLM-speaking tools send.
`response_format` (json_object, json_schema) constrains the output in both endpoints.
Extensions beyond OpenAI's fields: `session` (resume and save a named KV session),
`stop_token_ids`, `ignore_eos` and `return_tokens_as_token_ids` (as vLLM names them). Fields we cannot honour
(penalties, logit_bias, suffix, best_of other than n) are refused with 400 rather than ignored,
since ignoring them would change results silently.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # OpenAI's bound for logprobs / top_logprobs
MAX_STOP = 16  # stop strings per request


class _Request(BaseModel):
    # strict: JSON types as documented, never coerced ("max_tokens": "5" or true, "stream": "yes"
    # are 400 naming the field); an integer is still a number where a float is expected
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value):
        """Text must be valid Unicode: a lone surrogate ("\\ud800" in the JSON) is refused, 400
        naming the field, on every request field (prompt, content, stop, session...)."""
        if (problem := _unicode_problem_in(value)) is not None:
            raise ValueError(f"not valid Unicode text: {problem}")
        return value


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema: OpenAI's {name, description, schema, strict}."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")  # JSON Schema; absent: any JSON value
    strict: bool | None = None  # accepted; the output is constrained either way


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name", "schema"}')
        return self


class _Sampling(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    # extensions
    session: str | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (unique, unlike text)
    response_format: ResponseFormat | None = None  # structured output (server.structured)
    # refused unless neutral
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings (got {len(stops)})")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _unicode_problem_in(value) -> str | None:
    """The first text in `value` (a str, or lists / dicts of them) that is not valid Unicode."""
    from latentkv.tokenizer import is_valid_text, unicode_problem

    if isinstance(value, str):
        return None if is_valid_text(value) else unicode_problem(value, from_bytes=False)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list):
        for item in value:
            if (problem := _unicode_problem_in(item)) is not None:
                return problem
    return None


Prompt = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (leave it out, or equal to n)")
        return self


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCallIn(_Request):
    """An assistant message's tool call, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls may come either way

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# --- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens resumed from a session instead of prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler):
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A chunk's delta: only what it carries ({"role", "content"} first, {"content"}, then {})."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # each {"index", "id", "type", "function": {"name", "arguments"}}

    @model_serializer(mode="wrap")
    def _present_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
