"""Helpers of the disk tests: fill a file system, list what a failure left, run `latentkv` and
hold its refusal to the rules (one line, no traceback, no hang)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import latentkv


def fill(directory: Path) -> Path:
    """Fill the file system under `directory` to the last byte (a ballast file; returns it)."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    probe = directory / ".probe"
    try:
        probe.write_bytes(b"x")
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    else:
        raise AssertionError(f"{directory} is not full")
    finally:
        probe.unlink(missing_ok=True)
    return ballast


@dataclass
class Outcome:
    code: int
    out: str
    err: str

    def refused(self, *words: str) -> str:
        """Assert a refusal by the rules: exit 1 or 2, no traceback, the last stderr line is the
        one error line and names each of `words`; returns that line."""
        assert self.code in (1, 2), (self.code, self.err[-2000:])
        assert "Traceback" not in self.err, self.err[-3000:]
        lines = [line for line in self.err.splitlines() if line.strip()]
        errors = [line for line in lines if ": error: " in line]
        assert len(errors) == 1 and lines[-1] == errors[0], self.err[-2000:]
        for word in words:
            assert word in errors[0], (word, errors[0])
        return errors[0]


def latentkv_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Outcome:
    """`latentkv ARGS` in a child process (a hang is a failure, not a stuck test)."""
    src = str(Path(latentkv.__file__).parents[1])
    full_env = {**os.environ, "PYTHONPATH": src, **(env or {})}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "latentkv", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"latentkv {' '.join(args)} hung for {timeout} s") from exc
    return Outcome(done.returncode, done.stdout, done.stderr)


def leftovers(directory: Path) -> list[str]:
    """Every file and folder under `directory` (what a failure must not leave)."""
    if not directory.exists():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
