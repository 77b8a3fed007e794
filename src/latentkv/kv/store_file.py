"""The KV file at the byte level: header, commit slots, checksummed records (stdlib only).

    0        header: magic "\\x89LKV\\r\\n\\x1a\\n", u16 major, u16 minor, u32 J, u32 R,
             J bytes of JSON (KVHeader), SHA-256 of all that; zero padding to P (4 KiB multiple)
    P        commit slot 0: u64 seq, u64 count, 16-byte check   (rest of the 4 KiB block zero)
    P+4096   commit slot 1
    D=P+8192 records, R bytes each: payload (token, rows, keys) + 16-byte chained check

All integers little-endian. A record's check is SHA-256(header digest, "record", u64 index,
previous record's check, payload)[:16], so a verified record is the one written at that index
after exactly those predecessors. An append writes its records past the committed ones,
fsyncs, then writes the next commit into the older slot and fsyncs again: a crash at any
point leaves the previous commit intact, and readers never look past the newest valid one.
Readers verify every record they return and cut back to the longest verified prefix.

This module never imports torch or numpy (the crash test's child process starts in
milliseconds); `latentkv.kv.store` maps caches to and from the payload bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import secrets
import struct
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from latentkv import fs, version
from latentkv.kv.store_header import (
    CHECK_BYTES,
    KVFileBusy,
    KVFileError,
    KVFileUnavailable,
    KVHeader,
    RecordLayout,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]

MAGIC = b"\x89LKV\r\n\x1a\n"  # PNG-style: a high byte and CR LF / ^Z / LF catch text-mode damage
FORMAT_MAJOR = 1  # a reader refuses any other major version
FORMAT_MINOR = 0  # minor versions only add header keys; readers accept any minor
PREFIX = struct.Struct("<8sHHII")  # magic, major, minor, JSON length J, record size R
DIGEST_BYTES = 32
BLOCK = 4096
SLOT = struct.Struct("<QQ16s")  # sequence, committed record count, check
MAX_HEADER_JSON = 1 << 20
DEFAULT_CHUNK_BYTES = 8 << 20
ZERO_CHECK = bytes(CHECK_BYTES)


@dataclass
class Scan:
    """What a pass over the committed records found."""

    committed: int  # record count of the newest valid commit
    count: int  # leading committed records that verify (count <= committed)
    last_check: bytes  # check of record count - 1 (16 zero bytes when count is 0)
    file_bytes: int  # file size when scanned
    data: bytearray | None = None  # count * R bytes, when asked for
    notes: list[str] = field(default_factory=list)


class RecordFile:
    """One KV file, open for reading or (exclusively, under an advisory lock) for appending.

    A writable file is checked before its first write: a torn or damaged tail is cut back to
    the longest verified committed prefix (committed again, then truncated away).
    """

    def __init__(
        self,
        path: Path,
        fd: int,
        header: KVHeader,
        digest: bytes,
        data_offset: int,
        *,
        minor: int,
        writable: bool,
        chunk_bytes: int,
        commit: tuple[int, int, int],
        notes: list[str],
    ):
        self.path = path
        self.header = header
        self.layout: RecordLayout = header.record_layout()
        self.digest = digest  # SHA-256 of the header bytes: seeds every check in the file
        self.data_offset = data_offset
        self.minor = minor
        self.writable = writable
        self.chunk_bytes = max(chunk_bytes, 1)
        self.notes = notes  # what opening found (damaged commit slots)
        self._fd: int | None = fd
        self._seq, self._count, self._slot = commit  # the newest commit and the slot holding it
        self._last_check = ZERO_CHECK
        self._scanned = False  # tail checked and cut (writers only)
        self._failed: str | None = None

    # --- opening --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | Path,
        header: KVHeader,
        *,
        replace: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> RecordFile:
        """Write a new, empty file atomically (temp file, fsync, link/rename, fsync the folder).
        FileExistsError if `path` exists and not `replace`; DiskError (one line) if the disk
        refuses, with nothing left behind."""
        _require_little_endian()
        path = Path(path)
        header = KVHeader.from_json(_stamp(header).to_json())  # what we write, we can read
        area, digest = header_area(header)
        slots = bytearray(2 * BLOCK)
        slots[BLOCK : BLOCK + SLOT.size] = slot_bytes(digest, 1, 0)  # commit 1 (no records) in slot 1
        try:
            # a KV file holds a conversation: private to the user
            with fs.Publish(path, "creating the KV file", replace=replace, mode=0o600) as out:
                out.write(area + slots)
        except fs.DiskError as exc:
            if exc.errno == errno.EEXIST and not replace:
                raise FileExistsError(errno.EEXIST, str(exc), str(path)) from None
            raise
        return cls.open(path, writable=True, chunk_bytes=chunk_bytes)

    @classmethod
    def open(
        cls, path: str | Path, *, writable: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> RecordFile:
        """Open an existing file; KVFileError if its header or both commit slots are unreadable."""
        _require_little_endian()
        path = Path(path)
        fd = open_regular(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            if writable:
                _lock(fd, path)
            header, digest, data_offset, minor = read_header(fd, os.fstat(fd).st_size, path)
            commit, notes = read_commit(fd, digest, data_offset, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(
            path,
            fd,
            header,
            digest,
            data_offset,
            minor=minor,
            writable=writable,
            chunk_bytes=chunk_bytes,
            commit=commit,
            notes=notes,
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also drops the lock
            self._fd = None

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def committed(self) -> int:
        """Records in the newest commit (for a writer after its first check: all verified)."""
        return self._count

    def recover(self) -> int:
        """(Writers) check the tail once and cut it back to the verified prefix; the record count."""
        self._check_writable()
        self._ensure_scanned()
        return self._count

    def rename(self, path: str | Path) -> None:
        """Move the open file to `path`, replacing what is there (atomically), and fsync the folder."""
        path = Path(path)
        fs.rename(self.path, path, "replacing the KV file")
        self.path = path

    def size_for(self, records: int) -> int:
        """The exact file size holding `records` committed records and nothing else."""
        return self.data_offset + records * self.layout.size

    # --- reading --------------------------------------------------------------------------

    def read(self) -> Scan:
        """The committed records that verify, as bytes (a writer also cuts the file back to them)."""
        scan = self._scan(keep=True)
        if self.writable:
            self._repair(scan)
        return scan

    def verify(self) -> Scan:
        """Check every committed record without keeping them (streams the file)."""
        return self._scan(keep=False)

    def _scan(self, keep: bool) -> Scan:
        fd = self._open_fd()
        size = os.fstat(fd).st_size
        (seq, committed, slot), notes = read_commit(fd, self.digest, self.data_offset, self.path)
        R = self.layout.size
        whole = max(0, size - self.data_offset) // R
        n = min(committed, whole)
        if whole < committed:
            notes.append(f"the file holds {whole} whole records but its commit says {committed}")
        # Grown as records verify, never sized from the commit count: a count that a sparse or
        # damaged tail seems to back allocates nothing before its records check.
        data = bytearray() if keep else None
        count, prev, problem = 0, ZERO_CHECK, None
        step = max(1, self.chunk_bytes // R)
        for start in range(0, n, step):
            buf = self._pread(fd, min(step, n - start) * R, self.data_offset + start * R)
            view = memoryview(buf)
            for j in range(len(buf) // R):
                rec = view[j * R : (j + 1) * R]
                problem = self._record_problem(count, rec, prev)
                if problem:
                    break
                prev = bytes(rec[-CHECK_BYTES:])
                count += 1
            if data is not None:
                data += view[: (count - start) * R]
            if problem or len(buf) < min(step, n - start) * R:
                break
        if count < n:
            notes.append(problem or f"the file ended while reading record {count}")
        if count < committed:
            notes.append(f"cut back to the {count} records that verify ({committed} were committed)")
        if data is not None:
            del data[count * R :]
        tail = size - self.size_for(committed)
        if tail > 0:
            notes.append(f"ignored {tail} bytes past the last commit (an append that never committed)")
        self._seq, self._slot = seq, slot
        return Scan(committed, count, prev, size, data, notes)

    def _record_problem(self, index: int, rec: memoryview, prev: bytes) -> str | None:
        """Why record `index` (R bytes) cannot be trusted, or None."""
        payload = rec[:-CHECK_BYTES]
        if record_check(self.digest, index, prev, payload) != rec[-CHECK_BYTES:]:
            return f"record {index} fails its checksum"
        return payload_problem(self.layout, self.header.model.vocab_size, index, payload)

    # --- writing --------------------------------------------------------------------------

    def append(self, payload: bytes | bytearray | memoryview, n: int) -> int:
        """Append n records (payload: n * payload_size bytes) durably; returns the new count."""
        self.recover()
        P = self.layout.payload_size
        if n < 0 or len(payload) != n * P:
            raise ValueError(f"{n} records of {P} payload bytes need {n * P} bytes, got {len(payload)}")
        if n == 0:
            return self._count
        records, last = self._seal(memoryview(payload).cast("B"), n)
        start, view = self._count, memoryview(records)
        with self._writing(f"appending {n} records to the KV file") as doing:
            for off in range(0, len(records), self.chunk_bytes):
                chunk = view[off : off + self.chunk_bytes]
                fs.pwrite_all(self._fd, chunk, self.size_for(start) + off, self.path, doing)
            fs.sync(self._fd, self.path, doing)
            self._commit(start + n, last)
        return self._count

    def truncate(self, n: int) -> None:
        """Keep the first n records (a prompt that diverges keeps the common prefix)."""
        self.recover()
        if not 0 <= n <= self._count:
            raise ValueError(f"cannot truncate a file of {self._count} records to {n}")
        if n == self._count:
            return
        last = self._pread(self._fd, CHECK_BYTES, self.size_for(n) - CHECK_BYTES) if n else ZERO_CHECK
        with self._writing(f"cutting the KV file back to {n} records"):
            self._commit(n, last)
            self._truncate(self.size_for(n))

    def _seal(self, payload: memoryview, n: int) -> tuple[bytearray, bytes]:
        """Payloads -> records with chained checks; ValueError on a token or scale we would refuse to read."""
        P, R = self.layout.payload_size, self.layout.size
        out = bytearray(n * R)
        prev = self._last_check
        for j in range(n):
            rec = payload[j * P : (j + 1) * P]
            index = self._count + j
            if problem := payload_problem(self.layout, self.header.model.vocab_size, index, rec):
                raise ValueError(f"refusing to write: {problem}")
            prev = record_check(self.digest, index, prev, rec)
            out[j * R : j * R + P] = rec
            out[j * R + P : (j + 1) * R] = prev
        return out, prev

    def _commit(self, count: int, last_check: bytes) -> None:
        """Write commit seq+1 into the slot that does not hold the newest commit, then fsync."""
        seq, slot = self._seq + 1, 1 - self._slot
        doing = "committing the KV file"
        offset = slot_offset(self.data_offset, slot)
        fs.pwrite_all(self._fd, slot_bytes(self.digest, seq, count), offset, self.path, doing)
        fs.sync(self._fd, self.path, doing)
        self._seq, self._slot, self._count, self._last_check = seq, slot, count, last_check

    def _ensure_scanned(self) -> None:
        if not self._scanned:
            self._repair(self._scan(keep=False))

    def _repair(self, scan: Scan) -> None:
        """Make the file exactly its verified prefix: commit it if shorter, cut every byte past it."""
        with self._writing("cutting the KV file back to its verified records"):
            if scan.count != scan.committed:
                self._commit(scan.count, scan.last_check)
            if scan.file_bytes != self.size_for(scan.count):
                self._truncate(self.size_for(scan.count))
        self._count, self._last_check, self._scanned = scan.count, scan.last_check, True

    def _truncate(self, size: int) -> None:
        doing = "cutting the KV file back"
        try:
            os.ftruncate(self._open_fd(), size)
        except OSError as exc:
            raise fs.error(exc, self.path, doing) from None
        fs.sync(self._open_fd(), self.path, doing)

    def _pread(self, fd: int, n: int, offset: int) -> bytes:
        return _pread(fd, n, offset, self.path)

    @contextlib.contextmanager
    def _writing(self, what: str):
        """Around a write: a DiskError (one line) if the disk refuses, after which this handle
        writes no more (the page cache may not match the disk); the file keeps its last commit."""
        try:
            yield what
        except (OSError, fs.DiskError) as exc:
            problem = fs.error(exc, self.path, what) if isinstance(exc, OSError) else exc
            self._failed = str(problem)
            raise fs.DiskError(
                f"{problem}; the file keeps its last commit ({self._count} records)", self.path, problem.errno
            ) from None

    def _check_writable(self) -> None:
        if not self.writable:
            raise KVFileError(f"{self.path} is open for reading only")
        if self._failed:
            raise KVFileError(f"{self.path}: an earlier write failed ({self._failed}); reopen the file")
        self._open_fd()

    def _open_fd(self) -> int:
        if self._fd is None:
            raise KVFileError(f"{self.path} is closed")
        return self._fd


# --- the pieces, as functions (the spec in docs/kv-file-format.md names them) ---------------


def header_area(header: KVHeader) -> tuple[bytes, bytes]:
    """(header bytes padded to a 4 KiB multiple, SHA-256 digest of the unpadded header)."""
    body = header.to_json()
    if len(body) > MAX_HEADER_JSON:
        raise KVFileError(f"header JSON of {len(body)} bytes exceeds {MAX_HEADER_JSON}")
    head = PREFIX.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, len(body), header.record_layout().size) + body
    digest = hashlib.sha256(head).digest()
    area = head + digest
    return area + bytes(-len(area) % BLOCK), digest


def read_header(fd: int, size: int, path: str | Path = "the KV file") -> tuple[KVHeader, bytes, int, int]:
    """Parse and verify the header: (header, digest, data offset D, minor version)."""
    if size < PREFIX.size:
        raise KVFileError(f"{size} bytes is too short to be a latentkv KV file")
    head = _pread(fd, PREFIX.size, 0, path)
    magic, major, minor, json_bytes, record_bytes = PREFIX.unpack(head)
    if magic != MAGIC:
        raise KVFileError("not a latentkv KV file (wrong magic bytes)")
    if major != FORMAT_MAJOR:
        newer = "a newer" if major > FORMAT_MAJOR else "an unknown"
        raise KVFileError(
            f"written in {newer} format version ({major}.{minor}); this latentkv reads version "
            f"{FORMAT_MAJOR}.x: upgrade latentkv to resume it"
        )
    if json_bytes > MAX_HEADER_JSON:
        raise KVFileError(f"header length {json_bytes} exceeds {MAX_HEADER_JSON}: the header is damaged")
    end = PREFIX.size + json_bytes + DIGEST_BYTES
    if size < end:
        raise KVFileError(f"the file ends inside its header ({size} of {end} bytes)")
    rest = _pread(fd, json_bytes + DIGEST_BYTES, PREFIX.size, path)
    digest = hashlib.sha256(head + rest[:json_bytes]).digest()
    if digest != rest[json_bytes:]:
        raise KVFileError("the header fails its checksum: the header is damaged")
    header = KVHeader.from_json(rest[:json_bytes])
    if header.record_layout().size != record_bytes:
        raise KVFileError(
            f"the header says records of {record_bytes} bytes, its fields make {header.record_layout().size}"
        )
    return header, digest, end + (-end % BLOCK) + 2 * BLOCK, minor


def slot_offset(data_offset: int, index: int) -> int:
    return data_offset - 2 * BLOCK + index * BLOCK


def slot_bytes(digest: bytes, seq: int, count: int) -> bytes:
    return SLOT.pack(seq, count, _slot_check(digest, seq, count))


def _slot_check(digest: bytes, seq: int, count: int) -> bytes:
    return hashlib.sha256(digest + b"commit" + struct.pack("<QQ", seq, count)).digest()[:CHECK_BYTES]


def read_commit(
    fd: int, digest: bytes, data_offset: int, path: str | Path = "the KV file"
) -> tuple[tuple[int, int, int], list[str]]:
    """((sequence, record count, slot index) of the newest valid commit, notes on damaged slots)."""
    found, notes = [], []
    for index in (0, 1):
        raw = _pread(fd, SLOT.size, slot_offset(data_offset, index), path)
        if raw == bytes(SLOT.size):
            continue  # never written (a new file has one commit, in slot 1)
        seq, count, check = SLOT.unpack(raw) if len(raw) == SLOT.size else (0, 0, b"")
        if seq >= 1 and check == _slot_check(digest, seq, count):
            found.append((seq, count, index))
        else:
            notes.append(f"commit slot {index} does not verify (a torn commit write, or damage)")
    if not found:
        raise KVFileError("neither commit slot verifies: the file's commit area is damaged")
    newest = max(found)
    if notes:
        notes.append(f"using commit {newest[0]} ({newest[1]} records)")
    return newest, notes


def record_check(digest: bytes, index: int, prev: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.sha256(digest)
    h.update(b"record")
    h.update(struct.pack("<Q", index))
    h.update(prev)
    h.update(payload)
    return h.digest()[:CHECK_BYTES]


def payload_problem(layout: RecordLayout, vocab: int, index: int, payload: bytes | memoryview) -> str | None:
    """A token id outside the vocabulary or a scale that is negative or not finite, else None."""
    token = int.from_bytes(payload[:4], "little")
    if token >= vocab:
        return f"record {index} holds token id {token}, outside the vocabulary of {vocab}"
    a, b = layout.scales
    if b > a:
        scales = memoryview(payload)[a:b].cast("f")
        if not math.isfinite(math.fsum(scales)) or min(scales) < 0:
            return f"record {index} holds a scale that is negative or not finite"
    return None


def open_regular(path: Path, flags: int) -> int:
    """`fs.open_regular` for a KV file: a directory, FIFO, socket or device is refused from its
    stat before any open (a FIFO would block a reader) and never opened for a blocking read.
    FileNotFoundError when there is no file; every other refusal is KVFileUnavailable with
    one line saying why."""
    try:
        return fs.open_regular(path, flags, "opening the KV file")
    except fs.NotRegular as exc:
        raise KVFileUnavailable(f"{path} is {exc.kind}, not a KV file (regular files only)") from None
    except fs.DiskError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, str(exc), str(path)) from None
        raise KVFileUnavailable(str(exc)) from None


def move_aside(path: str | Path) -> Path:
    """Rename a refused file to NAME.refused-<UTC time>[-k] beside it (never deletes, never overwrites)."""
    path = Path(path)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for k in range(1, 1000):
        target = path.with_name(f"{path.name}.refused-{stamp}" + (f"-{k}" if k > 1 else ""))
        try:
            fs.link_or_rename(path, target)
        except FileExistsError:
            continue
        except OSError as exc:
            raise fs.error(exc, path, "moving the refused KV file aside") from None
        fs.sync_dir(path.parent)
        return target
    raise KVFileError(f"could not find a free name to move {path} aside")


# --- OS helpers ------------------------------------------------------------------------------


def _stamp(header: KVHeader) -> KVHeader:
    """A new file's own identity (even when `header` was read from another file): a random id,
    the creation time and the writer version."""
    return replace(
        header,
        file_id=secrets.token_hex(16),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        writer=f"latentkv {version()}",
    )


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover
        raise KVFileError("KV files are little-endian and this reader needs a little-endian host")


def _lock(fd: int, path: Path) -> None:
    if fcntl is None:  # pragma: no cover
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise KVFileBusy(f"{path} is open for writing by another process") from None


def _pread(fd: int, n: int, offset: int, path: str | Path) -> bytes:
    """Up to n bytes at offset (fewer only at the end of the file)."""
    return fs.pread(fd, n, offset, path, "reading the KV file")
