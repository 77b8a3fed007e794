"""Requests -> prompt token ids: completions' four prompt shapes, and chat messages rendered.

Chat messages go through the model's chat template (tokenizer_config.json or
chat_template.jinja) in the same sandboxed jinja2 environment as `latentkv chat`
(`latentkv.chat_template`); a model without one (builtin:tiny's byte tokenizer) gets
`latentkv chat`'s plain transcript, "SYSTEM\\n\\nUser: ...\\nAssistant: ...\\nUser: ...\\nAssistant:".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from latentkv.chat_template import (
    ChatTemplateError,
    PlainFormat,
    compile_template,
    render_template,
    special_tokens,
)
from latentkv.server.errors import bad_request
from latentkv.server.protocol import ChatMessage


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the text it came from (None for token ids: echo decodes them)


def completion_prompts(prompt, tokenizer, vocab_size: int) -> list[Prompt]:
    """A completion request's `prompt` (text, list of texts, ids, or a batch of id lists) -> prompts."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise bad_request("prompt is empty", param="prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(Prompt(encode(tokenizer, item, add_special_tokens=True), item))
        else:
            out.append(Prompt(check_ids(list(item), vocab_size), None))
    for p in out:
        if not p.ids:
            raise bad_request("a prompt is empty: give at least one token", param="prompt")
    return out


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer.json: send token ids instead of text", param="prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise bad_request(f"token ids out of range for a vocabulary of {vocab_size}: {bad[:5]}", param=param)
    return ids


class ChatRenderer:
    """Messages -> prompt text, with the model's chat template or the plain transcript."""

    def __init__(self, template: str | None, special: dict[str, str]):
        self.template = template
        self.special = special
        self._compiled = compile_template(template) if template else None
        self._plain = PlainFormat()
        # A template writes BOS and friends itself; the plain transcript relies on the tokenizer.
        self.add_special_tokens = self._compiled is None

    @classmethod
    def for_model(cls, tokenizer, directory: Path) -> ChatRenderer:
        template = getattr(tokenizer, "chat_template", None)
        try:
            return cls(template, special_tokens(directory))
        except ChatTemplateError as exc:
            raise ValueError(f"{directory}: {exc}") from None

    @property
    def name(self) -> str:
        return "chat template" if self._compiled is not None else "plain User/Assistant format"

    def render(self, messages: list[ChatMessage], generation_prompt: bool = True, tools=None) -> str:
        """The prompt text; `tools` (the request's function definitions) reach the template as
        `tools`, a list of {"type": "function", "function": {...}} as OpenAI sends them."""
        plain = [_template_message(m) for m in messages]  # (checks tool calls' arguments either way)
        if self._compiled is None:
            return self._render_plain(messages)
        special = dict(self.special)
        if tools:
            special["tools"] = tools
        try:
            return render_template(self._compiled, plain, generation_prompt, special)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        except Exception as exc:  # noqa: BLE001 - a template's own TypeError etc. is the request's problem
            raise bad_request(
                f"the chat template failed: {type(exc).__name__}: {exc}", param="messages"
            ) from None

    def _render_plain(self, messages: list[ChatMessage]) -> str:
        """`latentkv chat`'s transcript: system first, then user turns ending in 'Assistant:'."""
        fmt = self._plain
        i = 0
        systems = []
        while i < len(messages) and messages[i].role in ("system", "developer"):
            systems.append(messages[i].text())
            i += 1
        system = "\n\n".join(systems) or None
        rest = messages[i:]
        if not rest or rest[0].role != "user":
            raise bad_request(
                "without a chat template the conversation must start with a user message "
                "(after any system messages)",
                param="messages",
            )
        pieces = []
        for k, message in enumerate(rest):
            if message.role == "user":
                pieces.append(fmt.first(system, message.text()) if k == 0 else fmt.next(message.text()))
            elif message.role == "assistant":
                pieces.append(message.text() + fmt.closing)
            else:
                raise bad_request(
                    f"role {message.role!r} needs a chat template; this model has none", param="messages"
                )
        return "".join(pieces)

    def prompt_ids(
        self, tokenizer, messages: list[ChatMessage], generation_prompt: bool = True, tools=None
    ) -> list[int]:
        return encode(tokenizer, self.render(messages, generation_prompt, tools), self.add_special_tokens)


def _template_message(m: ChatMessage) -> dict:
    """A message as chat templates read it. A tool call's arguments are given as an object
    (GLM's template iterates them; OpenAI sends them as JSON text)."""
    out = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for i, call in enumerate(m.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise bad_request(
                    f"messages: tool call {i}'s arguments are not JSON: {call.function.arguments[:80]!r}",
                    param="messages",
                ) from None
            fn = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": fn})
        out["tool_calls"] = calls
    return out
