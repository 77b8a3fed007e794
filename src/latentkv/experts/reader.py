"""Reading experts from an expert store: one pread per expert, verified, on a small thread pool
(stdlib only).

O_DIRECT when the file system takes it (the read bypasses the page cache, so the bytes are
counted once: in our buffer); otherwise a plain pread followed by posix_fadvise(DONTNEED) on the
range, which drops the page-cache copy for the same reason. Buffers are anonymous mmaps: page
aligned, as O_DIRECT needs, and freed when the last view of them goes.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from latentkv.experts.store_file import (
    ALIGN,
    ExpertFileError,
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


class _LayerFile:
    def __init__(self, path: Path, entry: LayerEntry, seed: bytes, direct: bool | None):
        self.path, self.entry = path, entry
        self.fd = os.open(path, os.O_RDONLY)
        try:
            check_layer_header(os.pread(self.fd, ALIGN, 0), entry, seed, path)
        except BaseException:
            os.close(self.fd)
            raise
        self.direct_fd: int | None = None
        if direct is not False and O_DIRECT:
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | O_DIRECT)
            except OSError:
                if direct:
                    os.close(self.fd)
                    raise ExpertFileError(
                        f"{path}: O_DIRECT was asked for but this file system refuses it"
                    ) from None

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
        """One expert, read and verified now (on the calling thread)."""
        entry = self.entry(layer)
        if not 0 <= expert < entry.n_experts:
            raise ExpertFileError(
                f"{expert_name(layer, expert)}: layer {layer} has {entry.n_experts} experts"
            )
        f = self._file(layer)
        stride, offset = entry.layout.stride, entry.offset(expert)
        buf = self.buffers.acquire(stride)
        t0 = time.perf_counter()
        got, direct = self._pread(f, buf, offset)
        t1 = time.perf_counter()
        payload = memoryview(buf)[: min(got, entry.layout.length)]
        verify_extent(self.seed, entry, expert, payload, f.path, self.manifest.checksum)
        t2 = time.perf_counter()
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
                return _preadv_all(f.direct_fd, buf, offset), True
            except OSError as exc:
                if exc.errno != errno.EINVAL or self.direct:
                    raise
                with self._lock:  # this file system took the open but not the read: stop trying
                    if f.direct_fd is not None:
                        os.close(f.direct_fd)
                        f.direct_fd = None
                        self.notes.append(f"{f.path}: O_DIRECT reads refused (EINVAL); using pread")
        got = _preadv_all(f.fd, buf, offset)
        if self.drop_cache and FADV_DONTNEED is not None:
            os.posix_fadvise(f.fd, offset, len(buf), FADV_DONTNEED)
        return got, False

    def _file(self, layer: int) -> _LayerFile:
        f = self._files.get(layer)
        if f is None:
            with self._lock:
                f = self._files.get(layer)
                if f is None:
                    entry = self.entry(layer)
                    f = _LayerFile(self.directory / entry.file, entry, self.seed, self.direct)
                    self._files[layer] = f
        return f

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for f in self._files.values():
            f.close()
        self._files.clear()
        self.buffers.close()

    def __enter__(self) -> ExpertReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BufferPool:
    """Page-aligned read buffers, reused once nothing refers to them any more.

    A fresh anonymous mapping costs its pages' faults and zeroing when the first read lands in
    it and an unmap when it is dropped: ~13 ms of kernel time for a 21 MB expert, on the CPU the
    model computes on, for every expert read. An expert's tensors are views of its buffer, so a
    buffer is free exactly when no view, extent or expert refers to it any more, which CPython's
    reference count says; the pool hands such a buffer out again instead of mapping a new one.
    At most `keep_free` free buffers of a size stay mapped (the rest are unmapped when next seen),
    so memory past the expert cache stays within the reads of one pass. Without reference counts
    (not CPython) every buffer is fresh."""

    def __init__(self, keep_free: int):
        self.keep_free = keep_free
        self._buffers: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.reused = 0
        self.mapped = 0
        probe = [mmap.mmap(-1, mmap.PAGESIZE)]
        self._idle = _refs_at(probe, 0)  # the count of a buffer only the pool's list refers to
        probe[0].close()

    def acquire(self, size: int) -> mmap.mmap:
        with self._lock:
            mine = self._buffers.setdefault(size, [])
            free = [i for i in range(len(mine)) if self._idle is not None and _refs_at(mine, i) == self._idle]
            for i in reversed(free[self.keep_free :]):  # unmap the free ones past keep_free
                mine.pop(i).close()
            if free:
                buf = mine.pop(free[0])
                mine.append(buf)
                self.reused += 1
                return buf
            buf = _anonymous(size)
            if self._idle is not None:
                mine.append(buf)
            self.mapped += 1
            return buf

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for bufs in self._buffers.values() for b in bufs)

    def close(self) -> None:
        with self._lock:
            for bufs in self._buffers.values():
                for buf in bufs:
                    with contextlib.suppress(BufferError):  # still viewed: freed with its views
                        buf.close()
            self._buffers.clear()


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of `size` bytes, in transparent huge pages where the kernel
    gives them (MADV_HUGEPAGE): an O_DIRECT read pins ~10 huge pages instead of ~5,000 small
    ones for a 21 MB expert (measured: a quarter of the kernel time per read, 1.3 -> 1.7 GB/s on
    one thread)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and size >= 2 << 20:
        with contextlib.suppress(OSError):
            buf.madvise(advice)
    return buf


def _refs_at(items: list, i: int) -> int | None:
    """The reference count of items[i] as seen from here (the same for every item that only
    `items` refers to); None where the interpreter keeps no counts."""
    getrefcount = getattr(sys, "getrefcount", None)
    return None if getrefcount is None else getrefcount(items[i])


class PriorityPool:
    """A fixed pool of threads running submitted calls, lowest priority number first (FIFO
    within a priority). Cancelling a queued call's future drops it."""

    def __init__(self, threads: int, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((priority, next(self._order), future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            _priority, _n, future, fn, args = self._queue.get()
            if future is None:  # shutdown
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put((float("inf"), next(self._order), None, None, ()))
        if wait:
            for t in self._threads:
                t.join()


def _preadv_all(fd: int, buf: mmap.mmap, offset: int) -> int:
    """Fill buf from offset (fewer bytes only at the end of the file); the byte count.

    A short read that stops off a 4 KiB boundary is the end of the file (and O_DIRECT could not
    continue from there anyway)."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = os.preadv(fd, [view[got:]], offset + got)
        got += n
        if n == 0 or got % ALIGN:
            break
    return got
