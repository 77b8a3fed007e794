"""`--session NAME`: a conversation kept in a KV file between runs (generate, chat).

    conv = Conversation.open(args.session, args.kv_dir, loaded)   # resume or start, in loaded.tier
    new = conv.begin_turn(prompt)      # trims the cache to the reusable prefix; prefill only `new`
    ...generate over conv.cache...
    conv.end_turn(ids)                 # ids of the cache's rows: durable when it returns
    conv.close()

Files live in `--kv-dir`, else `config.sessions_dir()`, as NAME.kv. A name is a plain file
name ([A-Za-z0-9._-], no leading dot), never a path. What happened to the file (resumed,
re-encoded, refused and moved aside, cut back after damage) comes back as `notes`, one line
each, for stderr and --json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from latentkv.engine import sessions
from latentkv.errors import UserError


def add_session_arguments(p, what: str = "the conversation") -> None:
    p.add_argument(
        "--session",
        default=None,
        metavar="NAME",
        help=f"keep {what} in the KV file NAME.kv and resume it on the next run: a later prompt that "
        "extends the saved tokens prefills only the new ones ([A-Za-z0-9._-], at most 128 chars)",
    )
    p.add_argument(
        "--kv-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder of the session files (default: $LATENTKV_CACHE/sessions, else ~/.cache/latentkv/sessions)",
    )


def check_name(name: str) -> str:
    """The session name, if it is a plain file name; UserError naming the rule otherwise."""
    try:
        return sessions.check_session_name(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None


class Conversation:
    """One run's view of a session: the file, the cache resumed from it, what to tell the user."""

    def __init__(self, name: str, session, cache, resume_seconds: float):
        self.name = name
        self.session = session
        self.cache = cache
        self.resume_seconds = resume_seconds
        self.loaded_tokens = len(session.tokens)  # what the file held when this run opened it
        self.resumed_tokens = 0  # saved tokens the last turn reused (not prefilled again)
        self.saved_tokens = len(session.tokens)
        self.save_seconds = 0.0
        self.notes = list(session.notes)

    @classmethod
    def open(cls, name: str, kv_dir: Path | None, loaded) -> Conversation:
        """Resume session `name` for the loaded model in its tier (`loaded.tier`), or start it."""
        from latentkv.kv.store_header import KVFileError

        files = sessions.SessionFiles(loaded.model, loaded.tier, loaded.directory, kv_dir)
        try:
            path = files.path(name)
            files.header()  # hashes the checkpoint: not part of the resume time
            t0 = time.perf_counter()
            session, cache = files.open(name)
        except sessions.SessionBusy:
            raise UserError(f"session {name!r} is in use by another latentkv process ({path})") from None
        except sessions.SessionUnavailable as exc:
            raise UserError(str(exc)) from None
        except (KVFileError, OSError, ValueError) as exc:
            raise UserError(f"session {name!r}: {exc}") from None
        return cls(name, session, cache, time.perf_counter() - t0)

    @property
    def path(self) -> Path:
        return self.session.path

    @property
    def tokens(self) -> list[int]:
        """The ids of the cache's rows (what the file holds after the last save)."""
        return self.session.tokens

    def begin_turn(self, prompt: list[int]) -> list[int]:
        """Keep the saved rows `prompt` starts with; return the part of `prompt` still to prefill."""
        todo = sessions.resume(self.session, self.cache, prompt)
        self.resumed_tokens = len(prompt) - len(todo)
        return todo

    def end_turn(self, ids: list[int]) -> None:
        """Save the cache's rows; `ids` may run past them (the last sampled token has no row yet)."""
        from latentkv.fs import DiskError
        from latentkv.kv.store_header import KVFileError

        t0 = time.perf_counter()
        try:
            self.saved_tokens = sessions.save(self.session, ids, self.cache)
        except (KVFileError, DiskError) as exc:
            raise UserError(f"session {self.name!r}: saving failed: {exc}") from None
        self.save_seconds = time.perf_counter() - t0

    def reset(self) -> None:
        """Forget the conversation: an empty cache, and a file of no tokens (durably)."""
        self.cache.trim(0)
        self.session.keep(0)
        self.resumed_tokens = 0
        self.end_turn([])

    def report(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "loaded_tokens": self.loaded_tokens,
            "saved_tokens": self.saved_tokens,
            "save_seconds": round(self.save_seconds, 6),
            "moved_aside": str(self.session.moved_to) if self.session.moved_to else None,
            "notes": self.notes,
        }

    def resume_line(self) -> str:
        """'resumed: 43 tokens in 0.004 s' for the stats line."""
        return f"resumed: {self.resumed_tokens} tokens in {self.resume_seconds:.3f} s"

    def print_notes(self) -> None:
        for note in self.notes:
            print(f"latentkv: session {self.name}: {note}", file=sys.stderr)

    def close(self) -> None:
        self.session.close()


class Unsaved:
    """A conversation without a session: Conversation's interface, the cache alone."""

    name, path, resume_seconds = None, None, 0.0

    def __init__(self, cache):
        self.cache = cache
        self.tokens: list[int] = []
        self.resumed_tokens = 0

    def begin_turn(self, prompt: list[int]) -> list[int]:
        from latentkv.kv.store_session import reusable_prefix

        self.resumed_tokens = keep = reusable_prefix(self.tokens, prompt)
        self.cache.trim(keep)
        self.tokens = self.tokens[:keep]
        return prompt[keep:]

    def end_turn(self, ids: list[int]) -> None:
        self.tokens = list(ids[: self.cache.length])

    def reset(self) -> None:
        self.cache.trim(0)
        self.tokens = []

    def close(self) -> None:
        pass
