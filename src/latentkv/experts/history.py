"""The usage history beside an expert store: how often each expert was routed to, across runs
(stdlib only). Its most used experts are pinned in the cache at start (the hot set).

    DIR/usage.json   {"usage": {"format": "latentkv-expert-usage", "version": 1,
                                "fingerprint": <the store's>, "tokens": N,
                                "layers": {"<layer>": [count per expert, ...]}},
                      "sha256": <hex of the canonical "usage" object>}

Saved crash-safely (temp file, fsync, rename, fsync the folder): a crash leaves the previous
file. A file that is damaged, of another version, or of another model is ignored with a note
(the history only speeds things up; it is never needed for correct output).
"""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from latentkv import fs

FORMAT = "latentkv-expert-usage"
VERSION = 1
FILE_NAME = "usage.json"
MAX_BYTES = 64 << 20  # bounds on the file (untrusted): a count per expert of every layer
MAX_DEPTH = 8


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass
class UsageHistory:
    fingerprint: str
    experts: dict[int, int]  # layer -> number of experts
    counts: dict[int, list[int]] = field(default_factory=dict)
    tokens: int = 0

    def __post_init__(self) -> None:
        for layer, n in self.experts.items():
            self.counts.setdefault(layer, [0] * n)

    def record(self, layer: int, ids: Iterable[int]) -> None:
        row = self.counts[layer]
        for e in ids:
            row[e] += 1

    def hot_set(
        self,
        budget: int,
        expert_bytes: Mapping[int, int],
        only: Mapping[int, Collection[int]] | None = None,
    ) -> list[tuple[int, int]]:
        """The most used (layer, expert) pairs, most used first, whose bytes fit in `budget`;
        only layers that `expert_bytes` names (and with `only`, only the experts it lists)."""
        ranked = sorted(
            (
                (c, layer, e)
                for layer, row in self.counts.items()
                if layer in expert_bytes
                for e, c in enumerate(row)
                if c > 0 and (only is None or e in only.get(layer, ()))
            ),
            key=lambda t: (-t[0], t[1], t[2]),
        )
        out, used = [], 0
        for _c, layer, e in ranked:
            n = expert_bytes[layer]
            if used + n <= budget:
                out.append((layer, e))
                used += n
        return out

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "tokens": self.tokens,
            "layers": {str(layer): list(row) for layer, row in sorted(self.counts.items())},
        }

    def save(self, path: str | Path) -> None:
        """Write crash-safely: temp file, fsync, rename over the old one, fsync the folder.
        DiskError (one line) when the disk refuses; the old file is then left as it was."""
        body = self.to_json()
        data = json.dumps({"usage": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}).encode()
        fs.write_atomic(path, data, "saving the experts' usage history")

    @classmethod
    def load(
        cls, path: str | Path, fingerprint: str, experts: dict[int, int]
    ) -> tuple[UsageHistory, str | None]:
        """(the history at `path`, None), or (an empty history, why the file was ignored)."""
        empty = cls(fingerprint, dict(experts))
        try:
            outer = fs.load_json(fs.read_bounded(path, MAX_BYTES, "reading the usage history"), MAX_DEPTH)
        except fs.DiskError as exc:
            if exc.errno == errno.ENOENT:
                return empty, None
            return empty, f"{exc}; starting a new usage history"
        except ValueError as exc:
            return empty, f"{path}: unreadable usage history ({exc}); starting a new one"
        problem = _problem(outer, fingerprint, experts)
        if problem:
            return empty, f"{path}: {problem}; starting a new one"
        body = outer["usage"]
        counts = {int(k): [int(c) for c in v] for k, v in body["layers"].items()}
        return cls(fingerprint, dict(experts), counts, int(body["tokens"])), None


def _problem(outer: object, fingerprint: str, experts: dict[int, int]) -> str | None:
    try:
        body = outer["usage"]  # type: ignore[index]
        if hashlib.sha256(_canonical(body)).hexdigest() != outer["sha256"]:  # type: ignore[index]
            return "fails its checksum"
        if body["format"] != FORMAT or body["version"] != VERSION:
            return f"format {body['format']!r} version {body['version']!r}, this latentkv writes {VERSION}"
        if body["fingerprint"] != fingerprint:
            return "recorded for another model"
        layers = {int(k): v for k, v in body["layers"].items()}
        if {k: len(v) for k, v in layers.items()} != experts:
            return "its layers or expert counts differ from this store's"
        if any(not isinstance(c, int) or c < 0 for row in layers.values() for c in row):
            return "holds a count that is not a non-negative integer"
        if not isinstance(body["tokens"], int) or body["tokens"] < 0:
            return "holds a bad token count"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return f"malformed ({exc!r})"
    return None
