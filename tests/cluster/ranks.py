"""Start the ranks of a cluster on this machine as torchrun would (torch's env:// variables),
each a process of its own, and never wait on one without a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank: int, world: int, port: int, cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LATENTKV_CACHE=str(cache),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("LATENTKV_CLUSTER_SECRET", None)
    env.update(extra)
    return env


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`python -m latentkv ARGV` (or a script when argv[0] ends in .py), output to `log`."""
    cmd = [sys.executable, *argv] if argv[0].endswith(".py") else [sys.executable, "-m", "latentkv", *argv]
    return subprocess.Popen(
        cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Every process's exit status; those still running after `timeout_s` are killed (status None
    is never returned: a test that would hang fails)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank did not finish within {timeout_s:.0f} s") from None
    return codes


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
