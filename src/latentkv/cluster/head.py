"""The head's view of the cluster: who owns which expert, jobs out and outputs back, faults,
rejoins and telemetry (docs/distributed.md).

    cluster = start_head(cfg, facts, ...)        # every rank joined, placement decided
    ex = cluster.exchange(layer, {1: [(e, rows), ...], 2: [...]})
    ... compute the head's own experts ...
    for e, y in cluster.outputs(ex): ...         # each remote expert's output, as it arrives
    cluster.finish(ex)
    cluster.prefetch(layer, {1: [ids], 2: [ids]})

Each worker has a sender thread (messages queued in order: a prefetch never waits for the worker
to finish its current jobs) and two receiver threads: one posts every output receive of an
exchange as the jobs go out and hands each output over as it arrives, the other takes the
worker's other messages (a failure, telemetry). A rank is
*lost* when its connection breaks (a killed process: at once), when it does not answer an
exchange within the cluster timeout, or when its heartbeat in the store is older than that:
the exchange in flight raises `ClusterLost` (the request fails, its session file untouched),
and later ones fail at once, unless the head's own store holds the lost rank's experts, which
it then reads itself (degraded, slower, still exact). A lost rank started again with the same
command says hello again; the monitor checks it, forms a new group with every rank that answers
(a new epoch) and the cluster is whole again.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from latentkv.cluster import rendezvous as rv
from latentkv.cluster.handshake import HeadFacts, Hello, Verdict, head_proof, refusal
from latentkv.cluster.wire import TAG_CMD, TAG_MSG, TAG_OUT, TAG_ROWS, Kind, Peer, command, tensor_text
from latentkv.config import ClusterConfig
from latentkv.errors import Unavailable, UserError

BEAT_S = 2.0  # the monitor's period (heartbeats, rejoins, telemetry)
TELEMETRY_S = 5.0  # the workers' telemetry is refreshed this often
STATS_TIMEOUT_S = 5.0
ABORT_WAIT_S = 10.0  # a refused start-up waits this long for every worker to read its verdict


class ClusterLost(Unavailable):
    """A rank holding experts this pass needs is gone (the message says which and why)."""


@dataclass
class RankState:
    rank: int
    host: str = ""
    status: str = "ok"  # ok | lost
    reason: str = ""
    since: float = 0.0  # when it was lost
    gen: int = 1  # its hello counter at its last accepted hello
    cache_bytes: int = 0
    peer: Peer | None = None
    sender: queue.Queue | None = None  # messages to send, in order (None: stop)
    expect: queue.Queue | None = None  # (seq, [(expert, rows)]): the outputs an exchange waits for
    receivers: list = field(default_factory=list)
    record: dict = field(default_factory=dict)  # its latest telemetry


class Exchange:
    """One layer's remote jobs: outputs are put here by the receiver threads as they arrive."""

    def __init__(self, seq: int, expected: dict[int, set[int]]):
        self.seq = seq
        self.expected = {r: set(ids) for r, ids in expected.items() if ids}
        self.q: queue.Queue = queue.Queue()
        self.wait_seconds = 0.0

    @property
    def pending(self) -> int:
        return sum(len(v) for v in self.expected.values())


