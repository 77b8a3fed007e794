"""latentkv.fs, the one way to touch the file system: each rule against a real fault where the
machine gives one (a full tmpfs, a read-only mount, FIFOs, folders and links where files
belong), and the fault seam for the rest (EIO)."""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

import pytest
from faults import fill, leftovers

from latentkv import fs


def _opens_within(path: Path, seconds: float = 10.0):
    """fs.open_regular(path) on a thread: (raised exception or fd, finished in time)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_catch(lambda: fs.open_regular(path, os.O_RDONLY))))
    t.daemon = True
    t.start()
    t.join(seconds)
    return (out[0] if out else None), not t.is_alive()


def _catch(f):
    try:
        return f()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc


@pytest.mark.parametrize("kind", ["fifo", "folder", "socket", "device"])
def test_only_regular_files_open_and_a_fifo_never_hangs(tmp_path, kind):
    path = tmp_path / "thing"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
    else:
        path = Path("/dev/null")
    got, finished = _opens_within(path)
    assert finished, "open_regular blocked"
    assert isinstance(got, fs.DiskError), got
    words = {"fifo": "a FIFO", "folder": "a directory", "socket": "a socket", "device": "a character device"}
    assert str(got).startswith(f"{path} is {words[kind]}, not a regular file") and "\n" not in str(got)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: d / "missing", "no such file or directory"),
        (
            lambda d: [(d / "file").write_bytes(b"x"), d / "file" / "below"][1],
            "/file is a file, not a directory",
        ),
        (lambda d: os.symlink(d / "nowhere", d / "dangling") or d / "dangling", "no such file or directory"),
        (
            lambda d: (os.symlink(d / "b", d / "a"), os.symlink(d / "a", d / "b")) and d / "a",
            "symbolic links",
        ),
    ],
    ids=["missing", "under-a-file", "dangling-link", "link-loop"],
)
def test_a_path_that_cannot_be_opened_is_one_line_naming_it(tmp_path, make, reason):
    path = make(tmp_path)
    with pytest.raises(fs.DiskError) as info:
        fs.open_regular(path, os.O_RDONLY, "reading the manifest")
    text = str(info.value)
    assert text.startswith(f"{path}: ") and reason in text and "while reading the manifest" in text


def test_a_full_disk_is_named_with_its_free_space_and_leaves_no_temporary_file(small_disk):
    d = small_disk(256 << 10)
    with pytest.raises(fs.DiskError) as info:
        fs.write_atomic(d / "big.bin", b"\1" * (512 << 10), "saving a test file")
    assert info.value.errno == errno.ENOSPC
    text = str(info.value)
    assert text.startswith(f"{d / 'big.bin'}: no space left on the device (")  # the target, not the temp
    assert "free) while saving a test file: free some space" in text
    assert leftovers(d) == []


def test_a_publish_that_fails_keeps_the_old_file(small_disk):
    d = small_disk(1 << 20)
    target = d / "state.json"
    fs.write_atomic(target, b"old", "saving")
    ballast = fill(d)
    with pytest.raises(fs.DiskError, match="no space left"):
        fs.write_atomic(target, b"new" * 10000, "saving")
    assert target.read_bytes() == b"old" and leftovers(d) == sorted(["ballast", "state.json"])
    ballast.unlink()
    fs.write_atomic(target, b"new", "saving")
    assert target.read_bytes() == b"new" and leftovers(d) == ["state.json"]


def test_a_read_only_file_system_is_said_so(tmp_path, read_only):
    src = tmp_path / "src"
    src.mkdir()
    (src / "kept").write_bytes(b"1")
    ro = read_only(src)
    with pytest.raises(fs.DiskError) as info:
        fs.write_atomic(ro / "new", b"x", "writing the expert store")
    assert info.value.errno == errno.EROFS
    assert "the file system is read-only while writing the expert store: choose a directory" in str(
        info.value
    )
    with (
        pytest.raises(fs.DiskError, match="read-only"),
        fs.PublishDir(ro / "out", "converting the model") as tmp,
    ):
        (tmp / "x").write_bytes(b"1")  # never reached
    assert leftovers(src) == ["kept"]


def test_a_new_folder_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), fs.PublishDir(out, "converting") as tmp:
        (tmp / "a").write_bytes(b"1")
        raise RuntimeError("interrupted")
    assert leftovers(tmp_path) == []
    out.mkdir()  # an empty folder already there is replaced
    with fs.PublishDir(out, "converting") as tmp:
        (tmp / "a").write_bytes(b"1")
    assert leftovers(tmp_path) == ["out", "out/a"]
    with pytest.raises(fs.DiskError, match="not empty"), fs.PublishDir(out, "converting") as tmp:
        (tmp / "b").write_bytes(b"2")
    assert leftovers(tmp_path) == ["out", "out/a"]


def test_a_file_where_a_folder_belongs(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(fs.DiskError, match="exists and is not a directory"):
        fs.make_dirs(tmp_path / "f", "creating the cache")
    with pytest.raises(fs.DiskError, match="/f is a file, not a directory while creating the cache"):
        fs.make_dirs(tmp_path / "f" / "sub", "creating the cache")


def test_space_is_checked_before_a_long_write(small_disk):
    d = small_disk(4 << 20)
    free = fs.free_bytes(d)
    assert 0 < free <= 4 << 20
    fs.check_space(d / "new" / "deeper", free // 2, "a write that fits")
    with pytest.raises(fs.DiskError) as info:
        fs.check_space(d / "new", 3 << 30, "converting experts")
    text = str(info.value)
    assert text.startswith(f"not enough space on {d} for converting experts: 3.2 GB needed, ")
    assert info.value.errno == errno.ENOSPC


def test_the_fault_seam_gives_an_io_error_once_the_others_pass(tmp_path):
    path = tmp_path / "data"
    fs.write_atomic(path, b"abcdef", "writing")
    fd = fs.open_regular(path)
    try:
        with fs.inject("read", tmp_path, errno.EIO, after=1) as fault:
            assert fs.pread(fd, 3, 0, path, "reading") == b"abc"
            with pytest.raises(fs.DiskError) as info:
                fs.pread(fd, 3, 3, path, "reading the expert store")
        assert fault.hits == 2
        assert "input/output error (the disk or the file system is failing)" in str(info.value)
        assert fs.pread(fd, 3, 3, path, "reading") == b"def"  # the seam is gone with its block
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="unknown file-system operation"), fs.inject("nap", tmp_path, 5):
        pass


def test_json_nesting_is_bounded_before_parsing():
    deep = b"[" * 100_000 + b"]" * 100_000
    assert fs.json_depth(deep) == 100_000
    with pytest.raises(ValueError, match="nested 100000 levels deep"):
        fs.load_json(deep, 16)
    tricky = b'{"a": "[[[[{{{{\\"", "b": [[1]]}'  # brackets inside strings do not count
    assert fs.json_depth(tricky) == 3 and fs.load_json(tricky, 3) == {"a": '[[[[{{{{"', "b": [[1]]}
    with pytest.raises(ValueError, match="not JSON"):
        fs.load_json(b"\xff\xfe", 4)


def test_a_file_past_its_size_bound_is_not_read(tmp_path):
    path = tmp_path / "manifest.json"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that costs nothing
    with pytest.raises(fs.DiskError, match="more than the 1024 it can be"):
        fs.read_bounded(path, 1024, "reading the manifest")
