"""Soak: `latentkv serve --ram-gb` for a long while under faults, held to what docs/reliability.md
promises. Not in `make test`, and not a speed benchmark (run it niced).

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak.json

What it does:
- starts `latentkv serve builtin:fixture --ram-gb G` with G planned so that the expert cache holds
  a quarter of the experts (`latentkv plan`: dense + KV pool + activations + working set + 1/4 of
  the expert bytes), its expert store in a fresh LATENTKV_CACHE, sessions in a fresh --kv-dir;
- runs --clients concurrent clients, each a conversation in a session: every turn streams
  /v1/completions with the conversation so far plus a few new token ids, greedy, `ignore_eos`;
  a conversation that would outgrow --max-model-len starts a new session;
- at a third of the time damages every expert of one MoE layer on disk, at half repairs the store
  with the command the errors name, at two thirds SIGKILLs the engine process.

What it checks, and prints as a table (and writes as JSON):
- every request is answered (a finished stream) or refused with its reason (an HTTP error in
  OpenAI's shape, or an error event in the stream): never a 500, a dropped connection, a
  stream without [DONE];
- 0 lost committed turns: a turn whose stream finished is in its session file; each next turn
  of the conversation resumes it (`cached_tokens`), and at the end every session file holds the
  conversation's last committed turn, token for token;
- 0 tracebacks in the server's log;
- memory flat: each process's resident memory at its end within 5% of what it was after its
  warm-up (--warmup-minutes): the HTTP process over the whole run, the first engine process
  until its SIGKILL, the one started again from its own warm-up to the end;
- /health 503 while the store is damaged and 200 again after the repair, with no restart; the
  engine process started again by the server after its SIGKILL.

Time is counted on a clock that stops while this process is stopped (SIGSTOP, a suspended
machine): a pause is not taken for a hang, and the schedule, the 120 s a request may go without
a stream line and the memory samples' times all skip it. The pauses are listed in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

MODEL = "builtin:fixture"
RSS_LIMIT = 0.05  # resident at the end within 5% of resident after the warm-up
SILENCE_S = 120.0  # a request that gets no stream line for this long (live time) hangs
PAUSE_S = 5.0  # a gap this long between two ticks of the live clock is a pause, not work


class LiveClock:
    """Seconds since the start, less the time this process was stopped. A ticker notes each
    gap between ticks longer than PAUSE_S as a pause; `now` notices one not yet ticked."""

    def __init__(self, tick: float = 0.5):
        self.t0 = self.last = time.monotonic()
        self.tick = tick
        self.pauses: list[tuple[float, float]] = []  # (live time it began, seconds)

    def now(self) -> float:
        wall = time.monotonic()
        if wall - self.last > PAUSE_S:
            self.pauses.append(
                (round(self.last - self.t0 - self.paused, 1), round(wall - self.last - self.tick, 1))
            )
        self.last = wall
        return wall - self.t0 - self.paused

    @property
    def paused(self) -> float:
        return sum(s for _, s in self.pauses)

    async def run(self) -> None:
        while True:
            self.now()
            await asyncio.sleep(self.tick)

    async def sleep_until(self, t: float) -> None:
        while self.now() < t:
            await asyncio.sleep(min(1.0, max(0.05, t - self.now())))


@dataclass
class Tally:
    ok: int = 0  # streams that finished (a committed turn)
    refused: dict[str, int] = field(default_factory=dict)  # "HTTP 503 expert_store_damaged" -> count
    bad: list[str] = field(default_factory=list)  # anything else: a 500, a dropped connection, ...
    lost_turns: list[str] = field(default_factory=list)
    sessions: dict[str, list[int]] = field(default_factory=dict)  # session -> its committed rows

    def refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1


@dataclass
class Events:
    damaged_at: float | None = None
    degraded_health: bool = False  # /health said 503 expert_store_damaged while damaged
    repaired_at: float | None = None
    healthy_again_s: float | None = None  # seconds from the repair to /health 200
    killed_at: float | None = None
    engine_back_s: float | None = None  # seconds from the kill to /health 200
    engine_restarted: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def latentkv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "latentkv", *args], capture_output=True, text=True, env=env, check=False
    )


def quarter_budget(args, env: dict) -> tuple[float, dict]:
    """--ram-gb G whose expert cache holds a quarter of the experts, and the plan's numbers."""
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.clients)]
    done = latentkv("plan", MODEL, "--ram-gb", "64", *flags, "--json", env=env)
    plan = json.loads(done.stdout)
    need = sum(plan[k] for k in ("dense_bytes", "kv_bytes", "activation_bytes", "working_bytes"))
    ram = need + plan["expert_bytes"] // 4
    check = json.loads(
        latentkv("plan", MODEL, "--ram-gb", f"{ram / 2**30:.6f}", *flags, "--json", env=env).stdout
    )
    return ram / 2**30, {"cached_experts": check["cached_experts"], "experts_total": check["experts_total"]}


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def engine_pid(server: int) -> int | None:
    for pid in children(server):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def turn(
    http: httpx.AsyncClient, clock: LiveClock, session: str, prompt: list[int], tokens: int
) -> tuple[str, dict]:
    """One streamed turn: ("ok", {"tokens", "cached"}), ("refused", {"why"}) or ("bad", {"why"}).
    "bad" too when SILENCE_S pass (live time) without a stream line."""
    seen = {"lines": 0, "at": clock.now()}
    task = asyncio.create_task(_turn(http, clock, seen, session, prompt, tokens))
    while not task.done():
        await asyncio.wait({task}, timeout=1.0)
        if not task.done() and clock.now() - seen["at"] > SILENCE_S:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return "bad", {"why": f"no stream line for {SILENCE_S:.0f} s after {seen['lines']} lines"}
    return task.result()


