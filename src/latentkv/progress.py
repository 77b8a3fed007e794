"""Progress of a long stage (loading layers, opening shards) on stderr.

On a terminal: a tqdm bar, redrawn in place. Anywhere else (a CI log, `make demo | tee`, a file),
where every `\\r` redraw would land in the log as one more line of bar: one plain line when the
stage ends, e.g. `loading layers: 61/61 layers in 12.3 s`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")


def progress(
    items: Iterable[T], desc: str, unit: str, stream: TextIO | None = None, leave: bool = True
) -> Iterator[T]:
    """Yield `items`, showing progress on `stream` (default stderr) as described above."""
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, unit=unit, file=stream, leave=leave)
        return
    total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    t0, done = time.perf_counter(), 0
    for item in items:
        yield item
        done += 1
    of = f"/{total}" if total is not None else ""
    stream.write(f"{desc}: {done}{of} {unit}s in {time.perf_counter() - t0:.1f} s\n")
    stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
