"""Crafting KV files whose checksums all verify but whose contents are whatever we say: the
header JSON replaced, its digest recomputed, both commit slots and every record check
re-chained under the new digest (docs/kv-file-format.md). Ordinary damage fails a checksum;
these files get past every checksum, so only the reader's validation stands between them and
the allocator (issue 13, class 7)."""

from __future__ import annotations

import hashlib
import json

from latentkv.kv.store_file import BLOCK, FORMAT_MAJOR, MAGIC, PREFIX, ZERO_CHECK, record_check, slot_bytes


def split(data: bytes) -> tuple[dict, int, int, int]:
    """(header JSON object, record size R, data offset D, committed count) of a file we wrote."""
    _, _, _, json_bytes, record = PREFIX.unpack(data[: PREFIX.size])
    header = json.loads(data[PREFIX.size : PREFIX.size + json_bytes])
    end = PREFIX.size + json_bytes + 32
    offset = end + (-end % BLOCK) + 2 * BLOCK
    slots = [data[offset - 2 * BLOCK + i * BLOCK :][:32] for i in (0, 1)]
    newest = max(slots, key=lambda s: int.from_bytes(s[:8], "little"))  # highest sequence number
    count = int.from_bytes(newest[8:16], "little")
    return header, record, offset, count


def craft(
    header: dict | bytes,
    payloads: bytes,
    record: int,
    count: int,
    seq: int = 2,
    *,
    minor: int = 0,
) -> bytes:
    """A file of `header` (an object, or raw JSON bytes), records of `record` bytes cut from
    `payloads` (each record's first record-16 bytes, resealed), and one commit of `count`
    (sequence `seq`) in slot 1; every checksum valid."""
    body = (
        header
        if isinstance(header, bytes)
        else json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    )
    head = PREFIX.pack(MAGIC, FORMAT_MAJOR, minor, len(body), record) + body
    digest = hashlib.sha256(head).digest()
    area = head + digest
    area += bytes(-len(area) % BLOCK)
    slots = bytearray(2 * BLOCK)
    slots[BLOCK : BLOCK + 32] = slot_bytes(digest, seq, count)
    out = bytearray(area + slots)
    payload_size = record - 16
    prev = ZERO_CHECK
    if payload_size > 0:
        for i in range(len(payloads) // payload_size):
            payload = payloads[i * payload_size : (i + 1) * payload_size]
            prev = record_check(digest, i, prev, payload)
            out += payload + prev
    return bytes(out)


def payloads_of(data: bytes, record: int, offset: int) -> bytes:
    """The payload bytes of every whole record of a file (checks dropped), concatenated."""
    rest = data[offset:]
    return b"".join(rest[i : i + record - 16] for i in range(0, len(rest) - record + 1, record))