class Cluster:
    def __init__(
        self,
        cfg: ClusterConfig,
        store,
        sock,
        facts: HeadFacts,
        plan,
        hidden: int,
        n_experts: int,
        hosts: dict[int, str],
    ):
        self.cfg, self.store, self._sock, self.facts = cfg, store, sock, facts
        self.plan = plan  # the ClusterPlan it started with
        self.hidden, self.n_experts = hidden, n_experts
        placement = self.placement = plan.placement
        budgets = [r.expert_cache_bytes for r in plan.ranks]
        self.max_rows = plan.head.max_num_seqs * (1 + plan.head.draft_tokens)
        self.first_layer = min(placement.owners) if placement.owners else 0
        self.ranks = {
            r: RankState(r, hosts.get(r, ""), cache_bytes=budgets[r]) for r in range(1, cfg.world_size)
        }
        self.takeover: set[int] = set()  # lost ranks whose experts the head reads itself
        self.local_holds = lambda layer, e: False  # set by the store: the head's store has this expert
        self.epoch = 1
        self._lock = threading.RLock()  # one exchange at a time; a rejoin waits for it
        self._state_lock = threading.Lock()  # rank states and the takeover set
        self._seq = 0
        self._current: Exchange | None = None
        self._groups: list = []  # every epoch's group stays referenced (old receivers stay blocked)
        self._peers: list[Peer] = []  # every link of every epoch (the byte counters)
        self._stats_replies: queue.Queue = queue.Queue()
        self._closed = False
        self.tokens = 0
        self.net_wait_seconds = 0.0
        self.lost_events: list[str] = []
        self.history = None  # the head's UsageHistory, when it keeps one

    # --- links ----------------------------------------------------------------------------

    def connect(self, group, members: list[int]) -> None:
        """Start the sender and receiver threads of every worker in `group` (this epoch's)."""
        self._groups.append(group)
        for r in members:
            if r == 0:
                continue
            state = self.ranks[r]
            peer = Peer(group, members.index(r), self.cfg.timeout_s)
            self._peers.append(peer)
            old_sender, old_expect = state.sender, state.expect
            state.peer, state.sender, state.expect = peer, queue.Queue(), queue.Queue()
            for q in (old_sender, old_expect):
                if q is not None:
                    q.put(None)
            threading.Thread(target=self._send_loop, args=(r, peer, state.sender), daemon=True).start()
            state.receivers = [
                threading.Thread(target=self._outputs_loop, args=(r, peer, state.expect), daemon=True),
                threading.Thread(target=self._messages_loop, args=(r, peer), daemon=True),
            ]
            for t in state.receivers:
                t.start()

    def _send_loop(self, r: int, peer: Peer, outbox: queue.Queue) -> None:
        while (parts := outbox.get()) is not None:
            try:
                peer.send(parts)
            except Exception as exc:  # noqa: BLE001 - a send that fails or times out loses the rank
                self._broken(r, peer, f"sending to it failed: {rv.short(exc)}")
                return

    def _outputs_loop(self, r: int, peer: Peer, expect: queue.Queue) -> None:
        """Post every output receive of an exchange at once, hand each output over as it comes."""
        D = self.hidden
        try:
            while (item := expect.get()) is not None:
                seq, jobs = item
                posted = [(e, peer.post((n, D), torch.float32, TAG_OUT)) for e, n in jobs]
                for e, p in posted:
                    self._deliver(r, seq, (e, peer.wait(p, idle=True)))
        except Exception as exc:  # noqa: BLE001 - the connection broke (or this epoch ended)
            self._broken(r, peer, f"its connection broke: {rv.short(exc)}")

    def _messages_loop(self, r: int, peer: Peer) -> None:
        """The worker's other messages: a failed exchange's reason, telemetry."""
        try:
            while True:
                kind, seq, n, *_ = peer.recv((8,), torch.int64, TAG_MSG, idle=True).tolist()
                text = tensor_text(peer.recv((n,), torch.uint8, TAG_MSG))
                if kind == Kind.ERR:
                    self._deliver(r, seq, RuntimeError(text))
                elif kind == Kind.STATS_REPLY:
                    self._stats_replies.put((r, text))
        except Exception as exc:  # noqa: BLE001
            self._broken(r, peer, f"its connection broke: {rv.short(exc)}")

    def _broken(self, r: int, peer: Peer, why: str) -> None:
        """A link failed: the rank is lost, unless that link belongs to an epoch gone by."""
        if self.ranks[r].peer is peer and not self._closed:
            self._lose(r, why)

    def _deliver(self, r: int, seq: int, item) -> None:
        ex = self._current
        if ex is not None and ex.seq == seq:
            ex.q.put((r, item))

    # --- faults -----------------------------------------------------------------------------

    def _lose(self, r: int, why: str) -> None:
        state = self.ranks[r]
        with self._state_lock:
            if state.status == "lost":
                return
            state.status, state.reason, state.since = "lost", why, time.time()
            state.peer = None
            if self._covers(r):
                self.takeover.add(r)
        line = f"rank {r} ({state.host}) is lost: {why}"
        self.lost_events.append(line)
        print(f"latentkv: {line}; {self._lost_advice(r)}", file=sys.stderr, flush=True)
        ex = self._current
        if ex is not None:
            ex.q.put((r, ClusterLost(f"{line}; {self._lost_advice(r)}")))

    def _covers(self, r: int) -> bool:
        """Whether the head's own store holds every expert of rank r."""
        return all(self.local_holds(layer, e) for layer, ids in self.placement.share(r).items() for e in ids)

    def _lost_advice(self, r: int) -> str:
        if r in self.takeover:
            return "the head reads its experts from its own store until it is back (slower)"
        return (
            f"requests fail until it is back: start rank {r} again with the same command (it rejoins), "
            "or restart the whole cluster"
        )

    def owner(self, layer: int, e: int) -> int:
        r = self.placement.owners[layer][e]
        return 0 if r in self.takeover else r

    def status(self) -> dict:
        lost = [s for s in self.ranks.values() if s.status == "lost"]
        serving = all(s.rank in self.takeover for s in lost)
        return {
            "status": "ok" if not lost else "degraded",
            "serving": serving,
            "epoch": self.epoch,
            "reason": "; ".join(f"rank {s.rank} lost: {s.reason}" for s in lost),
            "advice": "; ".join(self._lost_advice(s.rank) for s in lost),
            "ranks": self.cfg.world_size,
            "placement": self.placement.digest,
        }

    # --- exchanges ------------------------------------------------------------------------

    def record(self, layer: int, remote: Sequence[int], rows: int) -> None:
        """A pass of `layer` over `rows` rows routes to the `remote` experts: count the tokens
        (at the first MoE layer) and the routing in the head's usage history (the next start's
        placement reads it; the head's own experts are counted by its streamer)."""
        if layer == self.first_layer:
            self.tokens += rows
        if self.history is not None and remote:
            self.history.record(layer, remote)

    def exchange(
        self, layer: int, jobs: dict[int, list[tuple[int, torch.Tensor]]], first: bool = True
    ) -> Exchange:
        """Send each rank its jobs (expert, rows) of `layer`; the outputs come back into the
        returned Exchange. ClusterLost at once if a rank with jobs is lost."""
        if self._current is not None:  # an exchange its caller dropped without finishing it
            self.finish(self._current)
        self._lock.acquire()  # held until `finish`: a new epoch never starts mid-exchange
        for r in jobs:
            state = self.ranks[r]
            if state.status == "lost":
                self._lock.release()
                raise ClusterLost(f"rank {r} ({state.host}) is lost: {state.reason}; {self._lost_advice(r)}")
        self._seq += 1
        ex = Exchange(self._seq, {r: {e for e, _ in js} for r, js in jobs.items()})
        self._current = ex
        for r, js in jobs.items():
            if not js:
                continue
            pairs = [(e, x.shape[0]) for e, x in js]
            rows = torch.cat([x for _, x in js]) if len(js) > 1 else js[0][1]
            state = self.ranks[r]
            state.expect.put((ex.seq, pairs))  # the output receives are posted before the jobs leave
            cmd = command(self.n_experts, Kind.JOBS, ex.seq, layer, len(js), rows.shape[0], int(first), pairs)
            state.sender.put([(cmd, TAG_CMD), (rows, TAG_ROWS)])
        return ex

    def outputs(self, ex: Exchange, block: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
        """The exchange's outputs (expert, y) as they arrive; with `block` False only those
        already here. ClusterLost if a rank is lost or does not answer within the timeout;
        RuntimeError with a worker's message if its jobs failed."""
        while ex.pending:
            t0 = time.perf_counter()
            try:
                r, item = ex.q.get(block=block, timeout=self.cfg.timeout_s if block else None)
            except queue.Empty:
                if not block:
                    return
                slow = sorted(r for r, ids in ex.expected.items() if ids)
                for r in slow:
                    self._lose(r, f"it did not answer within {self.cfg.timeout_s:.0f} s")
                raise ClusterLost(
                    f"rank {', '.join(map(str, slow))} did not answer within {self.cfg.timeout_s:.0f} s"
                ) from None
            finally:
                if block:
                    waited = time.perf_counter() - t0
                    ex.wait_seconds += waited
                    self.net_wait_seconds += waited
            if isinstance(item, BaseException):
                ex.expected.clear()
                raise item
            e, y = item
            ex.expected[r].discard(e)
            yield e, y

    def finish(self, ex: Exchange) -> None:
        """The exchange is over (its outputs all taken, or given up on an error)."""
        if self._current is ex:
            self._current = None
            self._lock.release()

    def prefetch(self, layer: int, ids: dict[int, Sequence[int]]) -> None:
        for r, es in ids.items():
            state = self.ranks[r]
            if es and state.status == "ok" and state.sender is not None:
                cmd = command(self.n_experts, Kind.PREFETCH, 0, layer, len(es), pairs=[(e, 0) for e in es])
                state.sender.put([(cmd, TAG_CMD)])

    # --- telemetry ------------------------------------------------------------------------

    def refresh(self, timeout_s: float = STATS_TIMEOUT_S) -> list[dict]:
        """Ask every live worker for its telemetry now; the records (lost ranks: their last)."""
        import json

        asked = [s for s in self.ranks.values() if s.status == "ok" and s.sender is not None]
        for s in asked:
            s.sender.put([(command(self.n_experts, Kind.STATS), TAG_CMD)])
        deadline = time.monotonic() + timeout_s
        waiting = {s.rank for s in asked}
        while waiting and time.monotonic() < deadline:
            try:
                r, text = self._stats_replies.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            with contextlib.suppress(ValueError):
                self.ranks[r].record = json.loads(text)
            waiting.discard(r)
        return self.records()

    def records(self) -> list[dict]:
        """Each worker's latest telemetry record, with its status."""
        out = []
        for s in self.ranks.values():
            rec = dict(s.record) or {"rank": s.rank}
            rec.update(rank=s.rank, role="worker", host=s.host or rec.get("host", ""), status=s.status)
            rec["experts"] = sum(len(v) for v in self.placement.share(s.rank).values())
            if s.status == "lost":
                rec["reason"] = s.reason
            out.append(_per_token(rec, self.tokens))
        return out

    def report(self, streamer=None, refresh: bool = True) -> list[dict]:
        """Every rank's telemetry, the head's first (its own share's `streamer`, when it has
        one): hit rate, recall, GB/s read, time waiting on the network and bytes sent, with
        per-token figures over the tokens the head has run."""
        head = dict(streamer.snapshot()) if streamer is not None else {}
        head.update(
            rank=0,
            role="head",
            host=socket.gethostname(),
            status="ok",
            experts=sum(len(v) for v in self.placement.share(0).values()),
            bytes_sent=sum(p.bytes_sent for p in self._peers),
            bytes_received=sum(p.bytes_received for p in self._peers),
            net_wait_seconds=self.net_wait_seconds,
        )
        workers = self.refresh() if refresh else self.records()
        return [_per_token(head, self.tokens), *workers]

    # --- the monitor: heartbeats, rejoins, telemetry ----------------------------------------

    def start_monitor(self) -> None:
        threading.Thread(target=self._monitor, name="latentkv-cluster-monitor", daemon=True).start()

    def _monitor(self) -> None:
        store = rv.client_store(self.cfg, self.cfg.timeout_s)
        last_stats = 0.0
        while not self._closed:
            time.sleep(BEAT_S)
            try:
                self._check_beats(store)
                for s in list(self.ranks.values()):
                    if s.status == "lost" and self._said_hello(store, s):
                        self._rejoin(store, s)
                if time.monotonic() - last_stats > TELEMETRY_S:
                    last_stats = time.monotonic()
                    self.refresh(STATS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the monitor must outlive any one failure
                if not self._closed:
                    print(f"latentkv: cluster monitor: {rv.short(exc)}", file=sys.stderr)

    def _said_hello(self, store, s: RankState) -> bool:
        """Whether rank s has said hello since its last accepted one (it was started again)."""
        return bool(store.check([f"hello/{s.rank}"])) and int(store.get(f"hello/{s.rank}")) > s.gen

    def _check_beats(self, store) -> None:
        now = time.time()
        for s in self.ranks.values():
            if s.status != "ok" or not store.check([f"beat/{s.rank}"]):
                continue
            age = now - float(store.get(f"beat/{s.rank}"))
            if age > self.cfg.timeout_s:
                self._lose(s.rank, f"no heartbeat for {age:.0f} s")

    def _rejoin(self, store, s: RankState) -> None:
        """Rank s said hello again: check it, let it open its share, form a new epoch with it."""
        gen = int(store.get(f"hello/{s.rank}"))
        hello = Hello.from_bytes(store.get(f"hello/{s.rank}/{gen}"))
        s.gen = gen
        why = refusal(hello, self.facts)
        if why is not None:
            rv.put_json(store, f"verdict/{s.rank}/{gen}", Verdict(False, why).__dict__)
            print(f"latentkv: rank {s.rank} came back but was refused: {why}", file=sys.stderr)
            return
        verdict = Verdict(
            True,
            epoch=self.epoch + 1,
            placement=self.placement.to_json(),
            cache_bytes=s.cache_bytes,
            max_rows=self.max_rows,
            proof=head_proof(self.facts.secret, hello.nonce),
        )
        store.set(f"verdict/{s.rank}/{gen}", verdict.to_bytes())
        ready = rv.get_json(store, f"ready/{s.rank}/{gen}", self.cfg.start_timeout_s)
        if not ready.get("ok"):
            print(f"latentkv: rank {s.rank} came back but could not open its experts: {ready.get('reason')}")
            return
        with self._lock:
            self._new_epoch(store, s, hello)

    def _new_epoch(self, store, back: RankState, hello: Hello) -> None:
        epoch = self.epoch + 1
        members = [0] + sorted(r for r, st in self.ranks.items() if st.status == "ok" or r == back.rank)
        rv.put_json(store, f"epoch/{epoch}", {"members": members})
        for r in members[1:]:
            st = self.ranks[r]
            if r != back.rank and st.sender is not None:
                st.sender.put([(command(self.n_experts, Kind.EPOCH, a=epoch), TAG_CMD)])
        group = rv.make_group(store, epoch, members, 0, rv.local_address(self.cfg), self.cfg.timeout_s)
        self.epoch = epoch
        self.connect(group, members)
        with self._state_lock:
            back.status, back.reason, back.host = "ok", "", hello.host
            self.takeover.discard(back.rank)
        print(
            f"latentkv: rank {back.rank} ({hello.host}) is back: the cluster is whole (epoch {epoch})",
            file=sys.stderr,
        )

    def close(self, wait_s: float = 5.0) -> None:
        """Tell every worker the head is ending and wait (at most `wait_s`) until they have
        closed their connections, so no receive is left pending at exit; close the store."""
        if self._closed:
            return
        self._closed = True
        for s in self.ranks.values():
            if s.sender is not None:
                if s.status == "ok":
                    s.sender.put([(command(self.n_experts, Kind.STOP), TAG_CMD)])
                s.sender.put(None)
            if s.expect is not None:
                s.expect.put(None)
        deadline = time.monotonic() + wait_s
        for s in self.ranks.values():
            for t in s.receivers:
                t.join(max(0.0, deadline - time.monotonic()))
        if self._sock is not None:
            self._sock.close()


def start_head(cfg: ClusterConfig, facts: HeadFacts, hidden: int, n_experts: int, plan_for):
    """Open the store, take every worker's hello, decide the placement (`plan_for(hellos,
    placement or None)` -> ClusterPlan), answer, wait until every worker has opened its share,
    form the first group. UserError (one line) if a rank is refused, missing or fails. The
    caller starts the monitor (`Cluster.start_monitor`) once it is ready to serve."""
    store, sock = rv.open_store(cfg)
    try:
        return _start(cfg, store, sock, facts, hidden, n_experts, plan_for)
    except BaseException:
        sock and sock.close()
        raise


def _start(cfg: ClusterConfig, store, sock, facts: HeadFacts, hidden: int, n_experts: int, plan_for):
    store.set("challenge", facts.challenge)
    workers = list(range(1, cfg.world_size))
    try:
        rv.wait(store, [f"hello/{r}" for r in workers], cfg.start_timeout_s)
    except TimeoutError:
        missing = [r for r in workers if not store.check([f"hello/{r}"])]
        raise UserError(
            f"ranks {', '.join(map(str, missing))} did not join within {cfg.start_timeout_s:.0f} s: start "
            f"`torchrun --nnodes ... --node-rank R` on every machine with the same MASTER_ADDR:MASTER_PORT"
        ) from None
    gens = {r: int(store.get(f"hello/{r}")) for r in workers}
    hellos = {r: Hello.from_bytes(store.get(f"hello/{r}/{gens[r]}")) for r in workers}
    refused = {r: why for r in workers if (why := refusal(hellos[r], facts)) is not None}
    if refused:
        first = next(iter(refused.values()))
        _abort(store, workers, gens, refused, f"rank {next(iter(refused))} was refused: {first}")
        raise UserError(f"rank {next(iter(refused))} refused: {first}")
    try:
        plan = plan_for(hellos, adopted_placement(hellos))
    except ValueError as exc:
        _abort(store, workers, gens, {}, str(exc))
        raise UserError(str(exc)) from None
    budgets = [r.expert_cache_bytes for r in plan.ranks]
    max_rows = plan.head.max_num_seqs * (1 + plan.head.draft_tokens)
    for r in workers:
        verdict = Verdict(
            True,
            epoch=1,
            placement=plan.placement.to_json(),
            cache_bytes=budgets[r],
            max_rows=max_rows,
            proof=head_proof(facts.secret, hellos[r].nonce),
        )
        store.set(f"verdict/{r}/{gens[r]}", verdict.to_bytes())
    for r in workers:
        ready = rv.get_json(store, f"ready/{r}/{gens[r]}", cfg.start_timeout_s)
        if not ready.get("ok"):
            rv.put_json(store, "epoch/1", {"members": [], "abort": ready.get("reason", f"rank {r} failed")})
            raise UserError(f"rank {r} could not open its experts: {ready.get('reason')}")
    members = [0, *workers]
    rv.put_json(store, "epoch/1", {"members": members})
    group = rv.make_group(store, 1, members, 0, rv.local_address(cfg), cfg.start_timeout_s)
    cluster = Cluster(
        cfg, store, sock, facts, plan, hidden, n_experts, {r: h.host for r, h in hellos.items()}
    )
    for r in workers:
        cluster.ranks[r].gen = gens[r]
    cluster.connect(group, members)
    return cluster


def _per_token(rec: dict, tokens: int) -> dict:
    """`rec` with its per-token figures over `tokens` (the tokens the head ran)."""
    rec["tokens"] = tokens
    rec["bytes_sent_per_token"] = rec.get("bytes_sent", 0) / tokens if tokens else 0.0
    rec["net_wait_ms_per_token"] = 1e3 * rec.get("net_wait_seconds", 0.0) / tokens if tokens else 0.0
    return rec


def describe(records: list[dict]) -> list[str]:
    """One line per rank for people (the stats lines of generate, chat, bench)."""
    lines = []
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"rank {r['rank']} ({r.get('host', '')}): lost: {r.get('reason', '')}")
            continue
        lines.append(
            f"rank {r['rank']} ({r.get('role', 'worker')}, {r.get('experts', 0)} experts): hit rate "
            f"{r.get('hit_rate', 0.0):.1%}, prefetch recall {r.get('recall', 0.0):.1%}, "
            f"{r.get('read_gbps', 0.0):.2f} GB/s read, network wait {r['net_wait_ms_per_token']:.2f} ms/token, "
            f"sent {r['bytes_sent_per_token'] / 1024:.1f} KiB/token"
        )
    return lines


def adopted_placement(hellos: dict[int, Hello]):
    """The placement the workers' shares were written for (they must agree), or None."""
    from latentkv.experts.placement import Placement

    found = {r: Placement.from_json(h.share, f"rank {r}'s share") for r, h in hellos.items() if h.share}
    digests = {p.digest for p in found.values()}
    if len(digests) > 1:
        raise ValueError(
            "the workers' shares were written for different placements ("
            + ", ".join(f"rank {r}: {p.digest}" for r, p in sorted(found.items()))
            + "): convert each rank's share from one placement file"
        )
    return next(iter(found.values()), None)


def _abort(store, workers: list[int], gens: dict[int, int], refused: dict[int, str], why: str) -> None:
    for r in workers:
        reason = refused.get(r, f"the cluster did not start: {why}")
        store.set(f"verdict/{r}/{gens[r]}", Verdict(False, reason).to_bytes())
    rv.put_json(store, "epoch/1", {"members": [], "abort": why})
    # the workers read their verdicts before the store closes with this process
    with contextlib.suppress(TimeoutError, rv.StoreGone):
        rv.wait(store, [f"seen/{r}/{gens[r]}" for r in workers], ABORT_WAIT_S)


def new_facts(version: str, fingerprint: str, model: str, expert_format: str, placement, secret) -> HeadFacts:
    return HeadFacts(version, fingerprint, model, expert_format, placement, secret, secrets.token_hex(16))


def hostname() -> str:
    return socket.gethostname()
