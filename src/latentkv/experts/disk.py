"""How fast this machine reads its expert store: measured once (verified O_DIRECT reads of up to
MEASURE_BYTES of extents, on READ_THREADS threads, as a pass reads them) and kept beside the
store in `disk.json`, so a cluster places experts by each rank's real disk (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

FILE_NAME = "disk.json"
MEASURE_BYTES = 512 << 20
READ_THREADS = 4


def measure(store: str | Path, max_bytes: int = MEASURE_BYTES, threads: int = READ_THREADS) -> float:
    """GB/s over up to `max_bytes` of the store's extents, read as a pass reads them."""
    from latentkv.experts.reader import ExpertReader

    with ExpertReader(store, direct=None, threads=threads) as r:
        keys = [(layer, e) for layer, entry in sorted(r.manifest.layers.items()) for e in entry.held]
        stride = max((entry.layout.stride for entry in r.manifest.layers.values()), default=1)
        keys = keys[:: max(1, len(keys) // max(1, max_bytes // stride))][: max(1, max_bytes // stride)]
        t0 = time.perf_counter()
        for f in [r.submit(*k) for k in keys]:
            f.result()
        return r.stats.bytes_read / (time.perf_counter() - t0) / 1e9


def disk_gbps(store: str | Path) -> float:
    """The store's read speed: from `disk.json` beside it, else measured now and kept there."""
    path = Path(store) / FILE_NAME
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        value = float(json.loads(path.read_text())["gbps"])
        if value > 0:
            return value
    gbps = measure(store)
    with contextlib.suppress(OSError):
        path.write_text(json.dumps({"gbps": gbps, "measured": time.time()}) + "\n")
    return gbps
