"""`latentkv serve` as the head of 3 ranks on localhost: answers (tokens and logprobs) are one
process's; a worker killed mid-stream ends that stream with the reason, /health and new
requests say 503 degraded while it is gone, session files stay as last saved, and once the
worker is started again the cluster serves as before."""

from __future__ import annotations

import json
import signal
import time

import httpx
from ranks import env_for, free_port, kill_all, spawn, wait_all

FLAGS = ["--ram-gb", "0.6", "--threads", "1", "--max-num-seqs", "2", "--max-model-len", "1024", "--log-level", "warning"]  # fmt: skip


def _serve(port: int, kv: str) -> list[str]:
    return [
        "serve",
        "builtin:fixture",
        "--port",
        str(port),
        "--kv-dir",
        kv,
        *FLAGS,
        "--cluster-timeout",
        "10",
    ]


def _wait_health(url: str, procs, timeout_s: float = 240, want: int = 200) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a rank exited"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == want:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url}/health did not answer {want} within {timeout_s} s")


def _complete(url: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"temperature": 0, "ignore_eos": True, **body}, timeout=120
    )


def test_a_server_over_three_ranks_is_one_process_and_survives_a_lost_rank(tmp_path):
    port, cache, world = free_port(), tmp_path / "cache", 3
    head_port, ref_port = free_port(), free_port()
    kv = str(tmp_path / "kv")
    workers = {
        r: spawn(_serve(head_port, kv), env_for(r, world, port, cache), tmp_path / f"rank{r}.log")
        for r in (1, 2)
    }
    head = spawn(_serve(head_port, kv), env_for(0, world, port, cache), tmp_path / "rank0.log")
    ref_env = env_for(0, 1, 0, tmp_path / "ref-cache")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        ref_env.pop(key)
    ref = spawn(_serve(ref_port, str(tmp_path / "ref-kv"))[:-2], ref_env, tmp_path / "ref.log")
    procs = [head, ref, *workers.values()]
    url, ref_url = f"http://127.0.0.1:{head_port}", f"http://127.0.0.1:{ref_port}"
    try:
        _wait_health(url, procs)
        _wait_health(ref_url, procs)
        # the same answers, logprobs included (one prompt at a time: how a server batches
        # requests that arrive together depends on timing, and batching moves the last bits;
        # batched decode is compared bit for bit in test_cluster_model.py)
        for body in (
            {"prompt": "Hello there", "max_tokens": 8, "logprobs": 2},
            {"prompt": "Once upon a time", "max_tokens": 6, "logprobs": 1, "session": "s1"},
        ):
            got, want = _complete(url, body), _complete(ref_url, body)
            assert got.status_code == want.status_code == 200, got.text
            assert got.json()["choices"] == want.json()["choices"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'latentkv_cluster_rank_up{model_name="builtin:fixture",rank="2",role="worker"} 1' in metrics
        # worker 2 dies while a stream runs: the stream ends with the reason
        body = {
            "prompt": "Far away",
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        events, killed = [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                if len(events) == 3 and killed is None:
                    workers[2].send_signal(signal.SIGKILL)
                    killed = time.monotonic()
        assert killed is not None and time.monotonic() - killed < 10 + 5
        assert "error" in events[-1] and "rank 2" in events[-1]["error"]["message"]
        # while it is gone: /health and new requests answer 503 with the reason
        health = _wait_health(url, [head, workers[1]], 30, want=503)
        assert "degraded" in health.text and "rank 2" in health.text
        refused = _complete(url, {"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and "start rank 2 again" in refused.json()["error"]["message"]
        # back: the same command again; the session resumes what its first turn saved
        workers[2] = spawn(
            _serve(head_port, kv), env_for(2, world, port, cache), tmp_path / "rank2-again.log"
        )
        _wait_health(url, [head, workers[1], workers[2]], 120)
        turn = {
            "prompt": "Once upon a time" + want_text(ref_url),
            "max_tokens": 5,
            "logprobs": 1,
            "session": "s1",
        }
        got, want = _complete(url, turn), _complete(ref_url, turn)
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()["usage"] == want.json()["usage"] and got.json()["choices"] == want.json()["choices"]
        assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        head.send_signal(signal.SIGTERM)
        assert wait_all([head, workers[1], workers[2]], 60)[1:] == [0, 0]
    finally:
        kill_all(procs + list(workers.values()))
    assert "is back: the cluster is whole (epoch 2)" in (tmp_path / "rank0.log").read_text()


def want_text(ref_url: str) -> str:
    """The session's first turn's text (asked again of the reference: greedy, so the same)."""
    r = _complete(ref_url, {"prompt": "Once upon a time", "max_tokens": 6})
    return r.json()["choices"][0]["text"]
