"""`latentkv chat`: an interactive conversation on stdin/stdout, optionally kept in a session file.

The conversation is a token history, grown turn by turn and never re-tokenized:

    first turn:  format.first(system, user)      e.g. "User: hi\\nAssistant:"
    reply:       the generated ids, without the stop token
    closing:     format.closing                   e.g. "\\n" (ChatML: "<|im_end|>\\n")
    next turn:   format.next(user)                e.g. "User: more\\nAssistant:"

A turn ends by feeding the reply's last token and the closing, so the cache (and the session
file) holds the whole conversation so far: a restarted `chat --session NAME` prefills nothing
of it, only the next user message.

The pieces come from `latentkv.chat_template`: the model's chat template rendered piecewise in a
sandbox, or, without one (builtin:tiny's byte tokenizer), the plain "User:/Assistant:" format.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from latentkv.chat_template import ChatTemplateError, PlainFormat, TemplateFormat, special_tokens
from latentkv.commands.common import (
    add_cluster_arguments,
    add_model_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    check_speculative,
    draft_tokens,
    engine_config,
    run_as_worker,
    sampling_params,
    speculative_config,
)
from latentkv.commands.session import add_session_arguments, check_name
from latentkv.errors import UserError
from latentkv.runtime import load, stop_ids
from latentkv.tokenizer import StopStrings

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
    p.add_argument(
        "--json",
        action="store_true",
        help="write one JSON object per turn on stdout (user, reply, finish_reason, stats) instead of streaming text",
    )
    add_cluster_arguments(p)


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


# --- the loop -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if (status := run_as_worker(args)) is not None:
        return status
    if args.session is not None:
        check_name(args.session)
    from latentkv.config import check_tokens

    check_tokens("--max-tokens", args.max_tokens)
    sampling = sampling_params(args)
    engine = engine_config(args)
    args.speculative_config = speculative_config(args, args.model)
    loaded = load(args.model, engine, quiet=True, draft_tokens=draft_tokens(args.speculative_config))
    check_speculative(loaded.model, args.speculative_config)
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.directory} has no tokenizer.json: chat needs one")
    conv = _open(args, loaded)
    try:
        chat = Chat(loaded, chat_format(loaded, args.plain), conv, sampling, args)
        chat.greet()
        chat.loop(sys.stdin, sys.stdout)
    finally:
        conv.close()
        loaded.close()  # streamed experts: saves the usage history
    return 0


def _open(args: argparse.Namespace, loaded):
    from latentkv.commands.session import Conversation, Unsaved

    if args.session is None:
        return Unsaved(loaded.model.make_cache(loaded.tier))
    conv = Conversation.open(args.session, args.kv_dir, loaded)
    conv.print_notes()
    return conv


class Chat:
    def __init__(self, loaded, fmt, conv, sampling, args: argparse.Namespace):
        self.model = loaded.model
        self.streamer = loaded.streamer  # experts streamed from disk (--ram-gb), or None
        self.cluster = loaded.cluster  # the head of a cluster (torchrun), or None
        self.device_cache = loaded.device_cache  # experts cached on the GPU (--vram-gb), or None
        self.tokenizer = loaded.tokenizer
        self.fmt = fmt
        self.conv = conv
        self.sampling = sampling
        self.max_tokens = args.max_tokens
        self.speculative = args.speculative_config
        self.system = args.system
        self.stop = stop_ids(loaded.model.cfg, loaded.directory)
        self.label = args.model
        self.json = args.json

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
        """Read turns from stdin. A line that is not valid UTF-8 is refused (one line on stderr,
        nothing sent to the model, the chat goes on), as the server refuses such text."""
        from latentkv.tokenizer import is_valid_text, unicode_problem

        interactive = stdin.isatty()
        reconfigure = getattr(stdin, "reconfigure", None)
        if reconfigure is not None:  # undecodable bytes arrive as surrogates, not as an exception
            reconfigure(errors="surrogateescape")
        while True:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\r\n")
            if not is_valid_text(text):
                say(f"error: the line is not valid UTF-8 text ({unicode_problem(text)}); nothing was sent")
                continue
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
                if self.json:
                    stdout.write(json.dumps({"user": text, "error": str(exc)}) + "\n")
                    stdout.flush()

    def turn(self, text: str, stdout) -> None:
        """One exchange: prefill what the cache lacks, stream the reply, close the turn, save."""
        import torch

        first = not self.conv.tokens
        piece = self.fmt.first(self.system, text) if first else self.fmt.next(text)
        prompt = self.conv.tokens + self.tokenizer.encode(
            piece, add_special_tokens=first and self.fmt.special_tokens
        )
        cache = self.conv.cache
        todo = self.conv.begin_turn(prompt)
        reply, reply_text, stats = self._reply(todo, None if self.json else stdout)
        if cache.length > len(prompt) + len(reply):  # a stop text cut the reply: forget its rows
            cache.trim(len(prompt) + len(reply))
        # Feed what has no row yet (the last sampled token) and the closing: the cache, and the
        # file, then hold the whole conversation and the next turn prefills only its message.
        ids = prompt + reply + self.tokenizer.encode(self.fmt.closing, add_special_tokens=False)
        if tail := ids[cache.length :]:
            self.model.forward(torch.tensor(tail, dtype=torch.long), cache)
        self.conv.end_turn(ids)
        if self.json:
            stdout.write(json.dumps(self._turn_json(text, reply_text, stats)) + "\n")
            stdout.flush()
        say(
            f"[reused {self.conv.resumed_tokens} tokens, prefilled {stats.prompt_tokens} "
            f"({stats.prompt_tps:.1f} tok/s), generated {stats.generated_tokens} ({stats.decode_tps:.1f} tok/s), "
            f"{len(self.conv.tokens)} tokens in the conversation]"
        )
        if self.cluster is not None:
            from latentkv.cluster.head import describe

            for line in describe(self.cluster.report(self.streamer)):
                say(f"[{line}]")
        elif self.streamer is not None:
            from latentkv.runtime import experts_line

            say(f"[{experts_line(self.streamer)}]")
        if self.device_cache is not None:
            from latentkv.runtime import device_cache_line

            say(f"[{device_cache_line(self.device_cache)}]")
        if stats.speculative:
            say(f"[{stats.speculative.line()}]")

    def _reply(self, todo: list[int], stdout):
        """Generate the reply (streamed to `stdout` unless None) -> (its ids, its text, stats).

        A stop text of the format ends the reply where it begins: text that may be the start of
        one is held back until it is not, and the ids kept are those whose text lies before it."""
        from latentkv.engine.generate import GenerationStats, stream_generate

        stats = GenerationStats()
        reply: list[int] = []
        stops, text, hit = StopStrings(list(self.fmt.stop_texts)), "", False
        for token, delta, _ in stream_generate(
            self.model, todo, self.max_tokens, self.sampling, self.tokenizer,
            cache=self.conv.cache, stop_ids=self.stop, stats=stats, speculative=self.speculative,
        ):  # fmt: skip
            if token not in self.stop:
                reply.append(token)
            shown, hit = stops.push(delta)
            text += shown
            if stdout is not None:
                stdout.write(shown)
                stdout.flush()
            if hit:
                stats.finish_reason = "stop"
                reply = ids_before(self.tokenizer, reply, text)
                break
        tail = "" if hit else stops.flush()
        text += tail
        if stdout is not None:
            stdout.write(tail + "\n")
            stdout.flush()
        return reply, text, stats

    def _turn_json(self, user: str, reply: str, stats) -> dict:
        return {
            "user": user,
            "reply": reply,
            "finish_reason": stats.finish_reason,
            "session": self.conv.name,
            "conversation_tokens": len(self.conv.tokens),
            "reused_tokens": self.conv.resumed_tokens,
            "stats": stats.as_dict(),
            **({"cluster": self.cluster.report(self.streamer)} if self.cluster is not None else {}),
        }


def ids_before(tokenizer, ids: list[int], text: str) -> list[int]:
    """The longest prefix of `ids` whose text is a prefix of `text` (a token that straddles
    where `text` ends is dropped with what follows)."""
    n = len(ids)
    while n and not text.startswith(tokenizer.decode(ids[:n])):
        n -= 1
    return ids[:n]


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
