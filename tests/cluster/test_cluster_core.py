"""The cluster layer on localhost (gloo, builtin:fixture, small budgets), driven without a model
by tests/cluster/driver.py as the head: every remote expert's output equals the head's own, bit
for bit; a mismatched worker is refused with one line on both sides; a killed worker fails the
round in flight at once and the cluster is whole again when it comes back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from ranks import HERE, env_for, free_port, kill_all, spawn, wait_all

WORKER = ["generate", "builtin:fixture", "--prompt-ids", "1", "--ram-gb", "0.6", "--threads", "1"]
DRIVER = str(HERE / "driver.py")


def _events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _start(tmp_path: Path, world: int, driver: list[str], workers: dict[int, list[str]] | None = None, **env):
    port = free_port()
    cache = tmp_path / "cache"
    procs = {}
    for r in range(1, world):
        argv = (workers or {}).get(r, WORKER)
        procs[r] = spawn(argv, env_for(r, world, port, cache), tmp_path / f"rank{r}.log")
    procs[0] = spawn([DRIVER, *driver], env_for(0, world, port, cache, **env), tmp_path / "rank0.log")
    return procs, port, cache


def test_every_remote_output_is_the_heads_own_bit_for_bit(tmp_path):
    procs, _, _ = _start(tmp_path, 3, ["exchange", "builtin:fixture", "3"])
    try:
        assert wait_all([procs[0], procs[1], procs[2]], 120) == [0, 0, 0]
    finally:
        kill_all(list(procs.values()))
    events = _events(tmp_path / "rank0.log")
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 3 and all(e["ok"] and e["checked"] > 0 for e in rounds)
    records = next(e["records"] for e in events if e["event"] == "records")
    assert [r["rank"] for r in records] == [1, 2]
    for rec in records:
        assert rec["status"] == "ok" and rec["jobs"] == 3 * 4 and rec["bytes_sent"] > 0
        for key in ("hit_rate", "recall", "read_gbps", "net_wait_seconds", "bytes_read"):
            assert key in rec
    for r in (1, 2):
        log = (tmp_path / f"rank{r}.log").read_text()
        assert f"latentkv worker: rank {r} of 3" in log and "the head ended" in log


@pytest.mark.parametrize(
    "case",
    ["model", "secret"],
)
def test_a_mismatched_worker_is_refused_with_one_line_on_both_sides(tmp_path, case):
    if case == "model":
        workers = {1: ["generate", "builtin:tiny", *WORKER[2:]]}
        env = {}
        head_says, worker_says = "runs another model", "runs another model"
    else:
        workers = {1: [*WORKER, "--cluster-secret", "one"], 2: [*WORKER, "--cluster-secret", "two"]}
        env = {"DRIVER_SECRET": "two"}
        head_says, worker_says = "another cluster secret", "another cluster secret"
    procs, _, _ = _start(tmp_path, 3, ["exchange", "builtin:fixture", "1"], workers, **env)
    try:
        codes = wait_all([procs[0], procs[1], procs[2]], 120)
    finally:
        kill_all(list(procs.values()))
    assert codes == [2, 2, 2]
    refused = next(e for e in _events(tmp_path / "rank0.log") if e["event"] == "refused")
    assert head_says in refused["error"] and "rank 1" in refused["error"]
    log1 = (tmp_path / "rank1.log").read_text().strip().splitlines()
    assert (
        len(log1) == 1 and worker_says in log1[0] and log1[0].startswith("latentkv generate: error: rank 1")
    )
    log2 = (tmp_path / "rank2.log").read_text().strip().splitlines()
    assert len(log2) == 1 and "the cluster did not start" in log2[0]


def _wait_for(log: Path, test, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = _events(log) if log.exists() else []
        if test(events):
            return events
        time.sleep(0.2)
    raise AssertionError(f"{log}: not seen within {timeout_s} s:\n{log.read_text()[-2000:]}")


@pytest.mark.parametrize("takeover", [False, True], ids=["requests-fail-until-back", "head-takes-over"])
def test_a_killed_worker_fails_the_round_in_flight_and_rejoins(tmp_path, takeover):
    stop = tmp_path / "stop"
    procs, port, cache = _start(
        tmp_path,
        3,
        ["faults", "builtin:fixture"],
        DRIVER_STOP=str(stop),
        DRIVER_TAKEOVER="1" if takeover else "0",
        DRIVER_TIMEOUT="5",
    )
    log = tmp_path / "rank0.log"
    try:
        ok = lambda es: sum(1 for e in es if e["event"] == "round" and e["ok"])  # noqa: E731
        _wait_for(log, lambda es: ok(es) >= 3)
        procs[2].kill()
        killed = time.monotonic()
        if takeover:  # the round in flight fails, or none does when rank 2 died between rounds:
            # either way the head sees the loss within the timeout and goes on degraded
            lost = lambda e: e["event"] == "round" and (not e["ok"] or e["status"]["status"] == "degraded")  # noqa: E731
        else:
            lost = lambda e: e["event"] == "round" and not e["ok"]  # noqa: E731
        events = _wait_for(log, lambda es: any(lost(e) for e in es))
        failed = next(e for e in events if lost(e))
        assert failed.get("seconds", 0) < 5 + 5 and time.monotonic() - killed < 30
        why = (failed["error"] if not failed["ok"] else failed["status"]["reason"]).lower()
        assert "rank 2" in why and ("connection" in why or "answer" in why)
        if takeover:  # the next rounds go on without it, the head reading its experts
            n = failed["n"]
            events = _wait_for(
                log, lambda es: any(e["event"] == "round" and e["n"] > n and e["ok"] for e in es)
            )
            assert (
                next(e for e in events if e["event"] == "round" and e["n"] > n)["status"]["status"]
                == "degraded"
            )
        else:  # later rounds fail at once, saying how to bring it back
            events = _wait_for(
                log, lambda es: sum(1 for e in es if e["event"] == "round" and not e["ok"]) >= 3
            )
            later = [e for e in events if e["event"] == "round" and not e["ok"]][2]
            assert later["seconds"] < 3 and "start rank 2 again" in later["error"]
            assert later["status"]["status"] == "degraded" and not later["status"]["serving"]
        if takeover:  # coming back is the other case's (the same path)
            stop.touch()
            assert wait_all([procs[0], procs[1]], 60) == [0, 0]
            return
        # back: the same command again
        procs[2] = spawn(WORKER, env_for(2, 3, port, cache), tmp_path / "rank2-again.log")
        last = max(e["n"] for e in _events(log) if e["event"] == "round")
        events = _wait_for(
            log,
            lambda es: any(
                e["event"] == "round" and e["n"] > last and e["ok"] and e["status"]["status"] == "ok"
                for e in es
            ),
        )
        back = next(
            e for e in events if e["event"] == "round" and e["n"] > last and e["status"]["status"] == "ok"
        )
        assert back["status"]["epoch"] == 2
        # a round begun once it was back sends it all its experts again
        whole = _wait_for(log, lambda es: any(e["event"] == "round" and e["n"] > back["n"] for e in es))
        after = next(e for e in whole if e["event"] == "round" and e["n"] > back["n"])
        assert after["ok"] and after["checked"] == _events(log)[1]["checked"]
        stop.touch()
        assert wait_all([procs[0], procs[1], procs[2]], 60) == [0, 0, 0]
    finally:
        kill_all(list(procs.values()))
    assert "is back: the cluster is whole (epoch 2)" in log.read_text()
