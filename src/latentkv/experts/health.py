"""Whether an expert store serves every expert it holds: the damage found while running, what
repairs it, and the check that notices the repair (stdlib only).

    health = StoreHealth(directory, manifest)
    try: ext = future.result()
    except ExpertFileError as exc: raise health.failed(layer, e, exc) from None  # + the repair
    health.ok(layer, e)                 # a read that verified: no longer damaged
    health.recheck(reader.read)         # read the damaged ones again (at most every RECHECK_S)
    health.as_dict()                    # {"degraded", "damaged": [{"expert", "error"}], "repair", ...}

A damaged expert is never cached (it never verified), so every later pass that needs it reads it
again from its path: once the store is repaired in place, the next read verifies and the store
is whole again, with no restart. `recheck` finds that out even when no request needs the expert
(the server's /health asks for it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from latentkv.experts.store_file import ExpertFileError, Manifest, expert_name

RECHECK_S = 2.0  # at most this often, the damaged experts are read again by `recheck`


def repair_command(directory: Path, manifest: Manifest) -> str:
    """The command that rewrites the store at `directory` from the checkpoint it came from."""
    meta = manifest.meta
    source = meta.get("source") or "MODEL"
    fmt = meta.get("weight_format") or "f32"
    return f"latentkv experts convert {source} --weight-dtype {fmt} --out {directory} --force"


class StoreHealth:
    def __init__(self, directory: str | Path, manifest: Manifest):
        self.directory = Path(directory)
        self.repair = repair_command(self.directory, manifest)
        self.read_failures = 0  # reads that failed since the store opened
        self._damaged: dict[tuple[int, int], str] = {}
        self._lock = threading.Lock()
        self._checked = 0.0

    @property
    def degraded(self) -> bool:
        return bool(self._damaged)

    def advice(self) -> str:
        return (
            f"repair the store with `{self.repair}` (`latentkv experts verify {self.directory}` lists "
            "the damage); it is read again the next time it is needed"
        )

    def failed(self, layer: int, expert: int, exc: ExpertFileError) -> ExpertFileError:
        """Record a failed read of (layer, expert); the error to raise, with the repair."""
        with self._lock:
            self.read_failures += 1
            self._damaged[(layer, expert)] = str(exc)
        return type(exc)(f"{exc}; {self.advice()}")

    def ok(self, layer: int, expert: int) -> None:
        """A read of (layer, expert) verified."""
        if self._damaged:
            with self._lock:
                self._damaged.pop((layer, expert), None)

    def recheck(self, read: Callable[[int, int], object], force: bool = False) -> None:
        """Read each damaged expert again (at most every RECHECK_S unless `force`); those that
        verify now are whole again."""
        now = time.monotonic()
        if not self._damaged or (not force and now - self._checked < RECHECK_S):
            return
        self._checked = now
        for key in list(self._damaged):
            try:
                read(*key)
            except ExpertFileError as exc:
                with self._lock:
                    self._damaged[key] = str(exc)
                continue
            self.ok(*key)

    def as_dict(self) -> dict:
        with self._lock:
            damaged = [
                {"expert": expert_name(layer, e), "error": text}
                for (layer, e), text in sorted(self._damaged.items())
            ]
        return {
            "degraded": bool(damaged),
            "damaged": damaged,
            "repair": self.repair,
            "read_failures": self.read_failures,
        }
