"""Run a command under a real memory limit: a child memory cgroup (v2 `memory.max` or v1
`memory.limit_in_bytes`, both of which count page cache), swap off for it, and read back its
peak usage and OOM kills. Needs root (or a delegated cgroup); `unavailable()` says why not.

Used by `benchmarks/experts.py` and the memory-limit test of the streamed store.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")


@dataclass
class LimitedRun:
    returncode: int
    peak_bytes: int  # the cgroup's peak usage (process memory + page cache it touched)
    oom_kills: int
    stdout: str
    stderr: str
    seconds: float


def _own_cgroup(controller_line: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if controller_line == "v2" and hid == "0" and controllers == "":
            return path
        if controller_line in controllers.split(","):
            return path
    raise OSError("this process is in no such cgroup")


def _parent() -> tuple[Path, int]:
    """(a folder where a child cgroup can be made, cgroup version)."""
    if (V2_ROOT / "cgroup.controllers").exists():
        parent = V2_ROOT / _own_cgroup("v2").lstrip("/")
        if "memory" in (parent / "cgroup.controllers").read_text().split():
            return parent, 2
        raise OSError(f"the memory controller is not enabled in {parent}")
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return V1_ROOT / _own_cgroup("memory").lstrip("/"), 1
    raise OSError("no cgroup v2 memory controller and no cgroup v1 memory hierarchy")


def unavailable() -> str | None:
    """Why a memory limit cannot be set here, or None when it can."""
    try:
        parent, _version = _parent()
        probe = parent / f"lkv-probe-{secrets.token_hex(3)}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create a memory cgroup here ({exc})"
    return None


class MemoryCgroup:
    """A child memory cgroup with a byte limit; removed on close."""

    def __init__(self, limit_bytes: int):
        parent, self.version = _parent()
        self.path = parent / f"latentkv-{os.getpid()}-{secrets.token_hex(3)}"
        self.path.mkdir()
        try:
            if self.version == 2:
                (self.path / "memory.max").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):
                    (self.path / "memory.swappiness").write_text("0")
                with contextlib.suppress(OSError):
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except BaseException:
            self.close()
            raise

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return -1

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def close(self) -> None:
        for _ in range(50):  # the last process may take a moment to leave
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def run_limited(
    cmd: list[str], limit_bytes: int, timeout: float = 600, env: dict | None = None
) -> LimitedRun:
    """Run `cmd` inside a fresh cgroup limited to `limit_bytes`; its peak usage and OOM kills."""
    group = MemoryCgroup(limit_bytes)
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: group.add(os.getpid()),  # joins before exec: everything is counted
        )
        out, err = proc.communicate(timeout=timeout)
        return LimitedRun(
            proc.returncode, group.peak(), group.oom_kills(), out, err, time.perf_counter() - t0
        )
    finally:
        group.close()


def drop_page_cache() -> None:
    """Write back dirty pages and drop the clean page cache (root), so the next run reads cold."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
