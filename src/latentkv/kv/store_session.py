"""A conversation that survives restarts: the loop the CLI (`--session`) and the server run.

    session, cache = Session.resume(path, current_header, tier)   # tier: the model's KVTier
    keep = reusable_prefix(session.tokens, prompt)       # tokens whose rows are already cached
    cache.trim(keep); session.keep(keep)                 # then prefill prompt[keep:] as usual
    ...generate...
    session.save(tokens_in_cache, cache)                 # after every turn: durable on return
    session.close()

`resume` never fails on a bad file: a file from another model or tier, or one whose header is
damaged, is moved aside (never deleted) and the conversation starts over; `notes` say what
happened, in lines fit for the user. A file that another process has open for writing is
not bad: `resume` raises KVFileBusy and leaves it alone; a path that is not a regular file we
may open (a directory, a FIFO, permission denied) raises KVFileUnavailable, also left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from latentkv.kv.cache import KVTier
from latentkv.kv.store import Cache, KVFile, KVMismatch, rewrite
from latentkv.kv.store_compat import REENCODE
from latentkv.kv.store_file import move_aside
from latentkv.kv.store_header import KVFileBusy, KVFileError, KVFileUnavailable, KVHeader


class Session:
    def __init__(self, path: Path, file: KVFile, header: KVHeader, tokens: list[int], notes: list[str]):
        self.path = path
        self.file = file
        self.header = header  # what this run writes
        self.tokens = tokens  # what the file holds, one id per record
        self.notes = notes
        self.moved_to: Path | None = None  # where a refused file went
        self.rewrite_pending = False  # the file is in another tier (f32, re-encoded): rewrite on save
        self._kept = len(tokens)  # leading records whose rows the caller's cache still holds

    @classmethod
    def resume(cls, path: str | Path, current: KVHeader, tier: KVTier) -> tuple[Session, Cache]:
        """Open or create the session file at `path`; returns it and a cache holding its tokens."""
        path = Path(path)
        if path.is_symlink() and not path.exists():
            raise KVFileUnavailable(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: restore that "
                "file or remove the link"
            )
        if not path.exists():
            return cls(path, KVFile.create(path, current), current, [], []), tier.make_cache()
        try:
            file = KVFile.open(path, writable=True)
        except (KVFileBusy, KVFileUnavailable):  # nothing wrong with a KV file: leave it alone
            raise
        except KVFileError as exc:
            return cls._start_over(path, current, tier, f"the KV file cannot be read: {exc}")
        try:
            result = file.load(expected=current)
            cache = result.to_cache(tier)
        except KVMismatch as exc:
            file.close()
            return cls._start_over(path, current, tier, exc.verdict.message)
        except BaseException:
            file.close()
            raise
        session = cls(path, file, current, result.tokens, list(result.notes))
        session.rewrite_pending = result.verdict is not None and result.verdict.action == REENCODE
        return session, cache

    @classmethod
    def _start_over(cls, path: Path, current: KVHeader, tier: KVTier, why: str) -> tuple[Session, Cache]:
        moved = move_aside(path)
        session = cls(path, KVFile.create(path, current), current, [], [])
        session.moved_to = moved
        session.notes.append(f"{why}: starting over (the old file is kept as {moved})")
        return session, tier.make_cache()

    def keep(self, n: int) -> None:
        """The caller's cache keeps the rows of the first n saved tokens only (it was trimmed to n):
        the next save rewrites every record past n, even where the token ids did not change, since
        the cache recomputes those rows (a recomputed row may differ in its last bits)."""
        self._kept = min(self._kept, n)

    def save(self, tokens: list[int], cache: Cache) -> int:
        """Make the file hold exactly `tokens`, the ids of the cache's rows (len == cache.length).

        Keeps the common prefix with what the file holds (its rows must be the cache's), cuts
        the rest, appends the new rows as one turn. Returns the number of tokens saved.
        """
        if len(tokens) != cache.length:
            raise ValueError(f"{len(tokens)} token ids for a cache of {cache.length} rows")
        if self.rewrite_pending:
            self.file.close()
            self.file = rewrite(self.path, self.header, tokens, cache)
            self.rewrite_pending = False
        else:
            keep = min(common_prefix(self.tokens, tokens), self._kept)
            if keep < len(self.tokens):
                self.file.truncate(keep)
            self.file.append(tokens[keep:], cache, keep, len(tokens))
        self.tokens = list(tokens)
        self._kept = len(self.tokens)
        return len(self.tokens)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_prefix(saved: list[int], prompt: list[int]) -> int:
    """How many saved tokens a run of `prompt` keeps: the common prefix, less one if it covers
    the whole prompt (the last prompt token must run again to give the next token's logits)."""
    return min(common_prefix(saved, prompt), len(prompt) - 1) if prompt else 0
