"""Where the ranks meet: torch's TCPStore at MASTER_ADDR:MASTER_PORT (the head hosts it, or
torchrun's agent does), one gloo group per *epoch* (the set of ranks that answer), and the
helpers of the start-up and rejoin handshakes.

Keys (all under "lkv/"):
    challenge              the head's random challenge for the secret's proofs
    hellos/R               a counter each hello of rank R bumps (a restart says hello again)
    hello/R/N, hello/R     rank R's N-th Hello, and N (written last)
    verdict/R/N            the head's Verdict for rank R's N-th hello
    ready/R/N              rank R's answer: its store is open (or why it could not open it)
    epoch/E                {"members": [ranks]}: the gloo group of epoch E has these, in order
    beat/R                 rank R's last heartbeat (unix seconds), written every few seconds

The head's store binds to MASTER_ADDR only; each gloo group binds to the address this machine
reaches MASTER_ADDR from (the head: MASTER_ADDR itself).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time

import torch.distributed as dist

from latentkv.config import ClusterConfig

PREFIX = "lkv/"


_GROUPS_MADE = False  # whether this process has made a gloo group (see end_process)


def end_process(code: int) -> int:
    """End a rank's process now, its output flushed, without running C++ destructors, once it has
    made a gloo group: a group of an epoch gone by can still hold a receive that never completes
    (its peer moved on to the next epoch), and destroying it at interpreter exit aborts the
    process ("terminate called without an active exception"), turning a clean exit into SIGABRT.
    A process that made no group (a refusal before the cluster started) gets `code` back."""
    if not _GROUPS_MADE:
        return code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed (a reader that left)
            stream.flush()
    os._exit(code)


class StoreGone(RuntimeError):
    """The rendezvous store (the head) cannot be reached."""


def open_store(cfg: ClusterConfig, timeout_s: float | None = None) -> tuple[dist.Store, socket.socket | None]:
    """(the store, the head's listening socket or None). The head hosts it on MASTER_ADDR unless
    torchrun's agent already does (TORCHELASTIC_USE_AGENT_STORE)."""
    td = datetime.timedelta(seconds=timeout_s or cfg.start_timeout_s)
    host = cfg.is_head and not cfg.agent_store
    sock = None
    try:
        if host:
            sock = socket.create_server((cfg.master_addr, cfg.master_port))
            store = dist.TCPStore(
                cfg.master_addr,
                cfg.master_port,
                None,
                True,
                td,
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
            )
        else:
            store = dist.TCPStore(cfg.master_addr, cfg.master_port, None, False, td)
    except (OSError, RuntimeError) as exc:
        if sock is not None:
            sock.close()
        where = f"{cfg.master_addr}:{cfg.master_port}"
        if host:
            raise StoreGone(f"cannot listen on {where} (MASTER_ADDR:MASTER_PORT): {short(exc)}") from None
        raise StoreGone(f"cannot reach the head at {where} (MASTER_ADDR:MASTER_PORT): {short(exc)}") from None
    return dist.PrefixStore(PREFIX, store), sock


def client_store(cfg: ClusterConfig, timeout_s: float) -> dist.Store:
    """Another connection to the store (for a thread of its own: a store client is not shared)."""
    store = dist.TCPStore(
        cfg.master_addr, cfg.master_port, None, False, datetime.timedelta(seconds=timeout_s)
    )
    return dist.PrefixStore(PREFIX, store)


def local_address(cfg: ClusterConfig) -> str:
    """The address gloo binds: MASTER_ADDR on the head, else this machine's address towards it."""
    if cfg.is_head:
        return cfg.master_addr
    family = socket.AF_INET6 if ":" in cfg.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((cfg.master_addr, cfg.master_port))  # no packet is sent: a route lookup
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def make_group(store: dist.Store, epoch: int, members: list[int], rank: int, address: str, timeout_s: float):
    """The gloo group of `epoch` (its members in order; this process is `rank`). Blocks until
    every member has joined, at most `timeout_s` (then RuntimeError)."""
    global _GROUPS_MADE
    _GROUPS_MADE = True
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(
        dist.PrefixStore(f"g{epoch}/", store), members.index(rank), len(members), opts
    )


def put_json(store: dist.Store, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def get_json(store: dist.Store, key: str, timeout_s: float) -> dict:
    """The JSON at `key`, waiting for it at most `timeout_s` (TimeoutError)."""
    wait(store, [key], timeout_s)
    return json.loads(store.get(key))


def wait(store: dist.Store, keys: list[str], timeout_s: float) -> None:
    """Wait until every key exists; TimeoutError after `timeout_s`, StoreGone if the store is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if store.check(keys):
                return
        except RuntimeError as exc:
            raise StoreGone(short(exc)) from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {', '.join(keys)}")
        time.sleep(0.05)


def short(exc: BaseException) -> str:
    """What went wrong, in one short line: torch's and gloo's messages without their source
    locations, stack frames and generic advice."""
    import re

    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].split(" Exception raised from")[0].strip()
