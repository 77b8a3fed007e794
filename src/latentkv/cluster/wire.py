"""The messages between the head and one worker, over a gloo group's point-to-point ops.

Every message starts with a header, int64 [8]: (kind, seq, layer, a, b, c, 0, 0); what follows
depends on the kind:

    head -> worker (tag CMD)
      JOBS      a = jobs, b = rows, c = 1 on a pass's first ask   int64 [a, 2] (expert, rows),
                                                                  float32 [b, D] (the jobs' rows)
      PREFETCH  a = ids                                           int64 [a] (predicted experts)
      STATS     (the worker answers STATS_REPLY)
      EPOCH     a = the new epoch (the group changes; members in the store)
      STOP      the head is ending
    worker -> head (tag REPLY)
      OUT       a = expert, b = rows                              float32 [b, D] (its output)
      ERR       a = bytes                                         uint8 [a] (why the jobs failed)
      STATS_REPLY a = bytes                                       uint8 [a] (JSON telemetry)

A gloo send completes only once the peer has posted the matching receive, so each side keeps a
receive posted at all times (a receiver thread) and the head queues its sends on a sender thread:
a prefetch for the next layer never waits for the worker to finish this one.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from enum import IntEnum

import torch

TAG_CMD = 1
TAG_REPLY = 2
HEADER = 8
IDLE = datetime.timedelta(days=365)  # an idle receiver waits this long for the next message


class Kind(IntEnum):
    JOBS = 1
    PREFETCH = 2
    STATS = 3
    EPOCH = 4
    STOP = 5
    OUT = 11
    ERR = 12
    STATS_REPLY = 13


def header(kind: Kind, seq: int = 0, layer: int = 0, a: int = 0, b: int = 0, c: int = 0) -> torch.Tensor:
    return torch.tensor([int(kind), seq, layer, a, b, c, 0, 0], dtype=torch.int64)


def text_tensor(text: str) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
        if text
        else torch.zeros(0, dtype=torch.uint8)
    )


def tensor_text(t: torch.Tensor) -> str:
    return bytes(t.numpy().tobytes()).decode(errors="replace")


class Peer:
    """One end of a link: whole messages to and from one rank of a group, with byte counters.
    Sends are serialized by a lock (a message's parts must not interleave with another's)."""

    def __init__(self, group, peer: int, timeout_s: float):
        self.group = group
        self.peer = peer
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.send_seconds = 0.0

    def send(self, parts: Sequence[torch.Tensor], tag: int) -> None:
        """Send `parts` in order; each waits for the peer's receive at most the timeout."""
        with self._send_lock:
            t0 = time.perf_counter()
            for t in parts:
                if t.numel():
                    self.group.send([t.contiguous()], self.peer, tag).wait(self.timeout)
                    self.bytes_sent += t.numel() * t.element_size()
            self.send_seconds += time.perf_counter() - t0

    def recv(self, shape: Sequence[int], dtype: torch.dtype, tag: int, wait: bool = True) -> torch.Tensor:
        """One tensor; `wait` False waits without the timeout (an idle receiver, woken by the next
        message or by the connection closing)."""
        out = torch.empty(tuple(shape), dtype=dtype)
        if out.numel():
            work = self.group.recv([out], self.peer, tag)
            work.wait(self.timeout if wait else IDLE)
            self.bytes_received += out.numel() * out.element_size()
        return out

    def recv_header(self, tag: int, idle: bool = False) -> list[int]:
        return self.recv((HEADER,), torch.int64, tag, wait=not idle).tolist()
