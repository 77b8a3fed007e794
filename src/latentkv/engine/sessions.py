"""Named sessions: conversations kept in KV files, shared by `--session NAME` and the server.

    sessions = SessionFiles(model, tier, model_dir, kv_dir)  # tier: model.tier(cache_config)
    session, cache = sessions.open("agent-1")   # resume DIR/agent-1.kv (or start it)
    todo = resume(session, cache, prompt)        # the part of `prompt` still to prefill
    ...generate over cache...
    save(session, ids, cache)                    # ids of the cache's rows: durable on return
    session.close()

A name is a plain file name ([A-Za-z0-9._-], 1 to 128 characters, no leading dot), never a
path; the file is DIR/NAME.kv, DIR being `--kv-dir` or `config.sessions_dir()`. The CLI and the
server use the same names and files. The KV file itself (what is refused, moved aside, cut
back) is `latentkv.kv.store_session`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from latentkv.kv.cache import KVTier
    from latentkv.kv.store_header import KVHeader
    from latentkv.kv.store_session import Session
    from latentkv.models.model import Model

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
SUFFIX = ".kv"


class SessionUnavailable(RuntimeError):
    """The session's file is held by another process, or its path is not a regular file we may
    open (the server answers 409); the request never ran."""


class SessionBusy(SessionUnavailable):
    """Another process has the session's file open for writing."""


def valid_session_name(name: object) -> bool:
    """A plain file name: [A-Za-z0-9._-], 1 to 128 characters, not starting with '.'."""
    return isinstance(name, str) and bool(NAME.fullmatch(name)) and not name.startswith(".")


def check_session_name(name: object) -> str:
    """The name, if it is valid; ValueError naming the rule otherwise."""
    if not valid_session_name(name):
        text = str(name)
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(
            f"invalid session name {shown!r} ({len(text)} chars): use 1 to 128 letters, digits, '.', '_' "
            "or '-', not starting with '.' (a name, not a path)"
        )
    return name  # type: ignore[return-value]


def session_path(name: str, kv_dir: Path | None) -> Path:
    """DIR/NAME.kv, creating DIR (private to the user); ValueError for a bad name or folder."""
    from latentkv import fs
    from latentkv.config import sessions_dir

    check_session_name(name)
    directory = Path(kv_dir) if kv_dir is not None else sessions_dir()
    try:
        fs.make_dirs(directory, "creating the session folder", mode=0o700)
    except fs.DiskError as exc:  # a file in its place included
        raise ValueError(str(exc)) from None
    return directory / f"{name}{SUFFIX}"


class SessionFiles:
    """The session files of one model under one KV tier, in one folder."""

    def __init__(self, model: Model, tier: KVTier, model_dir: Path, kv_dir: Path | None = None):
        self.model = model
        self.tier = tier
        self.model_dir = Path(model_dir)
        self.kv_dir = kv_dir
        self._header: KVHeader | None = None

    def header(self) -> KVHeader:
        """What this model and tier write (built once: it hashes the checkpoint's headers)."""
        if self._header is None:
            from latentkv.kv.store import header_for
            from latentkv.models.loader import Checkpoint

            cache = self.model.make_cache(self.tier)
            self._header = header_for(self.model.cfg, cache, Checkpoint(self.model_dir).fingerprint())
        return self._header

    def path(self, name: str) -> Path:
        return session_path(name, self.kv_dir)

    def open(self, name: str) -> tuple[Session, object]:
        """Resume session `name` (or start it): the file and a cache holding its tokens.
        SessionBusy when another process writes it, SessionUnavailable when its folder or file
        cannot be opened; ValueError for a bad name."""
        from latentkv.kv.store_header import KVFileBusy, KVFileUnavailable
        from latentkv.kv.store_session import Session

        check_session_name(name)
        try:
            path = self.path(name)
        except ValueError as exc:  # the folder cannot be made, or is a file
            raise SessionUnavailable(f"session {name!r} cannot be opened: {exc}") from None
        try:
            return Session.resume(path, self.header(), self.tier)
        except KVFileBusy:
            raise SessionBusy(f"session {name!r} is in use by another process") from None
        except (KVFileUnavailable, OSError) as exc:
            raise SessionUnavailable(f"session {name!r} cannot be opened: {exc}") from None


def resume(session: Session, cache, prompt: list[int], reuse: bool = True) -> list[int]:
    """Keep the saved rows `prompt` starts with (none unless `reuse`: a request that needs
    every prompt position's logits); returns the part of `prompt` still to prefill."""
    from latentkv.kv.store_session import reusable_prefix

    n = reusable_prefix(session.tokens, prompt) if reuse else 0
    cache.trim(n)
    session.keep(n)
    return prompt[n:]


def save(session: Session, ids: list[int], cache) -> int:
    """Save the cache's rows; `ids` may run past them (the last sampled token has no row yet)."""
    return session.save(ids[: cache.length], cache)
