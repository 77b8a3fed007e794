"""Reading experts from an expert store: one pread per expert, verified, on a small thread pool
(stdlib only).

O_DIRECT when the file system takes it (the read bypasses the page cache, so the bytes are
counted once: in our buffer); otherwise a plain pread followed by posix_fadvise(DONTNEED) on the
range, which drops the page-cache copy for the same reason. Buffers are anonymous mmaps (page
aligned, as O_DIRECT needs) from a `BufferPool`, reused once the last view of them goes; reads
run on a `PriorityPool`, a pass's own before predictions' (`latentkv.experts.pools`).

Layer files are opened through `latentkv.fs` (regular files only, never a blocking open). A read
that fails (a damaged extent, a layer file gone, replaced by a folder or a FIFO, an I/O error)
raises with the expert's name and retires that layer's open file, so the next read opens the
path again: a store repaired in place (`latentkv experts convert ... --force`) is picked up
without a restart.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from latentkv import fs
from latentkv.experts.pools import BufferPool, PriorityPool
from latentkv.experts.store_file import (
    ALIGN,
    ExpertDamaged,
    ExpertFileError,
    ExpertUnreadable,
    ExtentLayout,
    LayerEntry,
    Manifest,
    check_layer_header,
    expert_name,
    read_manifest,
    seed_for,
    verify_extent,
)

O_DIRECT = getattr(os, "O_DIRECT", 0)
# Free read buffers kept mapped for the next reads (`BufferPool`): memory past the cache and the
# pass's reads, which the planner reserves in the working set.
SPARE_BUFFERS = 4
FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


@dataclass
class Extent:
    """One verified expert: its payload inside an aligned buffer, and where each tensor sits."""

    layer: int
    expert: int
    buffer: mmap.mmap  # `layout.stride` bytes; the payload is the first `layout.length`
    layout: ExtentLayout

    def view(self, name: str) -> memoryview:
        spec = self.layout.spec(name)
        return memoryview(self.buffer)[spec.offset : spec.offset + spec.nbytes]


@dataclass
class ReadStats:
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # summed over threads: time inside pread
    verify_seconds: float = 0.0
    direct_reads: int = 0


DOING = "reading the expert store"


class _LayerFile:
    """A layer file's descriptors (plain, and O_DIRECT where taken), counted by the reads using
    them: a retired file closes once its last read is done (never under a read in flight)."""

    def __init__(self, path: Path, entry: LayerEntry, seed: bytes, direct: bool | None):
        self.path, self.entry = path, entry
        self.users = 0
        self.retired = False
        self.fd = fs.open_regular(path, os.O_RDONLY, DOING)
        self.direct_fd: int | None = None
        try:
            check_layer_header(fs.pread(self.fd, ALIGN, 0, path, DOING), entry, seed, path)
            if direct is not False and O_DIRECT:
                self.direct_fd = self._open_direct(direct)
        except BaseException:
            os.close(self.fd)
            raise

    def _open_direct(self, required: bool | None) -> int | None:
        try:
            return fs.open_regular(self.path, os.O_RDONLY | O_DIRECT, DOING)
        except fs.DiskError:
            if required:
                raise ExpertFileError(
                    f"{self.path}: O_DIRECT was asked for but this file system refuses it"
                ) from None
            return None

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


class ExpertReader:
    """Verified reads of single experts from an expert store directory.

    direct: True (O_DIRECT or refuse), False (plain pread + drop the page cache), None (O_DIRECT
    where the file system takes it, else plain)."""

    def __init__(
        self,
        directory: str | Path,
        fingerprint: str | None = None,
        *,
        direct: bool | None = None,
        threads: int = 4,
        drop_cache: bool = True,
    ):
        self.directory = Path(directory)
        self.manifest: Manifest = read_manifest(self.directory, fingerprint)
        self.seed = seed_for(self.manifest.fingerprint)
        self.direct, self.drop_cache = direct, drop_cache
        self.stats = ReadStats()
        self.notes: list[str] = []
        self._files: dict[int, _LayerFile] = {}
        self._lock = threading.Lock()
        self._pool = PriorityPool(max(1, threads), "lkv-experts")
        self.buffers = BufferPool(keep_free=SPARE_BUFFERS)

    def entry(self, layer: int) -> LayerEntry:
        try:
            return self.manifest.layers[layer]
        except KeyError:
            raise ExpertFileError(
                f"the expert store has no layer {layer} (it has {sorted(self.manifest.layers)})"
            ) from None

    def uses_direct(self, layer: int) -> bool:
        return self._file(layer).direct_fd is not None

    def submit(self, layer: int, expert: int, urgent: bool = True) -> Future[Extent]:
        """Start reading one expert on the pool; the future raises ExpertDamaged if it fails its
        check. Urgent reads (a pass waits for them) start before any queued non-urgent one (a
        prediction's)."""
        return self._pool.submit(0 if urgent else 1, self.read, layer, expert)

    def read(self, layer: int, expert: int) -> Extent:
        """One expert, read and verified now (on the calling thread). ExpertDamaged when its
        bytes fail their check, ExpertUnreadable when its layer file cannot be read; either
        retires the layer's open file (the next read opens the path again)."""
        entry = self.entry(layer)
        if not entry.holds(expert):
            has = f"has {entry.n_experts} experts" if entry.ids is None else "is in this share of the experts"
            raise ExpertFileError(
                f"{expert_name(layer, expert)}: not in the expert store at {self.directory} "
                f"(layer {layer} {has}{'' if entry.ids is None else ': not this one'})"
            )
        stride, offset = entry.layout.stride, entry.offset(expert)
        f = None
        try:
            f = self._acquire(layer)
            buf = self.buffers.acquire(stride)
            t0 = time.perf_counter()
            got, direct = self._pread(f, buf, offset)
            t1 = time.perf_counter()
            payload = memoryview(buf)[: min(got, entry.layout.length)]
            verify_extent(self.seed, entry, expert, payload, f.path, self.manifest.checksum)
            t2 = time.perf_counter()
        except (ExpertDamaged, ExpertFileError, fs.DiskError) as exc:
            self._retire(layer, f)
            if isinstance(exc, ExpertDamaged):
                raise
            text = str(exc)
            name = expert_name(layer, expert)
            raise ExpertUnreadable(text if text.startswith(name) else f"{name}: {text}") from None
        finally:
            if f is not None:
                self._release(f)
        with self._lock:
            s = self.stats
            s.reads += 1
            s.bytes_read += got
            s.read_seconds += t1 - t0
            s.verify_seconds += t2 - t1
            s.direct_reads += direct
        return Extent(layer, expert, buf, entry.layout)

    def _pread(self, f: _LayerFile, buf: mmap.mmap, offset: int) -> tuple[int, bool]:
        if f.direct_fd is not None:
            try:
                return fs.preadv(f.direct_fd, buf, offset, f.path, DOING, stop_at=ALIGN, direct=True), True
            except fs.DiskError as exc:
                if exc.errno != errno.EINVAL or self.direct:
                    raise
                with self._lock:  # this file system took the open but not the read: stop trying
                    if f.direct_fd is not None:
                        os.close(f.direct_fd)
                        f.direct_fd = None
                        self.notes.append(f"{f.path}: O_DIRECT reads refused (EINVAL); using pread")
        got = fs.preadv(f.fd, buf, offset, f.path, DOING, stop_at=ALIGN)
        if self.drop_cache and FADV_DONTNEED is not None:
            os.posix_fadvise(f.fd, offset, len(buf), FADV_DONTNEED)
        return got, False

    def _file(self, layer: int) -> _LayerFile:
        with self._lock:
            return self._open(layer)

    def _open(self, layer: int) -> _LayerFile:
        """(Under the lock) the layer's open file, opened now if there is none."""
        f = self._files.get(layer)
        if f is None:
            entry = self.entry(layer)
            f = _LayerFile(self.directory / entry.file, entry, self.seed, self.direct)
            self._files[layer] = f
        return f

    def _acquire(self, layer: int) -> _LayerFile:
        with self._lock:
            f = self._open(layer)
            f.users += 1
            return f

    def _release(self, f: _LayerFile) -> None:
        with self._lock:
            f.users -= 1
            if f.retired and f.users == 0:
                f.close()

    def _retire(self, layer: int, f: _LayerFile | None) -> None:
        """Stop using the layer's open file (closed once its reads are done)."""
        with self._lock:
            current = self._files.get(layer)
            if current is not None and (f is None or current is f):
                del self._files[layer]
                current.retired = True
                if current.users == 0:
                    current.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for f in self._files.values():
                f.retired = True
                if f.users == 0:
                    f.close()
            self._files.clear()
        self.buffers.close()

    def __enter__(self) -> ExpertReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
