"""Both engines are an EngineClient: the in-process Scheduler and the engine process's proxy
offer the protocol's methods with its signatures, so the server may hold either."""

from __future__ import annotations

import inspect

import pytest

from latentkv.engine.client import EngineClient
from latentkv.engine.remote import EngineProcess
from latentkv.engine.scheduler import Scheduler

METHODS = ["start", "submit", "submit_all", "stats", "shutdown"]


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", [Scheduler, EngineProcess])
def test_each_engine_has_the_protocols_methods_and_signatures(cls):
    protocol = {n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")}
    assert protocol == set(METHODS)
    for name in METHODS:
        assert _parameters(getattr(cls, name)) == _parameters(getattr(EngineClient, name)), name


def test_a_scheduler_has_the_protocols_attributes(ours):
    scheduler = Scheduler(
        ours("glm5-tiny"), ours("glm5-tiny").tier(), max_num_seqs=2, max_queue=3, max_model_len=64
    )
    attributes = inspect.get_annotations(EngineClient)
    assert set(attributes) == {"max_num_seqs", "max_queue", "max_model_len", "failure"}
    assert (scheduler.max_num_seqs, scheduler.max_queue, scheduler.max_model_len) == (2, 3, 64)
    assert scheduler.failure is None
    scheduler.shutdown()
