"""Live servers for the server tests: `latentkv serve` in a child process on a free loopback port.

Each test module starts its own (scope="module"), waits for /health, and stops it at the end.
The child runs one torch thread, like the tests, and its log is shown when it fails to start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

KEY = "test-key"
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    process: subprocess.Popen
    port: int
    log: Path
    key: str | None
    kv_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.key or "none", max_retries=0, **kwargs
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60)

    def stop(self) -> int:
        """SIGTERM (graceful: sessions are saved by the worker), then the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_server(
    model: str, log: Path, *flags: str, key: str | None = KEY, env: dict | None = None
) -> LiveServer:
    """Start `latentkv serve MODEL FLAGS` and wait until /health says 200."""
    for _attempt in range(3):  # a port taken between free_port() and the bind: try another
        port = free_port()
        cmd = [sys.executable, "-m", "latentkv.cli", "serve", model, "--port", str(port), "--threads", "1"]
        cmd += ["--log-level", "warning", *flags]
        if key:
            cmd += ["--api-key", key]
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        for name in ("KV8", "KV_TQ", "KV_TQ_POLAR", "LATENTKV_API_KEY"):
            child_env.pop(name, None)
        with open(log, "ab") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env)
        server = LiveServer(process, port, log, key)
        if _wait_healthy(server):
            return server
        server.stop()
        if "address already in use" not in server.log_text().lower():
            break
    pytest.fail(f"the server did not come up; its log:\n{server.log_text()[-4000:]}")


def _wait_healthy(server: LiveServer) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """builtin:tiny behind an API key, 4 sequences per batch, sessions in a private folder."""
    root = tmp_path_factory.mktemp("server")
    server = start_server(
        "builtin:tiny",
        root / "server.log",
        "--max-num-seqs",
        "4",
        "--kv-dir",
        str(root / "kv"),
        "--max-model-len",
        "512",
    )
    server.kv_dir = root / "kv"
    yield server
    server.stop()


@pytest.fixture(scope="session")
def serve():
    """start_server(model, log, *flags, key=..., env=...), for modules that need their own server."""
    return start_server
