"""Load test for `latentkv serve`: N concurrent streaming clients for a fixed number of requests.

Against a running server:

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --clients 1,8 --requests 32

or starting one server per --max-num-seqs value (each on a free loopback port):

    python benchmarks/load_test.py --serve builtin:tiny --max-num-seqs 1,8 --clients 1,8 \\
        --requests 128 --max-tokens 64 --out benchmarks/results/load-tiny.json

Every request streams /v1/completions with a token-id prompt of --prompt-len random ids (its
own seed), greedy, `ignore_eos` so it generates exactly --max-tokens. A round runs --requests
requests for one --clients value; with --rounds N the clients values take turns N times, so a
slow spell of a shared machine hits them alike. Per row: aggregate tok/s (completion tokens of
a round's requests / its wall time; the median round's), per-request decode tok/s, time to
first token and latency percentiles (p50/p90/p99, over every round), and errors. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0  # seconds to the first generated token's chunk
    latency: float = 0.0  # seconds to [DONE]
    tokens: int = 0  # completion tokens (the usage chunk)
    error: str = ""


@dataclass
class Row:
    max_num_seqs: int | None
    clients: int
    requests: int
    errors: int
    wall_s: float
    tokens: int
    tok_s: float
    per_request_tok_s: float
    ttft_ms: dict = field(default_factory=dict)
    latency_ms: dict = field(default_factory=dict)
    error_examples: list = field(default_factory=list)
    round_tok_s: list = field(default_factory=list)  # each round's tok/s (tok_s is their median)


async def one_request(client: httpx.AsyncClient, args, seed: int) -> Sample:
    rng = random.Random(seed)
    body = {
        "model": args.model,
        "prompt": [rng.randrange(2, args.vocab) for _ in range(args.prompt_len)],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    sample = Sample(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                sample.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                if not sample.ttft:
                    sample.ttft = time.perf_counter() - t0
                # Parse only what is read (errors, the usage chunk): the client shares the CPUs.
                if data.startswith('{"error"') or '"usage":{' in data:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        sample.error = chunk["error"].get("message", "error")
                        return sample
                    sample.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    sample.latency = time.perf_counter() - t0
    sample.ok = sample.tokens > 0
    if not sample.ok:
        sample.error = "no usage chunk"
    return sample


async def run_load(args, url: str, clients: int) -> tuple[list[Sample], float]:
    """One round: args.requests requests from `clients` concurrent clients -> (samples, wall s)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        # warm-up, not counted: one request per client at once, so the row's first timed steps
        # do not pay for the server's first batched step at this concurrency
        await asyncio.gather(*(one_request(client, args, seed=-1 - c) for c in range(clients)))
        todo = iter(range(args.requests))
        samples: list[Sample] = []

        async def worker() -> None:
            for i in todo:
                samples.append(await one_request(client, args, seed=i))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return samples, time.perf_counter() - t0


def make_row(max_num_seqs: int | None, clients: int, rounds: list[tuple[list[Sample], float]]) -> Row:
    """One row from a clients value's rounds: tok/s is the median round's; the latency
    percentiles and errors are over every request of every round."""
    samples = [s for round_samples, _ in rounds for s in round_samples]
    ok = [s for s in samples if s.ok]
    per_round = [sum(s.tokens for s in r if s.ok) / wall if wall else 0.0 for r, wall in rounds]
    decode = [(s.tokens - 1) / (s.latency - s.ttft) for s in ok if s.tokens > 1 and s.latency > s.ttft]
    return Row(
        max_num_seqs=max_num_seqs,
        clients=clients,
        requests=len(samples),
        errors=len(samples) - len(ok),
        wall_s=round(sum(wall for _, wall in rounds), 3),
        tokens=sum(s.tokens for s in ok),
        tok_s=round(statistics.median(per_round), 2),
        per_request_tok_s=round(sum(decode) / len(decode), 2) if decode else 0.0,
        ttft_ms=percentiles([s.ttft * 1e3 for s in ok]),
        latency_ms=percentiles([s.latency * 1e3 for s in ok]),
        error_examples=sorted({s.error for s in samples if not s.ok})[:3],
        round_tok_s=[round(t, 2) for t in per_round],
    )


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 1)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


# --- starting servers ---------------------------------------------------------------------------


