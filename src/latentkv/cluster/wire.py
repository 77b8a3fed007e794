"""The messages between the head and one worker, over a gloo group's point-to-point ops.

A gloo send completes once the peer has posted the matching receive: a message whose receive
is already posted costs one network latency, one whose receive is posted only when its header
arrives costs two more (the "ready" notice, then the data). So the messages are shaped for
receives posted ahead:

    head -> worker
      CMD    int64 [8 + 2E], one fixed size: (kind, seq, layer, a, b, c, 0, 0) and up to E pairs;
             the worker keeps one posted at all times
               JOBS      a jobs, b rows, pairs (expert, rows) in job order; then ROWS
               PREFETCH  a ids, pairs (expert, 0): the layer's predicted experts
               STATS     the worker answers on MSG; EPOCH a = the new epoch; STOP the head ends
      ROWS   float32 [b, D]: the jobs' rows, job after job
    worker -> head
      OUT    float32 [rows, D], one per job, in job order; the head posts every receive of an
             exchange when it sends the jobs, so each output costs one latency
      MSG    int64 [8] (kind, seq, bytes) then uint8 [bytes]: ERR (the jobs failed: why; the
             remaining OUTs follow as zeros so the posted receives complete) or STATS_REPLY (JSON)

Per MoE layer and remote rank that is about four one-way latencies (the command, the rows'
ready notice and data, the first output) plus the bytes, instead of three per message.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from enum import IntEnum

import torch

TAG_CMD = 1
TAG_ROWS = 2
TAG_OUT = 3
TAG_MSG = 4
HEADER = 8
IDLE = datetime.timedelta(days=365)  # an idle receiver waits this long for the next message


class Kind(IntEnum):
    JOBS = 1
    PREFETCH = 2
    STATS = 3
    EPOCH = 4
    STOP = 5
    ERR = 12
    STATS_REPLY = 13


def command(
    n_experts: int, kind: Kind, seq: int = 0, layer: int = 0, a: int = 0, b: int = 0, c: int = 0, pairs=()
) -> torch.Tensor:
    """A CMD message: the header and up to `n_experts` (x, y) pairs, in one fixed-size tensor."""
    out = torch.zeros(HEADER + 2 * n_experts, dtype=torch.int64)
    out[:6] = torch.tensor([int(kind), seq, layer, a, b, c])
    if len(pairs):
        flat = torch.as_tensor(pairs, dtype=torch.int64).reshape(-1)
        out[HEADER : HEADER + flat.numel()] = flat
    return out


def header(kind: Kind, seq: int = 0, a: int = 0) -> torch.Tensor:
    """A MSG header: int64 [8]."""
    return torch.tensor([int(kind), seq, a, 0, 0, 0, 0, 0], dtype=torch.int64)


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

    def send(self, parts: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Send each (tensor, tag) in order; each waits for the peer's receive at most the timeout."""
        with self._send_lock:
            t0 = time.perf_counter()
            for t, tag in parts:
                if t.numel():
                    self.group.send([t.contiguous()], self.peer, tag).wait(self.timeout)
                    self.bytes_sent += t.numel() * t.element_size()
            self.send_seconds += time.perf_counter() - t0

    def post(self, shape: Sequence[int], dtype: torch.dtype, tag: int):
        """Post a receive now: (its tensor, its work), to `wait` on later."""
        out = torch.empty(tuple(shape), dtype=dtype)
        return out, (self.group.recv([out], self.peer, tag) if out.numel() else None)

    def wait(self, posted, idle: bool = False) -> torch.Tensor:
        """The posted receive's tensor once it has arrived (within the timeout, or `idle`: until
        the next message, or the connection closing)."""
        out, work = posted
        if work is not None:
            work.wait(IDLE if idle else self.timeout)
            self.bytes_received += out.numel() * out.element_size()
        return out

    def recv(self, shape: Sequence[int], dtype: torch.dtype, tag: int, idle: bool = False) -> torch.Tensor:
        return self.wait(self.post(shape, dtype, tag), idle)
