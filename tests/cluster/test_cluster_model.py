"""Expert parallelism end to end on localhost (gloo, builtin:fixture, small budgets): the logits
are those of one process streaming the same experts, bit for bit (one sequence and batched
decode, f32 and a quantized KV tier, 2 and 3 ranks); a worker killed mid-generation ends
`latentkv generate` with one line and exit 1 within the cluster timeout."""

from __future__ import annotations

import time

import pytest
import torch
from ranks import HERE, env_for, free_port, kill_all, spawn, wait_all

WORKER = ["generate", "builtin:fixture", "--prompt-ids", "1", "--ram-gb", "0.6", "--threads", "1"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per tier, the experts streamed from this machine's disk: the reference (run
    here, one torch thread as every rank)."""
    import os

    import model_driver

    tmp = tmp_path_factory.mktemp("reference")
    old = os.environ.get("LATENTKV_CACHE")
    os.environ["LATENTKV_CACHE"] = str(tmp / "cache")
    try:
        out = {}
        for tier in ("f32", "tq4"):
            model_driver.run(str(tmp / f"{tier}.pt"), "builtin:fixture", tier)
            out[tier] = torch.load(tmp / f"{tier}.pt")
        return out
    finally:
        if old is None:
            os.environ.pop("LATENTKV_CACHE")
        else:
            os.environ["LATENTKV_CACHE"] = old


@pytest.mark.parametrize("world,tier", [(2, "tq4"), (3, "f32")])
def test_logits_are_one_process_logits_bit_for_bit(tmp_path, references, world, tier):
    port, cache = free_port(), tmp_path / "cache"
    procs = [
        spawn(WORKER, env_for(r, world, port, cache), tmp_path / f"rank{r}.log") for r in range(1, world)
    ]
    out = tmp_path / "got.pt"
    head = [str(HERE / "model_driver.py"), str(out), "builtin:fixture", tier]
    procs.insert(0, spawn(head, env_for(0, world, port, cache), tmp_path / "rank0.log"))
    try:
        codes = wait_all(procs, 300)
    finally:
        kill_all(procs)
    assert codes == [0] * world, (tmp_path / "rank0.log").read_text()[-3000:]
    got, want = torch.load(out), references[tier]
    assert got["ranks"] == world
    for kind in ("single", "batched"):
        assert len(got[kind]) == len(want[kind]) == 6
        for step, (a, b) in enumerate(zip(got[kind], want[kind], strict=True)):
            assert torch.equal(a, b), f"{kind} step {step}: max difference {(a - b).abs().max().item()}"
    # every worker served a share and said so in one line
    for r in range(1, world):
        log = (tmp_path / f"rank{r}.log").read_text()
        assert f"latentkv worker: rank {r} of {world}" in log and "the head ended" in log


def test_generate_ends_with_one_line_and_exit_1_when_a_worker_dies(tmp_path):
    port, cache, world = free_port(), tmp_path / "cache", 3
    workers = {r: spawn(WORKER, env_for(r, world, port, cache), tmp_path / f"rank{r}.log") for r in (1, 2)}
    head_argv = [
        "generate", "builtin:fixture", "--prompt-ids", "5,6,7", "--max-tokens", "1000", "--ignore-eos",
        "--ram-gb", "0.6", "--threads", "1", "--cluster-timeout", "10", "--json",
    ]  # fmt: skip
    head = spawn(head_argv, env_for(0, world, port, cache), tmp_path / "rank0.log")
    procs = [head, *workers.values()]
    try:
        deadline = time.monotonic() + 120
        while "serving the head" not in (tmp_path / "rank2.log").read_text():
            assert time.monotonic() < deadline and head.poll() is None, (tmp_path / "rank0.log").read_text()
            time.sleep(0.2)
        time.sleep(3)  # generating now
        assert head.poll() is None
        workers[2].kill()
        killed = time.monotonic()
        code = head.wait(60)
        elapsed = time.monotonic() - killed
        assert wait_all([workers[1]], 60) == [0]  # the head ended: it told the other worker so
    finally:
        kill_all(procs)
    # lost at once (its connection closed); the rest is the head telling rank 1 and exiting
    assert code == 1 and elapsed < 10 + 25
    lines = (tmp_path / "rank0.log").read_text().strip().splitlines()
    assert lines[-1].startswith("latentkv generate: error: rank 2") and "start rank 2 again" in lines[-1]
    assert not any(line.startswith("Traceback") for line in lines)
    assert "the head ended" in (tmp_path / "rank1.log").read_text()