def start_server(args, max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "latentkv.cli", "serve", args.serve, "--port", str(port)]
    cmd += ["--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *args.serve_flags.split()]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    restore = None if args.all_cpus is None else (lambda: os.sched_setaffinity(0, args.all_cpus))
    process = subprocess.Popen(cmd, stderr=subprocess.DEVNULL if args.quiet else None, preexec_fn=restore)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not come up in 10 minutes")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


# --- output -------------------------------------------------------------------------------------


def table(rows: list[Row], baseline: dict[int | None, float]) -> str:
    head = (
        f"{'max-num-seqs':>12} {'clients':>7} {'reqs':>5} {'errors':>6} {'tok/s':>8} {'x1':>5} "
        f"{'req tok/s':>9} {'TTFT p50/p90/p99 ms':>22} {'latency p50/p90/p99 ms':>25}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        base = baseline.get(r.max_num_seqs)
        speedup = f"{r.tok_s / base:.2f}" if base else "-"
        ttft = "/".join(_ms(r.ttft_ms[k]) for k in ("p50", "p90", "p99"))
        lat = "/".join(_ms(r.latency_ms[k]) for k in ("p50", "p90", "p99"))
        seqs = "-" if r.max_num_seqs is None else str(r.max_num_seqs)
        lines.append(
            f"{seqs:>12} {r.clients:>7} {r.requests:>5} {r.errors:>6} {r.tok_s:>8.1f} {speedup:>5} "
            f"{r.per_request_tok_s:>9.1f} {ttft:>22} {lat:>25}"
        )
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--serve", metavar="MODEL", help="start `latentkv serve MODEL` per --max-num-seqs value"
    )
    p.add_argument("--max-num-seqs", type=_ints, default=[8], help="with --serve: comma list (default: 8)")
    p.add_argument("--serve-flags", default="", help="more flags for `latentkv serve` (one string)")
    p.add_argument(
        "--clients", type=_ints, default=[1, 8], help="concurrent clients, comma list (default: 1,8)"
    )
    p.add_argument("--requests", type=int, default=32, help="requests per round (default: 32)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per server: each runs every --clients value in turn; a row's tok/s is the "
        "median round's (default: 1)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default: 32)")
    p.add_argument(
        "--vocab", type=int, default=256, help="prompt ids are drawn from 2..vocab-1 (default: 256)"
    )
    p.add_argument("--model", default=None, help="the `model` field (default: left out)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LATENTKV_API_KEY"),
        help="bearer key (default: $LATENTKV_API_KEY)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--quiet", action="store_true", help="hide the started servers' logs")
    p.add_argument(
        "--client-cpus",
        type=_ints,
        default=None,
        help="run this load generator on these CPUs only (Linux), e.g. 0 to keep it off the CPU "
        "`latentkv serve` gives its engine process on a 2-CPU machine, as clients on other machines "
        "would be (default: any CPU)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests must be at least 1")
    args.all_cpus = None
    if args.client_cpus:
        args.all_cpus = os.sched_getaffinity(0)  # the servers it starts get every CPU back
        os.sched_setaffinity(0, args.client_cpus)

    rows: list[Row] = []
    for seqs in [None] if args.url else args.max_num_seqs:
        process, url = (None, args.url) if args.url else start_server(args, seqs)
        try:
            rounds: dict[int, list] = {clients: [] for clients in args.clients}
            for r in range(args.rounds):  # the clients values take turns: slow spells hit them alike
                for clients in args.clients:
                    samples, wall = asyncio.run(run_load(args, url, clients))
                    rounds[clients].append((samples, wall))
                    tokens = sum(s.tokens for s in samples if s.ok)
                    print(
                        f"max-num-seqs {seqs}, {clients} clients, round {r + 1}/{args.rounds}: "
                        f"{tokens / wall:.1f} tok/s, {sum(not s.ok for s in samples)} errors",
                        file=sys.stderr,
                    )
            rows += [make_row(seqs, clients, rounds[clients]) for clients in args.clients]
        finally:
            if process is not None:
                stop_server(process)
    baseline = {r.max_num_seqs: r.tok_s for r in rows if r.clients == 1}
    print(table(rows, baseline))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "api_key", "all_cpus")}
        args.out.write_text(
            json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
        )
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
