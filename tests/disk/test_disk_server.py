"""An expert damaged on disk while the server streams experts (--ram-gb): the request that needs it
gets a 503 naming the expert and the repair command, the log gets one line (no traceback),
/health and /metrics say the store is degraded, and once the store is repaired (with the
command the error names) the server serves again by itself."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time

import httpx
import pytest
from tests.server.conftest import start_server

from latentkv.experts.store_file import read_manifest


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage")
    env = {"LATENTKV_CACHE": str(root / "cache")}
    flags = ("--ram-gb", "1", "--max-num-seqs", "2", "--max-model-len", "128")
    server = start_server("builtin:fixture", root / "server.log", *flags, key=None, env=env)
    (store,) = (root / "cache" / "experts").iterdir()
    yield server, store
    server.stop()


def _damage_layer(store, layer: int) -> None:
    """Flip one byte inside every expert of `layer` (in place: the server's open file sees it)."""
    entry = read_manifest(store).layers[layer]
    with open(store / entry.file, "r+b") as f:
        for e in range(entry.n_experts):
            f.seek(entry.offset(e) + 100)
            byte = f.read(1)
            f.seek(entry.offset(e) + 100)
            f.write(bytes([byte[0] ^ 0x40]))


def _complete(http: httpx.Client, stream: bool = False) -> httpx.Response:
    body = {"prompt": "The cat", "max_tokens": 4, "temperature": 0, "stream": stream}
    return http.post("/v1/completions", json=body)


def _degraded_gauge(http: httpx.Client) -> str:
    text = http.get("/metrics").text
    return next(line for line in text.splitlines() if line.startswith("latentkv_expert_store_degraded"))


def test_damage_is_named_reported_and_repaired_without_a_restart(served):
    server, store = served
    _damage_layer(store, 1)  # before any request: none of them is cached
    with server.http() as http:
        reply = _complete(http)
        assert reply.status_code == 503 and reply.headers["retry-after"]
        error = reply.json()["error"]
        assert error["code"] == "expert_store_damaged", error
        assert "model.layers.1.mlp.experts." in error["message"] and "fails its checksum" in error["message"]
        repair = error["message"].split("repair the store with `")[1].split("`")[0]
        assert repair.startswith("latentkv experts convert ") and repair.endswith(f"--out {store} --force")

        streamed = _complete(http, stream=True)
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert json.loads(events[-1])["error"]["code"] == "expert_store_damaged"

        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "expert_store_damaged"
        assert "model.layers.1.mlp.experts." in health.json()["error"]["message"]
        assert float(_degraded_gauge(http).split()[-1]) == 1

        fixed = subprocess.run(
            [sys.executable, "-m", "latentkv", *repair.split()[1:]],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert fixed.returncode == 0, fixed.stderr[-2000:]
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:  # the damaged experts are read again by themselves
            assert time.monotonic() < deadline, http.get("/health").text
            time.sleep(0.5)
        assert float(_degraded_gauge(http).split()[-1]) == 0
        assert _complete(http).status_code == 200
    log = server.log_text()
    assert "Traceback" not in log
    failures = [line for line in log.splitlines() if "expert_store_damaged" in line]
    assert failures and all("model.layers.1.mlp.experts." in line for line in failures)


def _turn(http: httpx.Client, prompt: list[int]) -> httpx.Response:
    body = {
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "session": "s",
    }
    return http.post("/v1/completions", json=body)


def _fill(folder) -> None:
    """Write a file in `folder` until its file system is full."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_a_session_turn_on_a_full_disk_is_503_and_the_session_keeps_its_last_turn(tmp_path, small_disk):
    kv = small_disk(16 * 2**20)
    server = start_server("builtin:tiny", tmp_path / "server.log", "--kv-dir", str(kv), key=None)
    try:
        with server.http() as http:
            first = _turn(http, [5, 6, 7, 8])
            assert first.status_code == 200, first.text
            ids = [int(t.split(":")[1]) for t in first.json()["choices"][0]["logprobs"]["tokens"]]
            committed = [5, 6, 7, 8, *ids]
            _fill(kv)
            full = _turn(http, [*committed, 9, 10])
            assert full.status_code == 503 and full.headers["retry-after"], full.text
            error = full.json()["error"]
            assert error["code"] == "storage_unavailable", error
            assert f"{kv / 's.kv'}" in error["message"] and "no space left" in error["message"], error
            (kv / "filler").unlink()
            again = _turn(http, [*committed, 9, 10])
            assert again.status_code == 200, again.text
            # the first turn's rows (all but its last sampled token, which has no row yet) were kept
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(committed) - 1
    finally:
        server.stop()
    assert sorted(p.name for p in kv.iterdir()) == ["s.kv"]  # no temporary file left
    assert "Traceback" not in server.log_text()
