"""A worker rank: join the head, open this rank's share of the experts, serve jobs until the head
ends (docs/distributed.md).

    join       say hello (model fingerprint, format, RAM, disk speed, placement, secret proof),
               wait for the head's verdict (the placement and this rank's cache budget)
    store      its share of this placement, else the machine's full store, else written now
    serve      a receiver thread takes the head's messages as they come (a prefetch starts its
               reads at once), the main thread computes each job's experts in turn and sends
               each output back as soon as it is computed; STATS answers telemetry; EPOCH moves
               to a new group (a rank rejoined); STOP (the head ends) or a lost head ends it

A worker computes `Expert(rows)` with the experts the head would use and the rows the head's
own pass would give them, so its outputs are the ones one process computes, bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from latentkv.cluster import rendezvous as rv
from latentkv.cluster.handshake import PROTOCOL, Hello, Verdict, head_proof, worker_proof
from latentkv.cluster.wire import HEADER, TAG_CMD, TAG_MSG, TAG_OUT, TAG_ROWS, Kind, Peer, header, text_tensor
from latentkv.config import ClusterConfig, EngineConfig
from latentkv.errors import UserError

BEAT_S = 2.0  # heartbeat period (the head reads them; a stale one means the rank is gone)


@dataclass
class WorkerModel:
    """What a worker knows of the model: no weights but its experts."""

    directory: Path
    model: str  # the MODEL argument
    fingerprint: str
    hidden_size: int
    expert_format: str
    layers: dict[int, int]  # MoE layer -> experts (the MTP layer's included)
    top_k: int  # experts per token: a job's experts are asked for this many at a time


def describe_model(model_arg: str, engine: EngineConfig) -> WorkerModel:
    from latentkv.config import ModelConfig
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer
    from latentkv.models.registry import resolve
    from latentkv.streaming.cluster_plan import moe_layer_ids

    directory = resolve(model_arg)
    cfg = ModelConfig.from_hf(directory)
    ckpt = Checkpoint(directory)
    layers = {i: cfg.n_routed_experts for i in moe_layer_ids(cfg, routed_layer(cfg, ckpt))}
    return WorkerModel(
        directory,
        model_arg,
        ckpt.fingerprint(),
        cfg.hidden_size,
        engine.experts,
        layers,
        cfg.num_experts_per_tok,
    )


def run_worker(cfg: ClusterConfig, model_arg: str, engine: EngineConfig) -> int:
    """Serve as rank `cfg.rank` until the head ends: 0 when it ended normally, 1 when it was lost.
    UserError (exit 2) when refused at start-up."""
    if engine.threads:
        torch.set_num_threads(engine.threads)
    model = describe_model(model_arg, engine)
    store, _ = _open(cfg)
    verdict, nonce = _join(cfg, store, model, engine)
    streamer, where = _open_share(cfg, store, model, verdict, nonce, engine)
    try:
        beat = _Heartbeat(cfg)
        beat.start()
        group = _group(cfg, store, verdict.epoch)
        share = sum(len(v) for v in streamer.config.experts.values())
        print(
            f"latentkv worker: rank {cfg.rank} of {cfg.world_size} on {socket.gethostname()}: {share} experts of "
            f"{model.model} from {where} (cache {verdict.cache_bytes / 2**30:.2f} GiB); serving the head at "
            f"{cfg.master_addr}:{cfg.master_port} until it ends",
            file=sys.stderr,
            flush=True,
        )
        return _Server(cfg, store, streamer, group, verdict.epoch, model).serve()
    finally:
        streamer.close()


def _open(cfg: ClusterConfig):
    try:
        return rv.open_store(cfg)
    except rv.StoreGone as exc:
        raise UserError(str(exc)) from None


def _join(cfg: ClusterConfig, store, model: WorkerModel, engine: EngineConfig) -> tuple[Verdict, str]:
    """Say hello and wait for the verdict: (verdict, this attempt's nonce). UserError if refused."""
    from latentkv import version
    from latentkv.config import env_cluster_secret
    from latentkv.experts.placement import Placement

    secret = cfg.secret or env_cluster_secret()
    nonce = secrets.token_hex(8)
    try:
        rv.wait(store, ["challenge"], cfg.start_timeout_s)
        challenge = store.get("challenge").decode()
        hello = Hello(
            rank=cfg.rank,
            nonce=nonce,
            host=socket.gethostname(),
            protocol=PROTOCOL,
            version=version(),
            fingerprint=model.fingerprint,
            model=model.model,
            expert_format=model.expert_format,
            ram_bytes=_ram_bytes(cfg, engine),
            disk_gbps=cfg.disk_gbps or _measured_disk(model, cfg.rank),
            placement=Placement.load(cfg.placement).digest if cfg.placement else None,
            share=_share_placement(model, cfg.rank),
            proof=worker_proof(secret, challenge, cfg.rank, nonce),
        )
        gen = store.add(f"hellos/{cfg.rank}", 1)
        store.set(f"hello/{cfg.rank}/{gen}", hello.to_bytes())
        store.set(f"hello/{cfg.rank}", str(gen))  # last: the head reads the hello it points to
        key = f"verdict/{cfg.rank}/{gen}"
        rv.wait(store, [key], cfg.start_timeout_s)
        verdict = Verdict.from_bytes(store.get(key))
        store.set(f"seen/{cfg.rank}/{gen}", "1")
    except TimeoutError:
        raise UserError(
            f"the head at {cfg.master_addr}:{cfg.master_port} gave no answer within "
            f"{cfg.start_timeout_s:.0f} s"
        ) from None
    except (rv.StoreGone, RuntimeError) as exc:
        raise UserError(
            f"lost the head at {cfg.master_addr}:{cfg.master_port} while joining: {exc}"
        ) from None
    if not verdict.ok:
        raise UserError(f"rank {cfg.rank} refused by the head: {verdict.reason}")
    if verdict.proof != head_proof(secret, nonce):
        reason = (
            "the head presents another cluster secret"
            if secret and verdict.proof
            else (
                "this rank has a cluster secret and the head has none"
                if secret
                else "the head has a cluster secret and this rank has none"
            )
        )
        rv.put_json(
            store,
            f"ready/{cfg.rank}/{gen}",
            {"ok": False, "reason": f"rank {cfg.rank} refuses the head: {reason}"},
        )
        raise UserError(
            f"rank {cfg.rank} refuses the head: {reason}: set the same LATENTKV_CLUSTER_SECRET on every rank"
        )
    verdict.extra["gen"] = gen
    return verdict, nonce


def _ram_bytes(cfg: ClusterConfig, engine: EngineConfig) -> int:
    """--ram-gb, else this machine's share of 80% of its available memory (ranks on one machine
    split it)."""
    from latentkv.streaming.planner import DEFAULT_RAM_SHARE, GIB, available_memory

    if engine.ram_gb is not None:
        return int(engine.ram_gb * GIB)
    avail, _ = available_memory()
    return int(avail * DEFAULT_RAM_SHARE / max(1, cfg.local_world_size))


def _measured_disk(model: WorkerModel, rank: int) -> float | None:
    """This machine's expert store read speed (measured once, kept beside the store), or None
    when there is no store here yet."""
    from latentkv.experts.disk import disk_gbps

    store = _any_store(model, rank)
    return disk_gbps(store) if store is not None else None


def _any_store(model: WorkerModel, rank: int) -> Path | None:
    from latentkv.experts.store_file import MANIFEST
    from latentkv.streaming.shares import default_share_dir, full_store

    full = full_store(model.directory, model.expert_format)
    if full is not None:
        return full
    pattern = default_share_dir(model.directory, model.expert_format, "*", rank)
    found = sorted(pattern.parent.glob(pattern.name))
    return next((d for d in found if (d / MANIFEST).exists()), None)


def _share_placement(model: WorkerModel, rank: int) -> dict | None:
    """The placement this rank's share was written for (so the head can adopt it), if any."""
    from latentkv.experts.share import share_of
    from latentkv.experts.store_file import ExpertFileError, read_manifest

    store = _any_store(model, rank)
    if store is None:
        return None
    try:
        manifest = read_manifest(store, model.fingerprint)
    except ExpertFileError:
        return None
    share = share_of(manifest)
    return manifest.meta.get("placement") if share is not None else None


def _open_share(
    cfg: ClusterConfig, store, model: WorkerModel, verdict: Verdict, nonce: str, engine: EngineConfig
):
    """Open this rank's experts for the verdict's placement and tell the head: (streamer, where)."""
    from latentkv.experts.placement import Placement
    from latentkv.experts.store_file import ExpertFileError
    from latentkv.experts.streamed import ExpertStreamer, StreamConfig
    from latentkv.streaming.shares import check_share, ensure_share

    key = f"ready/{cfg.rank}/{verdict.extra['gen']}"
    try:
        placement = Placement.from_json(verdict.placement, "the head's placement")
        placement.check_layers(model.layers)
        where = ensure_share(model.directory, model.expert_format, placement, cfg.rank, progress=True)
        check_share(where, placement, cfg.rank, model.fingerprint)
        mine = {layer: frozenset(ids) for layer, ids in placement.share(cfg.rank).items()}
        config = StreamConfig(budget=verdict.cache_bytes, policy=engine.expert_policy, experts=mine)
        streamer = ExpertStreamer(where, model.fingerprint, config)
        streamer.pin_hot_set()
    except (ExpertFileError, ValueError, OSError) as exc:
        rv.put_json(store, key, {"ok": False, "reason": f"rank {cfg.rank}: {exc}"})
        raise UserError(f"rank {cfg.rank}: {exc}") from None
    rv.put_json(store, key, {"ok": True})
    return streamer, where


def _group(cfg: ClusterConfig, store, epoch: int):
    got = rv.get_json(store, f"epoch/{epoch}", cfg.start_timeout_s)
    if got.get("abort"):
        raise UserError(f"rank {cfg.rank}: the cluster did not start: {got['abort']}")
    members = got["members"]
    if cfg.rank not in members:
        raise UserError(f"rank {cfg.rank} is not in the head's cluster (epoch {epoch}: ranks {members})")
    return rv.make_group(store, epoch, members, cfg.rank, rv.local_address(cfg), cfg.start_timeout_s)


class _Heartbeat(threading.Thread):
    """Writes beat/R every BEAT_S on a store connection of its own; a head that cannot be reached
    for the cluster timeout is gone: the process ends (its gloo receive would wait forever on a
    machine that vanished)."""

    def __init__(self, cfg: ClusterConfig):
        super().__init__(name="latentkv-heartbeat", daemon=True)
        self.cfg = cfg

    def run(self) -> None:
        cfg, last_ok = self.cfg, time.monotonic()
        store = None
        while True:
            try:
                if store is None:
                    store = rv.client_store(cfg, min(cfg.timeout_s, 10.0))
                store.set(f"beat/{cfg.rank}", str(time.time()))
                last_ok = time.monotonic()
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as silence
                store = None
                if time.monotonic() - last_ok > cfg.timeout_s:
                    print(
                        f"latentkv worker: rank {cfg.rank}: the head at {cfg.master_addr}:{cfg.master_port} "
                        f"has not answered for {cfg.timeout_s:.0f} s: exiting",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)
            time.sleep(BEAT_S)


class _Server:
    """The serve loop of one worker (see the module docstring)."""

    def __init__(self, cfg: ClusterConfig, store, streamer, group, epoch: int, model: WorkerModel):
        self.cfg, self.store, self.streamer, self.hidden = cfg, store, streamer, model.hidden_size
        self.n_experts = max(model.layers.values())  # sizes the head's fixed-size commands
        # each layer's store, asked for one token's k experts at a time (as the head's own)
        self.stores = {layer: streamer.layer(layer, model.top_k) for layer in streamer.manifest.layers}
        self.lock = threading.Lock()  # the streamer's prefetch (receiver) vs a job's start (main)
        self.inbox: queue.Queue = queue.Queue()
        self.jobs = self.experts_computed = 0
        self.compute_seconds = 0.0
        self.sent_before = self.received_before = 0
        self.send_seconds_before = 0.0
        self._connect(group, epoch)

    def _connect(self, group, epoch: int) -> None:
        self.group, self.epoch = group, epoch
        self.peer = Peer(group, 0, self.cfg.timeout_s)
        threading.Thread(
            target=self._receive, args=(self.peer,), name="latentkv-worker-recv", daemon=True
        ).start()

    def serve(self) -> int:
        while True:
            item = self.inbox.get()
            kind = item[0]
            if kind == Kind.JOBS:
                self._jobs(*item[1:])
            elif kind == Kind.STATS:
                self._stats(item[1])
            elif kind == Kind.EPOCH:
                self._new_epoch(item[1])
            elif kind == Kind.STOP:
                print(f"latentkv worker: rank {self.cfg.rank}: the head ended; exiting", file=sys.stderr)
                return 0
            else:  # "gone"
                print(f"latentkv worker: rank {self.cfg.rank}: lost the head: {item[1]}", file=sys.stderr)
                return 1

    def _receive(self, peer: Peer) -> None:
        """The receiver thread of one group: every message the head sends, as it comes (a
        command's receive is always posted, so the head's sends never wait on this rank)."""
        D, size = self.hidden, HEADER + 2 * self.n_experts
        try:
            while True:
                cmd = peer.recv((size,), torch.int64, TAG_CMD, idle=True)
                kind, seq, layer, a, b, c = cmd[:6].tolist()
                pairs = cmd[HEADER : HEADER + 2 * a].view(a, 2)
                if kind == Kind.JOBS:
                    rows = peer.recv((b, D), torch.float32, TAG_ROWS)
                    self.inbox.put((Kind.JOBS, seq, layer, pairs, rows, bool(c)))
                elif kind == Kind.PREFETCH:
                    with self.lock:
                        self.streamer.prefetch(
                            layer, [e for e in pairs[:, 0].tolist() if self._mine(layer, e)]
                        )
                elif kind in (Kind.STATS, Kind.EPOCH):
                    self.inbox.put((Kind(kind), seq if kind == Kind.STATS else a))
                    if kind == Kind.EPOCH:
                        return
                elif kind == Kind.STOP:
                    self.inbox.put((Kind.STOP,))
                    return
        except Exception as exc:  # noqa: BLE001 - the connection to the head broke
            self.inbox.put(("gone", rv.short(exc)))

    def _mine(self, layer: int, e: int) -> bool:
        return e in self.streamer.config.experts.get(layer, ())

    def _jobs(self, seq: int, layer: int, ids: torch.Tensor, rows: torch.Tensor, first: bool) -> None:
        """Compute each job's expert on its rows (the rows the head's pass gives it, each job's
        in a tensor of its own as `Job.inputs` makes it) and send the outputs in job order, each
        as soon as it and the ones before it are computed (the head posted their receives in
        that order; it weights and adds them). A failure sends its reason, then zeros for the
        outputs not sent, so every posted receive completes."""
        from latentkv.experts.base import Job

        experts, counts = ids[:, 0].tolist(), ids[:, 1].tolist()
        jobs, start = [], 0
        for e, n in zip(experts, counts, strict=True):
            jobs.append(Job(e, torch.arange(start, start + n)))
            start += n
        t0 = time.perf_counter()
        sent, ready, results = 0, {}, None
        try:
            with self.lock:
                results = self.stores[layer].run(rows, jobs)
            for e, y in results:
                ready[e] = y
                while sent < len(experts) and experts[sent] in ready:
                    self.peer.send([(ready.pop(experts[sent]), TAG_OUT)])
                    sent += 1
                self.experts_computed += 1
        except Exception as exc:  # noqa: BLE001 - reported to the head, which fails the request
            msg = text_tensor(f"rank {self.cfg.rank}: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):  # the head is gone too: the receiver notices
                self.peer.send([(header(Kind.ERR, seq, msg.numel()), TAG_MSG), (msg, TAG_MSG)])
                for n in counts[sent:]:
                    self.peer.send([(torch.zeros(n, self.hidden), TAG_OUT)])
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()
        self.jobs += 1
        self.compute_seconds += time.perf_counter() - t0

    def _stats(self, seq: int) -> None:
        import json

        snap = self.streamer.snapshot()
        snap.update(
            rank=self.cfg.rank,
            host=socket.gethostname(),
            jobs=self.jobs,
            experts_computed=self.experts_computed,
            compute_seconds=self.compute_seconds,
            bytes_sent=self.sent_before + self.peer.bytes_sent,
            bytes_received=self.received_before + self.peer.bytes_received,
            net_wait_seconds=self.send_seconds_before + self.peer.send_seconds,
            epoch=self.epoch,
        )
        msg = text_tensor(json.dumps(snap))
        with contextlib.suppress(Exception):  # a lost head: the receiver reports it
            self.peer.send([(header(Kind.STATS_REPLY, seq, msg.numel()), TAG_MSG), (msg, TAG_MSG)])

    def _new_epoch(self, epoch: int) -> None:
        """The head formed a new group (a rank came back): join it."""
        self.sent_before += self.peer.bytes_sent
        self.received_before += self.peer.bytes_received
        self.send_seconds_before += self.peer.send_seconds
        try:
            group = _group(self.cfg, self.store, epoch)
        except Exception as exc:  # noqa: BLE001
            self.inbox.put(("gone", f"could not join epoch {epoch}: {rv.short(exc)}"))
            return
        self._connect(group, epoch)