async def _turn(
    http: httpx.AsyncClient, clock: LiveClock, seen: dict, session: str, prompt: list[int], tokens: int
) -> tuple[str, dict]:
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "session": session,
    }
    try:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            seen["at"] = clock.now()
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                try:
                    error = json.loads(text)["error"]
                    assert error["message"]
                except (ValueError, KeyError, TypeError, AssertionError):
                    return "bad", {"why": f"HTTP {reply.status_code} without an error body: {text[:200]}"}
                if reply.status_code >= 500 and reply.status_code != 503:
                    return "bad", {"why": f"HTTP {reply.status_code}: {error['message'][:200]}"}
                return "refused", {"why": f"HTTP {reply.status_code} {error.get('code')}"}
            got, cached, finish, done, error = [], None, None, False, None
            async for line in reply.aiter_lines():
                seen["lines"], seen["at"] = seen["lines"] + 1, clock.now()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                for choice in chunk.get("choices", []):
                    got += [int(t.split(":")[1]) for t in (choice.get("logprobs") or {}).get("tokens", [])]
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, OSError) as exc:
        return "bad", {"why": f"{type(exc).__name__} after {seen['lines']} stream lines: {exc}"}
    if not done:
        return "bad", {"why": "the stream ended without [DONE]"}
    if error is not None:
        if not error.get("message"):
            return "bad", {"why": f"an error event without a message: {error}"}
        return "refused", {"why": f"stream error {error.get('code')}"}
    if finish not in ("length", "stop") or len(got) != tokens or cached is None:
        return "bad", {"why": f"finished {finish!r} with {len(got)} tokens, usage {cached}"}
    return "ok", {"tokens": got, "cached": cached}


