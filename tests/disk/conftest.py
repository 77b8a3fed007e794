"""Real faults for the disk tests: a small tmpfs (ENOSPC), a read-only bind mount (EROFS), and a
way to run `latentkv` and hold it to the rules (one line, no traceback, no hang).

Mounting needs root (CI runs as root): without it those tests skip, saying why. Every mount is
undone when its test ends, failed or not.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faults import Outcome, latentkv_cli


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60)


def _mount(*args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a file system for a real fault (CI runs as root)")
    done = _run("mount", *args)
    if done.returncode:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


def _umount(path: Path) -> None:
    if _run("umount", str(path)).returncode:
        _run("umount", "-l", str(path))  # busy: detach now, gone when the last user goes


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """size in bytes -> a folder on a tmpfs of that size (ENOSPC once it is full)."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d))
        mounted.append(d)
        return d

    try:
        yield make
    finally:
        for d in reversed(mounted):
            _umount(d)


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """folder -> a read-only view of it (EROFS for any write there)."""
    mounted: list[Path] = []

    def make(source: Path) -> Path:
        d = tmp_path / f"ro{len(mounted)}"
        d.mkdir()
        _mount("--bind", str(source), str(d))
        mounted.append(d)
        _mount("-o", "remount,bind,ro", str(d))
        return d

    try:
        yield make
    finally:
        for d in reversed(mounted):
            _umount(d)


@pytest.fixture
def cli() -> Callable[..., Outcome]:
    return latentkv_cli


@pytest.fixture
def inproc(capsys, monkeypatch) -> Callable[..., Outcome]:
    """`latentkv ARGS` in this process (no interpreter start; faults injected here reach it)."""
    from latentkv.cli import main

    def run(*args: str, env: dict[str, str] | None = None) -> Outcome:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = main(list(args))
        got = capsys.readouterr()
        return Outcome(code, got.out, got.err)

    return run
