"""The one way latentkv touches the file system (stdlib only): the KV file, the expert store,
`convert` and the caches all open, write, sync and publish files through here.

    fd = open_regular(path, os.O_RDONLY, "reading the expert store")  # regular files only
    with Publish(path, "saving the manifest") as out:   # a temporary file beside `path`
        out.write(data)                                 # (or out.pwrite(data, offset))
    # on return `path` holds all of it, durably; on any failure the temporary file is gone
    with PublishDir(out_dir, "converting the model") as tmp:   # a whole new folder, renamed last
        ...
    check_space(folder, need, "converting experts")    # refuse up front what cannot fit
    raw = read_bounded(path, limit, "reading the manifest");  obj = load_json(raw, max_depth=64)

Rules every caller gets for free:
- Only regular files are opened: the path is stat-ed first and a directory, FIFO, socket or
  device is refused by name, and the open itself never blocks (O_NONBLOCK; no effect on a
  regular file), so a FIFO where a file belongs is one line, never a hang.
- New files are written under a temporary name and renamed into place (file, then folder,
  fsynced; F_FULLFSYNC on macOS, where fsync does not flush the drive's cache); every failure
  path removes what was partly written.
- Every OSError becomes a `DiskError`: one line naming the path, what was being done and what
  to do ("/x/model.safetensors: no space left on the device while converting the model (0.2 GB
  free): free some space or choose a directory on another disk").

`inject` is the fault seam: tests make chosen operations fail with an errno for paths under a
folder (EIO, say, which no test can get from a real disk). Nothing else in the package fakes
file-system failures.
"""

from __future__ import annotations

import contextlib
import errno as E
import json
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from latentkv.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

# errno -> (what happened, what to do)
_REASONS: dict[int, tuple[str, str]] = {
    E.ENOSPC: ("no space left on the device", "free some space or choose a directory on another disk"),
    E.EDQUOT: ("the disk quota is used up", "free some space or choose a directory on another disk"),
    E.EROFS: ("the file system is read-only", "choose a directory on a writable file system"),
    E.EACCES: ("permission denied", "check its permissions, or choose a directory you may write"),
    E.EPERM: ("operation not permitted", "check its permissions, or choose another directory"),
    E.EIO: (
        "input/output error (the disk or the file system is failing)",
        "check the disk (dmesg, smartctl) and copy what you need elsewhere",
    ),
    E.ENOENT: ("no such file or directory", "check the path"),
    E.ENOTDIR: (
        "a part of the path is a file, not a directory",
        "give a path whose directories are directories",
    ),
    E.EISDIR: ("it is a directory", "give the path of a file"),
    E.ELOOP: ("too many levels of symbolic links (a link loop?)", "fix the symbolic link"),
    E.ENAMETOOLONG: ("the name is too long", "choose a shorter path"),
    E.EMFILE: ("too many open files", "raise the limit (ulimit -n)"),
    E.ENFILE: ("too many open files on this machine", "close some programs or raise fs.file-max"),
    E.EFBIG: ("the file is too large for this file system", "choose a directory on another file system"),
    E.EEXIST: ("it already exists", "remove it or choose another name"),
    E.EXDEV: ("it is on another file system", "keep both paths on one file system"),
    E.ENXIO: ("no such device", "check the path"),
    E.ENODEV: ("no such device", "check the path"),
    E.EBUSY: ("the device or resource is busy", "try again later"),
    E.ETXTBSY: ("the file is busy", "try again later"),
    E.ENOTEMPTY: ("the directory is not empty", "give a new or empty directory"),
    E.EINVAL: ("the file system refused the operation (invalid argument)", "choose another file system"),
}


class DiskError(UserError):
    """A file-system operation that failed, said in one line: the path, what was being done, why
    and what to do. `errno` is the OSError's (None when the path is not a regular file)."""

    def __init__(self, message: str, path: str | Path, errno: int | None = None):
        super().__init__(message)
        self.path = Path(path)
        self.errno = errno