async def client(k: int, url: str, args, clock: LiveClock, deadline: float, tally: Tally) -> None:
    """One conversation after another, each in its own session, until the deadline (live time)."""
    rng = random.Random(k)
    # no read timeout of httpx's own (its clock does not skip pauses): `turn` watches for silence
    http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0, read=None))
    conversation, committed, resumable = 0, [], 0
    session = f"soak-{k}-0"
    try:
        while clock.now() < deadline:
            new = [rng.randrange(3, 4000) for _ in range(rng.randrange(4, 24))]
            if len(committed) + len(new) + args.tokens > args.max_model_len:
                conversation, committed, resumable = conversation + 1, [], 0
                session = f"soak-{k}-{conversation}"
            prompt = committed + new
            kind, info = await turn(http, clock, session, prompt, args.tokens)
            if kind == "ok":
                if info["cached"] < resumable:
                    tally.lost_turns.append(
                        f"{session}: resumed {info['cached']} tokens, {resumable} were committed"
                    )
                tally.ok += 1
                committed = prompt + info["tokens"]
                resumable = len(committed) - 1  # the last sampled token has no row yet
                tally.sessions[session] = committed[:resumable]
            elif kind == "refused":
                tally.refuse(info["why"])
                await asyncio.sleep(rng.uniform(0.5, 2.0))
            else:
                tally.bad.append(
                    f"at {clock.now():.0f} s, {session} turn of {len(prompt)} tokens: {info['why']}"
                )
                await asyncio.sleep(1.0)
    finally:
        await http.aclose()


