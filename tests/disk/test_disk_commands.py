"""Every command that writes, against a disk that misbehaves: `convert`, `experts convert`, the first
`--ram-gb` run (which converts the experts into the cache), sessions and KV files. Each fault is
real where the machine gives one (a full tmpfs, a read-only bind mount, a file or /proc where a
folder belongs) and comes through `latentkv.fs.inject` otherwise (the disk filling up in the
middle of a write, EIO). Each gets one line and exit 2, and leaves nothing behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from faults import fill, leftovers

from latentkv import fs

MODEL = "builtin:fixture"


# --- convert ------------------------------------------------------------------------------------


def test_convert_into_a_folder_under_a_file(inproc, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    got = inproc("convert", MODEL, str(tmp_path / "file" / "out"), "--weight-dtype", "int4", "--json")
    got.refused(f"{tmp_path / 'file'} exists and is not a directory")
    assert leftovers(tmp_path) == ["file"]


def test_convert_into_proc(inproc):
    inproc("convert", MODEL, "/proc/latentkv-out", "--weight-dtype", "int4", "--json").refused(
        "/proc/latentkv-out: no such file or directory while converting the model"
    )


def test_convert_onto_a_full_disk_is_refused_up_front(inproc, small_disk):
    disk = small_disk(8 << 20)
    got = inproc("convert", MODEL, str(disk / "out"), "--weight-dtype", "int4", "--json")
    got.refused(f"not enough space on {disk} for converting the model", "MB needed", "MB free")
    assert leftovers(disk) == []


def test_convert_onto_a_read_only_disk(inproc, tmp_path, read_only):
    (tmp_path / "src").mkdir()
    ro = read_only(tmp_path / "src")
    got = inproc("convert", MODEL, str(ro / "out"), "--weight-dtype", "int4", "--json")
    got.refused(f"{ro / 'out'}: the file system is read-only while converting the model")
    assert leftovers(tmp_path / "src") == []


@pytest.mark.parametrize("after", [0, 40])
def test_convert_when_the_disk_fills_midway_leaves_nothing(inproc, tmp_path, after):
    out = tmp_path / "out"
    with fs.inject("write", tmp_path, errno.ENOSPC, after=after) as fault:
        got = inproc("convert", MODEL, str(out), "--weight-dtype", "int8", "--json")
    assert fault.hits > after
    got.refused(f"{out}", "no space left on the device", "while converting the model")
    assert leftovers(tmp_path) == []  # neither model.data.tmp nor the half-made folder


# --- experts convert ----------------------------------------------------------------------------


def test_experts_convert_onto_a_full_disk(inproc, small_disk):
    disk = small_disk(4 << 20)
    got = inproc("experts", "convert", MODEL, "--out", str(disk / "experts"))
    got.refused(f"not enough space on {disk / 'experts'} for writing the expert store (18.9 MB)")
    assert leftovers(disk) == []


def test_experts_convert_onto_a_read_only_disk(inproc, tmp_path, read_only):
    (tmp_path / "src").mkdir()
    ro = read_only(tmp_path / "src")
    inproc("experts", "convert", MODEL, "--out", str(ro / "experts")).refused(
        f"{ro / 'experts'}: the file system is read-only while writing the expert store"
    )


def test_experts_convert_when_the_disk_fills_midway_keeps_the_old_store(inproc, tmp_path):
    store = tmp_path / "experts"
    assert inproc("experts", "convert", MODEL, "--out", str(store)).code == 0
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    with fs.inject("write", store, errno.ENOSPC, after=20):
        got = inproc("experts", "convert", MODEL, "--out", str(store), "--force")
    got.refused("layer-0", "no space left on the device", "while writing the expert store")
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before  # whole, no temporary files
    assert inproc("experts", "verify", str(store)).code == 0


# --- the first --ram-gb run converts the experts into the cache ---------------------------------


def _generate_streamed(inproc, cache: Path, *more: str):
    flags = ("--prompt-ids", "1,2,3", "--max-tokens", "2", "--ram-gb", "1", *more)
    return inproc("generate", MODEL, *flags, env={"LATENTKV_CACHE": str(cache)})


def test_first_ram_gb_run_with_a_read_only_cache(inproc, tmp_path, read_only):
    (tmp_path / "src").mkdir()
    ro = read_only(tmp_path / "src")
    _generate_streamed(inproc, ro / "cache").refused("read-only", "set LATENTKV_CACHE to a directory")


def test_first_ram_gb_run_with_a_full_cache(inproc, small_disk):
    disk = small_disk(2 << 20)
    _generate_streamed(inproc, disk / "cache").refused(
        f"not enough space on {disk / 'cache' / 'experts'}",
        "for writing the expert store",
        "set LATENTKV_CACHE",
    )
    assert leftovers(disk) == []


def test_first_ram_gb_run_with_a_file_where_the_cache_belongs(inproc, tmp_path):
    (tmp_path / "cache").write_bytes(b"not a folder")
    _generate_streamed(inproc, tmp_path / "cache").refused(
        f"{tmp_path / 'cache'} is a file, not a directory", "LATENTKV_CACHE"
    )


def test_first_ram_gb_run_with_a_cache_it_may_not_write(inproc, tmp_path):
    """(As root every folder is writable: the refusal comes through fs's seam.)"""
    with fs.inject("mkdir", tmp_path / "cache", errno.EACCES):
        _generate_streamed(inproc, tmp_path / "cache").refused(
            "permission denied", "set LATENTKV_CACHE to a directory"
        )
    assert not (tmp_path / "cache").exists()


# --- sessions and KV files ----------------------------------------------------------------------


def _turn(inproc, kv_dir: Path, prompt: str, *more: str):
    flags = ("--prompt-ids", prompt, "--max-tokens", "3", "--session", "s", "--kv-dir", str(kv_dir))
    return inproc("generate", MODEL, *flags, *more)


def _saved(path: Path) -> list[int]:
    from latentkv.kv.store import KVFile

    with KVFile.open(path) as f:
        return f.load().tokens


def test_a_turn_on_a_full_disk_keeps_the_last_commit(inproc, small_disk):
    kv = small_disk(512 << 10)
    assert _turn(inproc, kv, "1,2,3").code == 0
    saved = _saved(kv / "s.kv")
    ballast = fill(kv)
    got = _turn(inproc, kv, ",".join(map(str, saved + list(range(1, 60)))))  # the next turn
    got.refused(
        "session 's': saving failed", "no space left on the device", f"last commit ({len(saved)} records)"
    )
    ballast.unlink()
    assert _saved(kv / "s.kv") == saved and leftovers(kv) == ["s.kv"]


def test_a_tier_change_on_a_full_disk_leaves_the_old_file(inproc, small_disk):
    kv = small_disk(512 << 10)
    assert _turn(inproc, kv, ",".join(map(str, range(1, 30)))).code == 0  # f32 records
    before = (kv / "s.kv").read_bytes()
    ballast = fill(kv)
    got = _turn(
        inproc, kv, ",".join(map(str, range(1, 30))), "--kv-cache-dtype", "tq4"
    )  # re-encoded, rewritten
    got.refused("session 's': saving failed: not enough space", "for rewriting the KV file s.kv")
    assert "rewrite" not in got.err.split(": error: ")[1].split(" ")[0]  # names the file, not its temp
    ballast.unlink()
    assert (kv / "s.kv").read_bytes() == before and leftovers(kv) == ["s.kv"]


def test_a_kv_file_on_a_failing_disk(inproc, tmp_path):
    assert _turn(inproc, tmp_path, "1,2,3").code == 0
    saved = _saved(tmp_path / "s.kv")
    with fs.inject("fsync", tmp_path, errno.EIO):
        got = _turn(inproc, tmp_path, ",".join(map(str, [*saved, 9, 9, 9])))
    got.refused("input/output error", f"last commit ({len(saved)} records)")
    assert _saved(tmp_path / "s.kv") == saved


def test_a_session_on_a_read_only_disk(inproc, tmp_path, read_only):
    (tmp_path / "src").mkdir()
    ro = read_only(tmp_path / "src")
    _turn(inproc, ro, "1,2,3").refused(f"{ro / 's.kv'}: the file system is read-only")


def test_a_dangling_link_where_the_session_file_belongs(inproc, tmp_path):
    (tmp_path / "s.kv").symlink_to(tmp_path / "gone.kv")
    line = _turn(inproc, tmp_path, "1,2,3").refused(f"{tmp_path / 's.kv'} is a symbolic link to")
    assert ".tmp" not in line
    assert leftovers(tmp_path) == ["s.kv"]


# --- numbers that size memory -------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "1e308", "1e999", "nan", "-1", "0"])
@pytest.mark.parametrize("command", ["generate", "plan", "kv-stats"])
def test_ram_gb_out_of_range_is_one_line(inproc, command, value):
    args = {
        "generate": ("generate", MODEL, "--prompt-ids", "1", "--ram-gb", value),
        "plan": ("plan", MODEL, "--ram-gb", value),
        "kv-stats": ("kv", "stats", "--kv-cache-dtype", "tq4", "--ram-gb", value),
    }[command]
    assert inproc(*args).refused("--ram-gb must be a number above 0") and True


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--kv-recent-window", str(2**63), "--kv-recent-window must be an integer from 0 to"),
        ("--kv-group-size", str(2**63), "--kv-group-size must be an integer from 1 to"),
        ("--max-tokens", str(2**63), "--max-tokens must be an integer from 0 to"),
        ("--max-tokens", "1022", "maximum context length is 1024 tokens; the request needs 1025"),
    ],
)
def test_token_counts_beyond_reason_are_one_line(inproc, flag, value, says):
    tier = ("--kv-cache-dtype", "tq4") if flag == "--kv-group-size" else ()
    inproc("generate", MODEL, "--prompt-ids", "1,2,3", *tier, flag, value).refused(says)
