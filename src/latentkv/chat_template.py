"""Chat formats: the model's chat template rendered in a sandbox, or the plain transcript.

`latentkv chat` and the server's chat completions render conversations the same way:

    PlainFormat     models without a template (builtin:tiny's byte tokenizer):
                    "SYSTEM\n\nUser: ...\nAssistant:", each turn closed by "\n"
    TemplateFormat  a template rendered piecewise from a stand-in past conversation (user X,
                    assistant Y) with and without the new message (what llama.cpp does), so a
                    growing conversation is extended, never re-rendered

Templates (tokenizer_config.json or chat_template.jinja) are compiled once in jinja2's
ImmutableSandboxedEnvironment: a template is data from the model folder, and the sandbox
keeps it from reaching Python's internals. `special_tokens` gives them bos_token and friends.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


class PlainFormat:
    """A transcript for models without a chat template."""

    name = "plain User/Assistant format"
    closing = "\n"
    stop_texts = ("\nUser:",)  # the model starting the next user turn itself ends its reply
    special_tokens = True  # the first turn is the start of the text: BOS if the tokenizer adds one

    def first(self, system: str | None, user: str) -> str:
        return (f"{system}\n\n" if system else "") + self.next(user)

    def next(self, user: str) -> str:
        return f"User: {user}\nAssistant:"


class ChatTemplateError(ValueError):
    pass


class TemplateFormat:
    """A chat template, rendered piecewise from a stand-in past (user X, assistant Y)."""

    name = "the model's chat template"
    stop_texts = ()  # the template's end-of-turn token is a stop id
    special_tokens = False  # the template writes BOS and friends itself
    USER, REPLY = "LATENTKVUSERMARK", "LATENTKVREPLYMARK"

    def __init__(self, template: str, special: dict[str, str]):
        self._template = compile_template(template)
        self._special = special
        self._past = [{"role": "user", "content": self.USER}, {"role": "assistant", "content": self.REPLY}]
        past = self.render(self._past, False)
        if self.REPLY not in past:
            raise ChatTemplateError("the chat template does not show an assistant message as written")
        self.closing = past[past.rindex(self.REPLY) + len(self.REPLY) :]
        self.next(self.USER)  # fails here, not mid-conversation, if the template cannot go piecewise

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return render_template(self._template, messages, generation_prompt, self._special)

    def first(self, system: str | None, user: str) -> str:
        system_msg = [{"role": "system", "content": system}] if system else []
        return self.render([*system_msg, {"role": "user", "content": user}], True)

    def next(self, user: str) -> str:
        before = self.render(self._past, False)
        after = self.render([*self._past, {"role": "user", "content": user}], True)
        if not after.startswith(before):
            raise ChatTemplateError("the chat template renders past turns differently once a message follows")
        return after[len(before) :]


def compile_template(template: str):
    """A chat template compiled in jinja2's ImmutableSandboxedEnvironment (shared with the server)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("rendering the chat template needs jinja2 (pip install jinja2)") from None
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None


def render_template(compiled, messages: list[dict], generation_prompt: bool, special: dict[str, str]) -> str:
    """`compiled` (from compile_template) over `messages`; ChatTemplateError if the template fails."""
    from jinja2.exceptions import TemplateError

    try:
        return compiled.render(messages=messages, add_generation_prompt=generation_prompt, **special)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from None


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def special_tokens(directory: Path) -> dict[str, str]:
    """bos_token, eos_token, ... from tokenizer_config.json, as the templates expect them."""
    from latentkv.config import read_json_object

    path = Path(directory) / "tokenizer_config.json"
    raw = read_json_object(path) if path.exists() else {}  # ConfigError names a broken one
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out
