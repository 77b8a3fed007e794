"""Crash-test child: append deterministic turns to a KV file until killed.

    python store_crash_child.py FILE CHUNK_BYTES

Opens FILE for appending (which cuts back whatever the previous, killed, child left behind),
prints `ready N` with the records it found, then appends turns forever, printing the record
count after each commit. Every record is a pure function of its index (`payload`), so the
parent checks the file's bytes without running a model. Stdlib only: it starts in
milliseconds, so the parent can afford many trials.
"""

from __future__ import annotations

import hashlib
import struct
import sys

from latentkv.kv.store_file import RecordFile
from latentkv.kv.store_header import CodecSpec, KVHeader, ModelFingerprint, PartFormat, RecordLayout


def header() -> KVHeader:
    """A small two-layer, tq4-shaped file: 64-byte records."""
    model = ModelFingerprint("crash_test", 2, 8, 4, (0,), 4, 1000, "c" * 64)
    c = PartFormat({"name": "tq4", "width": 8, "bits": 4, "rotation_seed": 1}, 4, 1)
    r = PartFormat({"name": "tq4", "width": 4, "bits": 4, "rotation_seed": 1}, 2, 1)
    return KVHeader(model, CodecSpec("tq4", c, r), (0, 1))


def payload(layout: RecordLayout, vocab: int, index: int) -> bytes:
    """Record `index`'s payload: its token, valid (finite, positive) scales, then hashed bytes."""
    token = struct.pack("<I", (index * 7919 + 3) % vocab)
    a, b = layout.scales
    scales = struct.pack(f"<{(b - a) // 4}f", *(1.0 + ((index + k) % 97) / 8 for k in range((b - a) // 4)))
    rest = layout.payload_size - b
    seed = hashlib.sha256(struct.pack("<Q", index)).digest()
    body = (seed * (rest // len(seed) + 1))[:rest]
    return token + scales + body


def turn_size(start: int) -> int:
    """Records in the turn that starts at record `start` (1..9)."""
    return 1 + ((start * 2654435761) >> 7) % 9


def main() -> None:
    path, chunk = sys.argv[1], int(sys.argv[2])
    f = RecordFile.open(path, writable=True, chunk_bytes=chunk)
    count = f.recover()
    print(f"ready {count}", flush=True)
    vocab = f.header.model.vocab_size
    while True:
        n = turn_size(count)
        data = b"".join(payload(f.layout, vocab, i) for i in range(count, count + n))
        count = f.append(data, n)
        print(count, flush=True)


if __name__ == "__main__":
    main()