def describe(exc: OSError, path: str | Path, doing: str) -> str:
    """The one line for an OSError on `path` while `doing` (e.g. "converting experts")."""
    code = exc.errno
    reason, advice = _REASONS.get(code, (exc.strerror or str(exc), "check the path and the disk"))
    if code in (E.ENOSPC, E.EDQUOT):
        free = free_bytes(path)
        if free is not None:
            reason += f" ({gb(free)} free)"
    elif code == E.ENOTDIR and (blocker := _file_in_path(path)) is not None:
        reason = f"{blocker} is a file, not a directory"
    elif code == E.EEXIST and os.path.islink(path) and not os.path.exists(path):
        reason = "a symbolic link to a missing file is in the way"
    return f"{path}: {reason} while {doing}: {advice}"


def _file_in_path(path: str | Path) -> Path | None:
    """The first ancestor of `path` that exists and is not a folder."""
    for parent in reversed(Path(os.path.abspath(path)).parents):
        if os.path.exists(parent) and not os.path.isdir(parent):
            return parent
    return None


def error(exc: OSError | DiskError, path: str | Path, doing: str) -> DiskError:
    """`exc` as a DiskError (a DiskError passes through)."""
    if isinstance(exc, DiskError):
        return exc
    return DiskError(describe(exc, path, doing), path, exc.errno)


