"""`latentkv chat`: an interactive conversation on stdin/stdout, optionally kept in a session file.

The conversation is a token history, grown turn by turn and never re-tokenized:

    first turn:  format.first(system, user)      e.g. "User: hi\\nAssistant:"
    reply:       the generated ids, without the stop token
    closing:     format.closing                   e.g. "\\n" (ChatML: "<|im_end|>\\n")
    next turn:   format.next(user)                e.g. "User: more\\nAssistant:"

A turn ends by feeding the reply's last token and the closing, so the cache (and the session
file) holds the whole conversation so far: a restarted `chat --session NAME` prefills nothing
of it, only the next user message.

Models with a chat template (tokenizer_config.json or chat_template.jinja) are rendered with a
sandboxed jinja2 environment; the pieces above come from rendering a stand-in past conversation
with and without the new message (what llama.cpp does), so the real past is never rendered
again. Without a template (builtin:tiny's byte tokenizer) the plain "User:/Assistant:" format.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from latentkv.cli import UserError
from latentkv.commands.common import (
    add_model_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    check_speculative,
    engine_config,
    load,
    sampling_params,
    speculative_config,
)
from latentkv.commands.session import add_session_arguments, check_name

COMMANDS_HELP = "/reset starts over, /exit (or end of input) ends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_session_arguments(p)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most (default: 256)")
    add_sampling_arguments(p)
    add_speculative_arguments(p)
    p.add_argument("--system", default=None, help="system message of a new conversation")
    p.add_argument(
        "--plain",
        action="store_true",
        help="use the plain 'User: ... / Assistant: ...' format even if the model has a chat template",
    )


# --- formats ------------------------------------------------------------------------------


class PlainFormat:
    """A transcript for models without a chat template."""

    name = "plain User/Assistant format"
    closing = "\n"
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


def chat_format(loaded, plain: bool):
    """The model's chat template if it has one (and it renders piecewise), else the plain format."""
    tokenizer = loaded.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if plain or not template:
        return PlainFormat()
    try:
        return TemplateFormat(template, special_tokens(Path(loaded.directory)))
    except ChatTemplateError as exc:
        print(f"latentkv chat: {exc}; using the plain format instead", file=sys.stderr)
        return PlainFormat()


def special_tokens(directory: Path) -> dict[str, str]:
    """bos_token, eos_token, ... from tokenizer_config.json, as the templates expect them."""
    path = directory / "tokenizer_config.json"
    try:
        raw = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def stop_ids(cfg, directory) -> tuple[int, ...]:
    """The model's end-of-sequence ids, with generation_config.json's (chat models list several)."""
    ids = list(cfg.eos_token_ids)
    path = Path(directory) / "generation_config.json"
    try:
        extra = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    except (OSError, ValueError):
        extra = None
    for value in extra if isinstance(extra, list) else [extra]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return tuple(ids)


# --- the loop -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.session is not None:
        check_name(args.session)
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be >= 1")
    sampling = sampling_params(args)
    engine = engine_config(args)
    args.speculative_config = speculative_config(args, args.model)
    loaded = load(args.model, engine, quiet=True)
    check_speculative(loaded.model, args.speculative_config)
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.directory} has no tokenizer.json: chat needs one")
    conv = _open(args, loaded, engine.cache)
    try:
        chat = Chat(loaded, chat_format(loaded, args.plain), conv, sampling, args)
        chat.greet()
        chat.loop(sys.stdin, sys.stdout)
    finally:
        conv.close()
    return 0


def _open(args: argparse.Namespace, loaded, cache_config):
    from latentkv.commands.session import Conversation, Unsaved

    if args.session is None:
        return Unsaved(loaded.model.make_cache(cache_config))
    conv = Conversation.open(args.session, args.kv_dir, loaded, cache_config)
    conv.print_notes()
    return conv


class Chat:
    def __init__(self, loaded, fmt, conv, sampling, args: argparse.Namespace):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.fmt = fmt
        self.conv = conv
        self.sampling = sampling
        self.max_tokens = args.max_tokens
        self.speculative = args.speculative_config
        self.system = args.system
        self.stop = stop_ids(loaded.model.cfg, loaded.directory)
        self.label = args.model

    def greet(self) -> None:
        say(f"chat with {self.label} ({self.fmt.name}); {COMMANDS_HELP}")
        if self.conv.tokens:
            say(
                f"session {self.conv.name}: resumed {len(self.conv.tokens)} tokens from {self.conv.path} "
                f"in {self.conv.resume_seconds:.3f} s (nothing prefilled again)"
            )
            if self.system:
                say("--system applies to new conversations; the resumed one keeps its own (/reset to use it)")

    def loop(self, stdin, stdout) -> None:
        interactive = stdin.isatty()
        while True:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\r\n")
            if text.strip() == "/exit":
                break
            if text.strip() == "/reset":
                self.conv.reset()
                say("started over")
                continue
            if not text.strip():
                continue
            try:
                self.turn(text, stdout)
            except (ValueError, ChatTemplateError) as exc:  # context full, a template's refusal
                say(f"error: {exc}")

    def turn(self, text: str, stdout) -> None:
        """One exchange: prefill what the cache lacks, stream the reply, close the turn, save."""
        import torch

        from latentkv.engine.generate import GenerationStats, stream_generate

        first = not self.conv.tokens
        piece = self.fmt.first(self.system, text) if first else self.fmt.next(text)
        prompt = self.conv.tokens + self.tokenizer.encode(
            piece, add_special_tokens=first and self.fmt.special_tokens
        )
        cache = self.conv.cache
        todo = self.conv.begin_turn(prompt)
        stats = GenerationStats()
        reply: list[int] = []
        for token, delta, _ in stream_generate(
            self.model,
            todo,
            self.max_tokens,
            self.sampling,
            self.tokenizer,
            cache=cache,
            stop_ids=self.stop,
            stats=stats,
            speculative=self.speculative,
        ):
            if token not in self.stop:
                reply.append(token)
            stdout.write(delta)
            stdout.flush()
        stdout.write("\n")
        stdout.flush()
        # Feed what has no row yet (the last sampled token) and the closing: the cache, and the
        # file, then hold the whole conversation and the next turn prefills only its message.
        ids = prompt + reply + self.tokenizer.encode(self.fmt.closing, add_special_tokens=False)
        if tail := ids[cache.length :]:
            self.model.forward(torch.tensor(tail, dtype=torch.long), cache)
        self.conv.end_turn(ids)
        say(
            f"[reused {self.conv.resumed_tokens} tokens, prefilled {stats.prompt_tokens} "
            f"({stats.prompt_tps:.1f} tok/s), generated {stats.generated_tokens} ({stats.decode_tps:.1f} tok/s), "
            f"{len(self.conv.tokens)} tokens in the conversation]"
        )
        if stats.speculative:
            say(f"[{stats.speculative.line()}]")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
