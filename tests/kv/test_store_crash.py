"""Crash safety: a child appending turns is SIGKILLed at random moments, again and again.

After every kill the file must load to exactly a committed state: the last count the child
printed, or the next turn's count when the kill landed between the commit's fsync and the
print. Every record must hold the bytes the child wrote. The next child resumes the same
file, so each trial also exercises cutting back the torn tail the previous one left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import store_crash_child as child

import latentkv
from latentkv.kv.store_file import RecordFile

CHILD = Path(child.__file__)


def _spawn(path: Path, chunk: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(latentkv.__file__).parents[1])}
    # -S skips site-packages (the child needs only the stdlib and latentkv): a faster start
    return subprocess.Popen(
        [sys.executable, "-S", str(CHILD), str(path), str(chunk)], stdout=subprocess.PIPE, text=True, env=env
    )


def _expected_payloads(f: RecordFile, n: int, memo: list[bytes]) -> list[bytes]:
    while len(memo) < n:
        memo.append(child.payload(f.layout, f.header.model.vocab_size, len(memo)))
    return memo[:n]


def _check_committed_state(path: Path, printed: int, memo: list[bytes]) -> tuple[int, bool]:
    """Load the file as a reader; (records, whether an uncommitted tail was present)."""
    with RecordFile.open(path) as f:
        scan = f.read()
        assert scan.count == scan.committed, scan.notes
        assert scan.committed in (printed, printed + child.turn_size(printed)), (printed, scan.committed)
        R, P = f.layout.size, f.layout.payload_size
        got = [bytes(scan.data[i * R : i * R + P]) for i in range(scan.count)]
        assert got == _expected_payloads(f, scan.count, memo)
        return scan.count, scan.file_bytes > f.size_for(scan.committed)


def _run_trials(
    tmp_path: Path, trials: int, max_delay: float, seed: int, per_file: int = 25
) -> dict[str, int]:
    """`trials` kills, a fresh file every `per_file` of them (so each check stays small)."""
    rng = random.Random(seed)
    memo: list[bytes] = []
    stats = {"torn_tail": 0, "after_commit": 0, "turns": 0}
    for first in range(0, trials, per_file):
        path = tmp_path / f"crash-{first}.kv"
        RecordFile.create(path, child.header()).close()
        _kill_repeatedly(path, min(per_file, trials - first), max_delay, rng, memo, stats)
    return stats


def _kill_repeatedly(
    path: Path, trials: int, max_delay: float, rng: random.Random, memo: list[bytes], stats
) -> None:
    record = RecordFile.open(path).layout.size
    count = 0
    for _ in range(trials):
        # one record per write() at times, so a kill can tear a turn in the middle
        proc = _spawn(path, record * rng.choice([1, 1, 4, 1 << 20]))
        try:
            ready = proc.stdout.readline().split()
            assert ready[:1] == ["ready"], ready
            assert int(ready[1]) == count  # the child resumes exactly what the parent loaded
            # Half the trials wait for the first committed turn, so kills land mid-append even
            # when a loaded machine starts the child slowly; the others may land before it.
            first = proc.stdout.readline() if rng.random() < 0.5 else ""
            time.sleep(rng.uniform(0, max_delay))
        finally:
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate()
        printed = [int(x) for x in (first + out).split()]
        last = printed[-1] if printed else count
        stats["turns"] += len(printed)
        count, torn = _check_committed_state(path, last, memo)
        stats["torn_tail"] += torn
        stats["after_commit"] += count != last
    # a final writer finds nothing left to cut, and the file is exactly its records
    with RecordFile.open(path, writable=True) as f:
        assert f.recover() == count
        assert path.stat().st_size == f.size_for(count)


def test_sigkill_during_appends_always_reloads_a_committed_state(tmp_path):
    stats = _run_trials(tmp_path, trials=50, max_delay=0.02, seed=1)
    # the kills landed while appending, not all before the first turn: half the trials wait for
    # a committed turn before their random delay, whatever the machine's load
    assert stats["turns"] >= 25
    print(stats)


@pytest.mark.slow
def test_sigkill_many_trials(tmp_path):
    stats = _run_trials(tmp_path, trials=400, max_delay=0.05, seed=2)
    assert stats["torn_tail"] > 0
    print(stats)