def gb(n: int) -> str:
    """Bytes for people: '3.1 GB', '420 MB', '12 kB'."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


# --- the fault seam ---------------------------------------------------------------------------

OPS = ("open", "read", "direct_read", "write", "fsync", "rename", "mkdir")


@dataclass
class Fault:
    op: str  # one of OPS
    under: Path  # paths at or below this one fail
    errno: int
    after: int = 0  # let this many matching operations succeed first
    hits: int = 0  # matching operations so far (the ones that failed included)


_faults: list[Fault] = []
_faults_lock = threading.Lock()


@contextlib.contextmanager
def inject(op: str, under: str | Path, errno: int, after: int = 0) -> Iterator[Fault]:
    """Make `op` fail with `errno` for every path at or below `under` while the block runs
    (after `after` successful ones). For tests of faults a real disk cannot be made to give."""
    if op not in OPS:
        raise ValueError(f"unknown file-system operation {op!r}; choose from {', '.join(OPS)}")
    fault = Fault(op, Path(os.path.abspath(under)), errno, after)
    with _faults_lock:
        _faults.append(fault)
    try:
        yield fault
    finally:
        with _faults_lock:
            _faults.remove(fault)


def _check_fault(op: str, path: str | Path) -> None:
    if not _faults:
        return
    where = Path(os.path.abspath(path))
    with _faults_lock:
        for f in _faults:
            if f.op == op and (where == f.under or f.under in where.parents):
                f.hits += 1
                if f.hits > f.after:
                    raise OSError(f.errno, os.strerror(f.errno), str(path))


# --- opening and reading ------------------------------------------------------------------------


def kind_of(mode: int) -> str | None:
    """What a non-regular file is ("a FIFO", "a directory", ...); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    kinds += [(stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


class NotRegular(DiskError):
    """The path is a directory, FIFO, socket or device where a regular file belongs (`kind` says
    which); nothing was opened."""

    def __init__(self, path: str | Path, kind: str, doing: str):
        super().__init__(f"{path} is {kind}, not a regular file (refused while {doing})", path)
        self.kind = kind


def require_regular(path: str | Path, mode: int, doing: str) -> None:
    if (kind := kind_of(mode)) is not None:
        raise NotRegular(path, kind, doing)


def open_regular(path: str | Path, flags: int = os.O_RDONLY, doing: str = "reading it") -> int:
    """os.open for an existing regular file only: refused from its stat before any open (a FIFO
    would block a reader), opened without blocking, and checked again once open (replaced in
    between). DiskError, one line, for anything else; `.errno` ENOENT when it does not exist."""
    path = Path(path)
    try:
        _check_fault("open", path)
        require_regular(path, os.stat(path).st_mode, doing)
        fd = os.open(path, flags | O_NONBLOCK | O_CLOEXEC)
    except OSError as exc:
        raise error(exc, path, doing) from None
    try:
        require_regular(path, os.fstat(fd).st_mode, doing)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread(fd: int, n: int, offset: int, path: str | Path, doing: str) -> bytes:
    """Up to n bytes at offset (fewer only at the end of the file)."""
    parts, got = [], 0
    try:
        _check_fault("read", path)
        while got < n:
            part = os.pread(fd, n - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
    except OSError as exc:
        raise error(exc, path, doing) from None
    return b"".join(parts)


def preadv(
    fd: int, buffer, offset: int, path: str | Path, doing: str, stop_at: int = 0, direct: bool = False
) -> int:
    """Fill `buffer` (a writable buffer) from offset; the byte count (fewer at the end of the
    file). With `stop_at`, a read that ends off a multiple of it is the end (O_DIRECT could not
    go on from there). `direct`: fd is open with O_DIRECT (a fault of its own: "direct_read")."""
    view, got = memoryview(buffer), 0
    try:
        _check_fault("direct_read" if direct else "read", path)
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            got += n
            if n == 0 or (stop_at and got % stop_at):
                break
    except OSError as exc:
        raise error(exc, path, doing) from None
    return got


def read_bounded(path: str | Path, limit: int, doing: str) -> bytes:
    """The whole of a regular file of at most `limit` bytes (DiskError, errno EFBIG, if larger)."""
    fd = open_regular(path, os.O_RDONLY, doing)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise DiskError(
                f"{path} is {size} bytes, more than the {limit} it can be while {doing}: it is "
                "damaged or not what it should be; remove or replace it",
                path,
                E.EFBIG,
            )
        data = pread(fd, limit + 1, 0, path, doing)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew since the stat
        raise DiskError(f"{path} grew past {limit} bytes while {doing}", path, E.EFBIG)
    return data


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """How deeply JSON text nests (arrays and objects), counted without parsing it."""
    depth = deepest = 0
    for b in _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def load_json(raw: bytes, max_depth: int) -> object:
    """JSON text nested at most `max_depth` deep, parsed; ValueError (one line) otherwise.
    The depth is checked before parsing, so no nesting reaches the parser's recursion."""
    if (depth := json_depth(raw)) > max_depth:
        raise ValueError(f"nested {depth} levels deep (at most {max_depth} is valid)")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"not JSON text ({exc})") from None


# --- writing ------------------------------------------------------------------------------------


def pwrite_all(fd: int, data, offset: int, path: str | Path, doing: str) -> None:
    view = memoryview(data).cast("B")
    try:
        _check_fault("write", path)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as exc:
        raise error(exc, path, doing) from None


def sync(fd: int, path: str | Path, doing: str) -> None:
    """Make fd's data durable (F_FULLFSYNC on macOS: its fsync leaves the drive's cache)."""
    try:
        _check_fault("fsync", path)
        if fcntl is not None and hasattr(fcntl, "F_FULLFSYNC"):  # pragma: no cover - macOS
            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return
            except OSError:
                pass  # not every file system takes it: fsync
        os.fsync(fd)
    except OSError as exc:
        raise error(exc, path, doing) from None


def sync_dir(directory: str | Path) -> None:
    """fsync a folder (a rename in it is durable after this); quiet where folders cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_name(path: Path, tag: str = "tmp") -> Path:
    """A hidden name beside `path` for a file being written: .NAME.<random>.<tag>."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.{tag}")


def remove(path: str | Path) -> None:
    """Remove a file or a folder tree we wrote; quiet when it is gone (cleanup on failure paths)."""
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def create_new(path: str | Path, doing: str, mode: int = 0o644) -> int:
    """Create a file that must not exist (O_EXCL: never follows a link someone left there)."""
    try:
        _check_fault("open", path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, mode)
    except OSError as exc:
        raise error(exc, path, doing) from None


def rename(src: str | Path, dst: str | Path, doing: str, replace: bool = True) -> None:
    """Give `src` the name `dst` (replacing it, or FileExistsError-free refusal: DiskError with
    errno EEXIST when `replace` is False and `dst` exists), then fsync the folder."""
    dst = Path(dst)
    try:
        _check_fault("rename", dst)
        if replace:
            os.replace(src, dst)
        else:
            link_or_rename(src, dst)
    except OSError as exc:
        raise error(exc, dst, doing) from None
    sync_dir(dst.parent)


def link_or_rename(src: str | Path, dst: str | Path) -> None:
    """Give src the name dst, failing with FileExistsError rather than replace an existing dst."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as exc:  # no hard links here: check, then rename (a narrow race, but no data lost)
        if exc.errno not in (E.EPERM, E.EOPNOTSUPP, E.EXDEV, E.EMLINK, E.ENOTSUP):
            raise
        if os.path.lexists(dst):
            raise FileExistsError(E.EEXIST, "file exists", str(dst)) from None
        os.rename(src, dst)
        return
    os.unlink(src)


def make_dirs(directory: str | Path, doing: str, mode: int = 0o755) -> Path:
    """Create a folder and its parents (an existing folder is fine; a file in its place is not)."""
    directory = Path(directory)
    try:
        _check_fault("mkdir", directory)
        directory.mkdir(parents=True, exist_ok=True, mode=mode)
    except FileExistsError:  # a file (or a dangling link) where the folder belongs
        raise DiskError(
            f"{directory} exists and is not a directory, so it cannot hold files while {doing}: "
            "remove it or choose another directory",
            directory,
            E.EEXIST,
        ) from None
    except OSError as exc:
        raise error(exc, directory, doing) from None
    return directory


def missing_parents(path: str | Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first (what make_dirs would create)."""
    out, p = [], Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_empty(folders: list[Path]) -> None:
    """Remove these folders, deepest first, while they are empty (a failed write's own folders)."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


class Publish:
    """A new file at `path`, written under a temporary name beside it and renamed onto it once
    complete and durable (fsync the file, rename, fsync the folder). Any failure, or an
    exception inside the block, removes the temporary file and leaves `path` as it was. Errors
    name `path`, never the temporary name.

        with Publish(path, "saving the manifest") as out:
            out.write(data)
    """

    def __init__(self, path: str | Path, doing: str, *, replace: bool = True, mode: int = 0o644):
        self.path = Path(path)
        self.doing = doing
        self.replace = replace
        self.mode = mode
        self.tmp = temp_name(self.path)
        self.fd: int | None = None
        self.size = 0  # bytes written by `write` (the next offset)

    def __enter__(self) -> Publish:
        try:
            self.fd = create_new(self.tmp, self.doing, self.mode)
        except DiskError as exc:
            raise naming(exc, self.tmp, self.path) from None
        return self

    def write(self, data) -> None:
        self.pwrite(data, self.size)
        self.size += memoryview(data).nbytes

    def pwrite(self, data, offset: int) -> None:
        """Write at `offset`; a failure removes the temporary file (nothing more can be written)."""
        try:
            pwrite_all(self._fd(), data, offset, self.tmp, self.doing)
        except DiskError as exc:
            self.abort()
            raise naming(exc, self.tmp, self.path) from None

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"{self.path}: not open for writing")
        return self.fd

    def commit(self) -> None:
        """fsync, close and rename into place (what leaving the block without an error does)."""
        self.close()
        self.place()

    def close(self) -> None:
        """fsync and close the temporary file (complete and durable, not yet at `path`)."""
        try:
            sync(self._fd(), self.tmp, self.doing)
            self._close()
        except DiskError as exc:
            self.abort()
            raise naming(exc, self.tmp, self.path) from None
        except BaseException:
            self.abort()
            raise

    def place(self) -> None:
        """Rename the closed temporary file onto `path` and fsync the folder."""
        try:
            rename(self.tmp, self.path, self.doing, replace=self.replace)
        except DiskError as exc:
            self.abort()
            raise naming(exc, self.tmp, self.path) from None

    def abort(self) -> None:
        self._close()
        remove(self.tmp)

    def _close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            if isinstance(exc, OSError):
                raise naming(error(exc, self.tmp, self.doing), self.tmp, self.path) from None
            return
        self.commit()


def naming(exc: DiskError, tmp: str | Path, path: str | Path) -> DiskError:
    """The same error, naming the file being written instead of its temporary name."""
    text = str(exc).replace(str(tmp), str(path))
    return DiskError(text, path, exc.errno)


def write_atomic(path: str | Path, data: bytes, doing: str, mode: int = 0o644) -> None:
    """`path` holds `data` on return, durably; on any failure it holds what it held before."""
    with Publish(path, doing, mode=mode) as out:
        out.write(data)


class PublishDir:
    """A new folder at `path`, filled under a temporary name beside it and renamed onto it last
    (an empty folder already at `path` is replaced). On any failure the temporary folder and
    everything in it is removed and `path` is left as it was.

        with PublishDir(out, "converting the model") as tmp:
            ...write files into tmp...
    """

    def __init__(self, path: str | Path, doing: str):
        self.path = Path(path)
        self.doing = doing
        self.tmp = temp_name(self.path, "partial")
        self._made: list[Path] = []  # parents it created (taken back on failure)

    def __enter__(self) -> Path:
        self._made = missing_parents(self.path.parent)
        make_dirs(self.path.parent, self.doing)
        try:
            _check_fault("mkdir", self.tmp)
            os.mkdir(self.tmp, 0o755)
        except OSError as exc:
            remove_empty(self._made)
            raise naming(error(exc, self.tmp, self.doing), self.tmp, self.path) from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            remove(self.tmp)
            remove_empty(self._made)
            if isinstance(exc, OSError):
                raise naming(error(exc, self.tmp, self.doing), self.tmp, self.path) from None
            if isinstance(exc, DiskError):  # name the folder asked for, not the temporary one
                raise naming(exc, self.tmp, self.path) from None
            return
        try:
            for entry in os.scandir(self.tmp):  # every file durable before the folder appears
                if entry.is_file(follow_symlinks=False):
                    fd = os.open(entry.path, os.O_RDONLY | O_CLOEXEC)
                    try:
                        sync(fd, entry.path, self.doing)
                    finally:
                        os.close(fd)
            sync_dir(self.tmp)
            rename(self.tmp, self.path, self.doing)  # replaces an empty folder, else ENOTEMPTY
        except (OSError, DiskError) as exc:
            remove(self.tmp)
            remove_empty(self._made)
            raise naming(error(exc, self.tmp, self.doing), self.tmp, self.path) from None
        except BaseException:
            remove(self.tmp)
            remove_empty(self._made)
            raise


# --- space ----------------------------------------------------------------------------------------


def existing_parent(path: str | Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a new file's bytes would go)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still put on the file system holding `path` (None if unknown)."""
    try:
        st = os.statvfs(existing_parent(path))
    except (OSError, AttributeError):
        return None
    if st.f_blocks == 0:  # a pseudo file system (/proc, /sys): its writes fail on their own terms
        return None
    return st.f_bavail * st.f_frsize


# Room left beside a long write (an eighth of it, at most this): the file system's own
# bookkeeping, and the rest of the machine.
SPACE_MARGIN = 64 << 20


def check_space(directory: str | Path, need: int, doing: str, *, freed: int = 0) -> None:
    """DiskError up front unless the file system holding `directory` has room for `need` more
    bytes (less `freed`, bytes the write will replace) and a margin."""
    free = free_bytes(directory)
    if free is None:
        return
    if need - freed + min(SPACE_MARGIN, need // 8) > free:
        where = existing_parent(directory)
        raise DiskError(
            f"not enough space on {where} for {doing}: {gb(need)} needed, {gb(free)} free: free some "
            "space or choose a directory on another disk",
            directory,
            E.ENOSPC,
        )