def damage(store: Path, layer: int) -> None:
    """Flip one byte inside every expert of `layer`, in place."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from latentkv.experts.store_file import read_manifest

    entry = read_manifest(store).layers[layer]
    with open(store / entry.file, "r+b") as f:
        for e in entry.held:
            f.seek(entry.offset(e) + 64)
            byte = f.read(1)
            f.seek(entry.offset(e) + 64)
            f.write(bytes([byte[0] ^ 0x20]))


async def health(url: str) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.get("/health")
        return r.status_code, (
            r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        )


async def health_or_none(url: str) -> tuple[int | None, dict]:
    """(status, body) of /health, or (None, {}) when it did not answer (a pause can time it out)."""
    try:
        return await health(url)
    except httpx.HTTPError:
        return None, {}


async def wait_healthy(url: str, limit_s: float, clock: LiveClock | None = None) -> float | None:
    clock = clock or LiveClock()
    t0 = clock.now()
    while clock.now() - t0 < limit_s:
        if (await health_or_none(url))[0] == 200:
            return clock.now() - t0
        await asyncio.sleep(0.5)
    return None


async def faults(
    url: str, server: subprocess.Popen, store: Path, env: dict, clock: LiveClock, total: float, ev: Events
):
    """Damage at 1/3, repair at 1/2, kill the engine at 2/3 (live time)."""
    await clock.sleep_until(total / 3)
    await asyncio.to_thread(damage, store, 2)  # off the event loop: the live clock keeps ticking
    ev.damaged_at = clock.now()
    repair = None
    while clock.now() < total / 2:
        status, body = await health_or_none(url)
        if status == 503 and body.get("error", {}).get("code") == "expert_store_damaged":
            ev.degraded_health = True
            repair = body["error"]["message"].split("repair it with `")[1].split("`")[0]
        await asyncio.sleep(2.0)
    if repair is None:  # never noticed (every damaged expert stayed cached): repair all the same
        repair = f"latentkv experts convert {MODEL} --out {store} --force"
    done = await asyncio.to_thread(latentkv, *repair.split()[1:], env=env)
    if done.returncode:
        raise SystemExit(f"the repair failed: {done.stderr[-2000:]}")
    ev.repaired_at = clock.now()
    ev.healthy_again_s = await wait_healthy(url, 120, clock)
    await clock.sleep_until(2 * total / 3)
    before = engine_pid(server.pid)
    os.kill(before, signal.SIGKILL)
    ev.killed_at = clock.now()
    await asyncio.sleep(1.0)
    ev.engine_back_s = await wait_healthy(url, 300, clock)
    if ev.engine_back_s is not None:
        ev.engine_back_s += 1.0
    after = engine_pid(server.pid)
    ev.engine_restarted = after is not None and after != before


async def sample_memory(server: subprocess.Popen, clock: LiveClock, until: float, series: list) -> None:
    while clock.now() < until:
        engine = engine_pid(server.pid)
        http_rss, engine_rss = rss(server.pid), rss(engine) if engine else 0
        series.append({"t_s": round(clock.now(), 1), "http": http_rss, "engine": engine_rss, "pid": engine})
        await clock.sleep_until(clock.now() + 30)


def drifts(series: list[dict], warmup_s: float, end: dict) -> dict:
    """Resident memory after the warm-up against the end, per process: the HTTP process over the
    whole run, each engine process (the one started again after the SIGKILL has a fresh heap)
    from its own warm-up to its last sample."""
    samples = [*series, end]
    out = {"http": _drift(samples, "http", lambda x: True, samples[0]["t_s"] + warmup_s)}
    for k, pid in enumerate(dict.fromkeys(x["pid"] for x in samples if x["pid"])):
        mine = lambda x, pid=pid: x["pid"] == pid  # noqa: E731
        first = next(x["t_s"] for x in samples if mine(x))
        out[f"engine {k + 1}"] = _drift(samples, "engine", mine, first + warmup_s)
    return out


def _drift(samples: list[dict], key: str, mine, after_s: float) -> dict | None:
    ours = [x for x in samples if mine(x)]
    warm = next((x for x in ours if x["t_s"] >= after_s), None)
    if warm is None or warm is ours[-1]:
        return None  # too short-lived to judge
    last = ours[-1]
    return {
        "warm_s": warm["t_s"],
        "warm": warm[key],
        "end_s": last["t_s"],
        "end": last[key],
        "drift": round(last[key] / warm[key] - 1, 4),
    }


async def soak(args, url: str, server: subprocess.Popen, store: Path, env: dict) -> dict:
    tally, ev, series = Tally(), Events(), []
    clock = LiveClock()
    ticker = asyncio.create_task(clock.run())
    total = args.minutes * 60
    tasks = [asyncio.create_task(client(k, url, args, clock, total, tally)) for k in range(args.clients)]
    tasks.append(asyncio.create_task(faults(url, server, store, env, clock, total, ev)))
    memory = asyncio.create_task(sample_memory(server, clock, total, series))
    await asyncio.gather(*tasks)
    engine = engine_pid(server.pid)
    end = {
        "t_s": round(clock.now(), 1),
        "http": rss(server.pid),
        "engine": rss(engine),
        "pid": engine,
    }
    memory.cancel()
    ticker.cancel()
    return {"tally": tally, "events": ev, "series": series, "end": end, "pauses": clock.pauses}


def check_files(kv_dir: Path, sessions: dict[str, list[int]]) -> list[str]:
    """Every session file holds its conversation's last committed turn, token for token."""
    from latentkv.kv.store import KVFile

    lost = []
    for name, rows in sessions.items():
        with KVFile.open(kv_dir / f"{name}.kv") as f:
            held = f.load().tokens
        if held[: len(rows)] != rows:
            lost.append(f"{name}: the file holds {len(held)} tokens, not the {len(rows)} committed")
    return lost


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=3.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--max-model-len", type=int, default=384)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import latentkv.experts.store_file  # noqa: F401  (imported now, not during the soak: `damage`)

    root = Path(tempfile.mkdtemp(prefix="latentkv-soak-"))
    env = {**os.environ, "LATENTKV_CACHE": str(root / "cache")}
    ram_gb, share = quarter_budget(args, env)
    port = free_port()
    log = root / "server.log"
    cmd = [sys.executable, "-m", "latentkv", "serve", MODEL, "--port", str(port), "--ram-gb", f"{ram_gb:.6f}"]
    cmd += ["--max-num-seqs", str(args.clients), "--max-model-len", str(args.max_model_len)]
    cmd += ["--threads", str(args.threads), "--kv-dir", str(root / "sessions"), "--log-level", "warning"]
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        if asyncio.run(wait_healthy(url, 600)) is None:
            raise SystemExit(f"the server did not come up:\n{log.read_text()[-3000:]}")
        (store,) = (root / "cache" / "experts").iterdir()
        got = asyncio.run(soak(args, url, server, store, env))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    tally, ev = got["tally"], got["events"]
    lost_files = check_files(root / "sessions", tally.sessions)
    text = log.read_text(errors="replace")
    memory = drifts(got["series"], args.warmup_minutes * 60, got["end"])
    judged = [m for m in memory.values() if m is not None]
    result = {
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "server": " ".join(cmd[1:]).replace(str(root), "$ROOT"),
        "commit": machine.commit(),
        "machine": {"cpu": machine.cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "minutes": args.minutes,
        "clients": args.clients,
        "ram_gb": round(ram_gb, 4),
        "cached_experts": share["cached_experts"],
        "experts_total": share["experts_total"],
        "committed_turns": tally.ok,
        "refused": tally.refused,
        "bad": len(tally.bad),
        "bad_examples": tally.bad[:10],
        "lost_committed_turns": len(tally.lost_turns) + len(lost_files),
        "lost_examples": (tally.lost_turns + lost_files)[:10],
        "sessions": len(tally.sessions),
        "tracebacks": text.count("Traceback"),
        "log_lines": len(text.splitlines()),
        "events": asdict(ev),
        "pauses": [{"at_s": at, "seconds": sec} for at, sec in got["pauses"]],
        "memory": memory,
        "rss_series": got["series"],
    }
    result["passed"] = bool(
        result["bad"] == 0
        and result["lost_committed_turns"] == 0
        and result["tracebacks"] == 0
        and len(judged) >= 2
        and all(abs(m["drift"]) <= RSS_LIMIT for m in judged)
        and ev.degraded_health
        and ev.healthy_again_s is not None
        and ev.engine_restarted
        and ev.engine_back_s is not None
    )
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["passed"] else 1


def table(r: dict) -> str:
    ev = r["events"]
    refused = ", ".join(f"{n} {why}" for why, n in sorted(r["refused"].items())) or "none"
    rows = [
        ("duration", f"{r['minutes']:g} min, {r['clients']} clients streaming, resuming sessions"),
        (
            "paused (not counted)",
            f"{len(r['pauses'])} times, {sum(p['seconds'] for p in r['pauses']):.0f} s in all",
        ),
        ("expert cache", f"{r['cached_experts']} of {r['experts_total']} experts (--ram-gb {r['ram_gb']})"),
        ("committed turns", f"{r['committed_turns']} in {r['sessions']} sessions"),
        ("refused with a reason", refused),
        ("unanswered or 500", str(r["bad"])),
        ("lost committed turns", str(r["lost_committed_turns"])),
        ("tracebacks in the log", f"{r['tracebacks']} ({r['log_lines']} lines)"),
        (
            "expert damage",
            f"at {ev['damaged_at']:.0f} s; /health 503 while damaged: {ev['degraded_health']}; repaired at "
            f"{ev['repaired_at']:.0f} s, /health 200 {ev['healthy_again_s']:.1f} s later (no restart)"
            if ev["repaired_at"] is not None and ev["healthy_again_s"] is not None
            else str(ev),
        ),
        (
            "engine SIGKILL",
            f"at {ev['killed_at']:.0f} s; started again: {ev['engine_restarted']}, serving "
            f"{ev['engine_back_s']:.1f} s later"
            if ev["engine_back_s"] is not None
            else str(ev),
        ),
        ("resident memory", "; ".join(_memory_line(k, m) for k, m in r["memory"].items())),
        ("passed", str(r["passed"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _memory_line(name: str, m: dict | None) -> str:
    if m is None:
        return f"{name}: too short-lived to judge"
    return (
        f"{name} {m['warm'] / 2**20:.0f} MiB at {m['warm_s']:.0f} s -> {m['end'] / 2**20:.0f} MiB at "
        f"{m['end_s']:.0f} s ({m['drift']:+.1%})"
    )


if __name__ == "__main__":
    sys.exit(main())
