"""The engine process (engine/remote.py): the model and scheduler in a child of the server.

Every other server test already runs through it (it is the default); these check what is its
own: both modes answer alike, stopping the server stops the child, and a child that dies
turns into errors and a 503, never a hung request.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

PROMPT = [5, 17, 99, 3, 42, 7, 250, 18]


def _engine_pid(server_pid: int) -> int:
    """The server's spawned child (not multiprocessing's resource tracker)."""
    tasks = Path(f"/proc/{server_pid}/task").iterdir()  # a restarted engine is its starter thread's child
    children = [c for task in tasks for c in (task / "children").read_text().split()]
    for pid in map(int, children):
        if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no engine process among {children}")


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie until its parent reaps it counts as gone
            if f.read().split()[2] == "Z":
                return True
        time.sleep(0.1)
    return False


def _greedy(server, n: int = 12) -> list[int]:
    with server.http() as http:
        r = http.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": n, "temperature": 0, "logprobs": 0, "ignore_eos": True},
        )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child pids from /proc (Linux)")
def test_both_modes_answer_alike_and_stopping_the_server_stops_the_engine(tmp_path, serve):
    split = serve("builtin:tiny", tmp_path / "split.log")
    engine = _engine_pid(split.process.pid)
    one = serve("builtin:tiny", tmp_path / "one.log", "--no-engine-process")
    try:
        assert _greedy(split) == _greedy(one)
        with open(f"/proc/{one.process.pid}/task/{one.process.pid}/children") as f:
            assert not f.read().split()  # one process: no engine child
    finally:
        one.stop()
        assert split.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it shut down on
    assert _gone(engine), "the engine process outlived the server"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child pids from /proc (Linux)")
def test_a_dead_engine_ends_streams_with_an_error_and_is_started_again(tmp_path, serve):
    server = serve("builtin:tiny", tmp_path / "server.log", "--max-model-len", "1024")
    try:
        engine = _engine_pid(server.process.pid)
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        events = []
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        os.kill(engine, signal.SIGKILL)
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])
            assert "error" in error and "engine process stopped" in error["error"]["message"]
            assert len(events) < 1000  # it ended early, not after max_tokens
            health = http.get("/health")
            assert health.status_code == 503
            assert "engine process stopped (killed by signal 9 (SIGKILL)); restarting it" in health.text
            again = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert again.status_code == 503 and again.headers["retry-after"] == "5"
            assert again.json()["error"]["message"].startswith("the model stopped serving")
            assert again.json()["error"]["code"] == "engine_stopped"
            deadline = time.monotonic() + 120  # a new engine process loads the model again
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline, http.get("/health").text
                time.sleep(0.2)
            assert _engine_pid(server.process.pid) != engine
            again = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert again.status_code == 200, again.text
    finally:
        server.stop()
    assert "Traceback" not in server.log_text()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child pids from /proc (Linux)")
def test_the_engine_exits_when_the_server_is_killed(tmp_path, serve):
    """SIGKILL gives the server no chance to stop its child: the child sees its pipe close."""
    server = serve("builtin:tiny", tmp_path / "server.log")
    engine = _engine_pid(server.process.pid)
    server.process.kill()
    server.process.wait()
    assert _gone(engine), "the engine process outlived a killed server"


def _allowed_cpus(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child pids from /proc (Linux)")
def test_engine_and_http_run_on_separate_cpus(tmp_path, serve):
    """--pin-cpus: the engine on the last --threads CPUs (1 here), the HTTP process on the
    others; without it (the default) both may run on every CPU. On a one-CPU machine there is
    nothing to split and neither is pinned."""
    from latentkv.engine.remote import cpu_split

    everything = os.sched_getaffinity(0)
    expected = cpu_split(1)
    pinned = serve("builtin:tiny", tmp_path / "pinned.log", "--pin-cpus")
    free = serve("builtin:tiny", tmp_path / "free.log")
    try:
        engine = _allowed_cpus(_engine_pid(pinned.process.pid))
        http = _allowed_cpus(pinned.process.pid)
        if expected is None:
            assert engine == http == everything
        else:
            assert (sorted(engine), sorted(http)) == expected
            assert not engine & http and engine | http == everything
            assert "engine process on CPU" in pinned.log_text()
        assert _allowed_cpus(_engine_pid(free.process.pid)) == _allowed_cpus(free.process.pid) == everything
        assert _greedy(pinned) == _greedy(free)
    finally:
        pinned.stop()
        free.stop()


def test_cpu_split(monkeypatch):
    from latentkv.engine import remote

    monkeypatch.setattr(remote.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(remote.os, "sched_setaffinity", lambda pid, cpus: None, raising=False)
    assert remote.cpu_split(None) == ([1, 2, 3], [0])
    assert remote.cpu_split(2) == ([2, 3], [0, 1])
    assert remote.cpu_split(4) is None  # no CPU left for the HTTP process
    monkeypatch.setattr(remote.os, "sched_getaffinity", lambda pid: {5, 9}, raising=False)
    assert remote.cpu_split(None) == ([9], [5])
    monkeypatch.setattr(remote.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert remote.cpu_split(None) is None and remote.cpu_split(1) is None
    monkeypatch.delattr(remote.os, "sched_setaffinity")
    assert remote.cpu_split(None) is None
