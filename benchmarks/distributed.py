"""Experts over 1, 2 and 3 ranks on this machine, each rank modelling a machine of its own
(issue 23; docs/distributed.md): tok/s, per-rank hit rate, recall, GB/s, network bytes and wait
per token, and the share of the bound.

    # the model (once, ~9 GB): benchmarks/build_expert_model.py
    .venv/bin/python benchmarks/distributed.py ~/.cache/latentkv/experts-bench --ranks 1,2,3 \\
        --out benchmarks/results/distributed.json

Each rank is a process started as torchrun would start it (torch's env:// variables): the workers
run `latentkv generate` (a worker serves the head until it ends), the head is this script's
measurement (load, prefill --context tokens, then time --decode-tokens greedy steps and take every
rank's telemetry over them); each rank runs in

- its own memory cgroup (v1 limit_in_bytes, page cache counted) limited to its plan, the same
  `--ram-gb` for every rank (by default the budget in which one rank alone caches 1/4 of all
  experts), plus --margin-mib;
- its own blkio throttle on the disk (v1 blkio.throttle.read_bps_device): each rank reads at
  1/--read-share of the disk's measured O_DIRECT speed, so N ranks have N disks' worth. The head's
  throttle starts once its dense weights are loaded (they are read once, not per token);
- its own network namespace, joined to the others by a veth pair on a bridge, each end shaped
  by `tc tbf` to --lan-mbit (1 GbE); this kernel has no netem, so the one-way latency
  (--lan-latency-ms / 2) is added by this script's wrapper around every message a rank sends
  (`latentkv.cluster.wire.Peer.send`).

The page cache is dropped before each run, and the store's usage history removed (each run
starts from the same state). Every rank runs one torch thread.

Bounds, per row: the **disk bound** is the per-rank read limit over the most bytes any rank read
per decoded token; the **core bound** is the same cluster's tok/s with every expert cached
(--core-ram-gb, the timed steps after as many untimed ones: no disk read), the most this
machine's shared cores allow. The
exchange's cost at 1 GbE is computed from the bytes and round trips measured (the head's bytes
over 125 MB/s, plus a round trip per MoE layer per token at --lan-latency-ms), and the token
time with and without it is compared in --unshaped runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

GIB = 1 << 30
V1 = Path("/sys/fs/cgroup")
SUBNET = "10.77.0"
BRIDGE = "lkvbr0"


# --- a rank: the wrapper that adds the LAN's latency; the head's measurement -----------------


def add_latency(one_way_s: float) -> None:
    """Delay every cluster message by `one_way_s` (the LAN's one-way latency: this kernel has
    no netem)."""
    from latentkv.cluster import wire

    if one_way_s > 0:
        send = wire.Peer.send

        def delayed(self, parts):
            time.sleep(one_way_s)
            return send(self, parts)

        wire.Peer.send = delayed


def head_child(
    model: str, ram_gb: float, weight_dtype: str, context: int, tokens: int, warm: bool, gbps: float
) -> int:
    """The measured rank 0 (or the one process): load, prefill `context` random tokens, then time
    `tokens` greedy decode steps (after `tokens` untimed ones with `warm`); print one JSON line with
    tok/s and every rank's telemetry over the timed steps."""
    import torch

    from latentkv.commands.common import cluster_config
    from latentkv.config import EngineConfig
    from latentkv.runtime import load

    class Flags:
        cluster_timeout, cluster_start_timeout = (
            (300.0, 900.0) if os.environ.get("WORLD_SIZE") else (None, None)
        )
        cluster_secret = placement = None
        disk_gbps = gbps if os.environ.get("WORLD_SIZE") else None  # its throttle, as the workers'
        no_head_experts = False

    torch.set_num_threads(1)
    engine = EngineConfig(weight_dtype=weight_dtype, threads=1, ram_gb=ram_gb, cluster=cluster_config(Flags))
    loaded = load(model, engine, max_model_len=context + 2 * tokens + 1)
    try:
        model_, cache = loaded.model, loaded.model.make_cache(loaded.model.tier())
        g = torch.Generator().manual_seed(0)
        logits = model_.forward(torch.randint(0, model_.cfg.vocab_size, (context,), generator=g), cache)[-1]
        for _ in range(tokens if warm else 0):
            logits = model_.forward(logits.argmax().reshape(1), cache)[-1]
        before = _telemetry(loaded)
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = model_.forward(logits.argmax().reshape(1), cache)[-1]
        seconds = time.perf_counter() - t0
        after = _telemetry(loaded)
    finally:
        loaded.close()
    print(
        json.dumps(
            {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "ranks": _delta(before, after)}
        )
    )
    return 0


COUNTERS = ("asked", "hits", "predicted", "recalled", "misses", "prefetched", "bytes_read", "read_seconds",
            "wait_seconds", "bytes_sent", "bytes_received", "net_wait_seconds", "tokens")  # fmt: skip


def _telemetry(loaded) -> list[dict]:
    if loaded.cluster is not None:
        return loaded.cluster.report(loaded.streamer)
    return [{"rank": 0, "role": "head", **loaded.streamer.snapshot()}]


def _delta(before: list[dict], after: list[dict]) -> list[dict]:
    out = []
    for b, a in zip(before, after, strict=True):
        d = {k: a.get(k, 0) - b.get(k, 0) for k in COUNTERS}
        d.update(rank=a["rank"], role=a.get("role"), experts=a.get("experts"), status=a.get("status", "ok"))
        d["hit_rate"] = d["hits"] / d["asked"] if d["asked"] else 0.0
        d["recall"] = d["recalled"] / d["predicted"] if d["predicted"] else 0.0
        d["read_gbps"] = d["bytes_read"] / d["read_seconds"] / 1e9 if d["read_seconds"] else 0.0
        out.append(d)
    return out


# --- the machine: cgroups, namespaces, shaping -----------------------------------------------


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Cgroups:
    """A memory and a blkio cgroup (v1) for one rank."""

    def __init__(self, name: str, limit: int):
        self.mem = V1 / "memory" / name
        self.blk = V1 / "blkio" / name
        for d in (self.mem, self.blk):
            d.mkdir(exist_ok=True)
        (self.mem / "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):
            (self.mem / "memory.swappiness").write_text("0")

    def throttle(self, device: str, bps: int) -> None:
        (self.blk / "blkio.throttle.read_bps_device").write_text(f"{device} {bps}")

    def peak(self) -> int:
        return int((self.mem / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        for line in (self.mem / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        for d in (self.mem, self.blk):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def disk_device(path: Path) -> str:
    """MAJ:MIN of the block device holding `path` (the whole disk, as blkio wants it)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if (sysfs / "partition").exists():  # a partition: throttle its disk
        return (sysfs.resolve().parent / "dev").read_text().strip()
    return f"{major}:{minor}"


class Lan:
    """N network namespaces on one bridge, every veth end shaped to `mbit` (tbf)."""

    def __init__(self, n: int, mbit: int | None):
        self.n = n
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        for r in range(n):
            ns, a, b = f"lkvns{r}", f"lkv{r}a", f"lkv{r}b"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", a, "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", a)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", a, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "link", "set", b, "master", BRIDGE)
            sh("ip", "link", "set", b, "up")
            if mbit:
                shape = ["root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb", "latency", "50ms"]
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", a, *shape)
                sh("tc", "qdisc", "add", "dev", b, *shape)

    def prefix(self, r: int) -> list[str]:
        return ["ip", "netns", "exec", f"lkvns{r}"]

    @staticmethod
    def address(r: int) -> str:
        return f"{SUBNET}.{r + 1}"

    def close(self) -> None:
        for r in range(self.n):
            sh("ip", "netns", "del", f"lkvns{r}", check=False)
            sh("ip", "link", "del", f"lkv{r}b", check=False)
        sh("ip", "link", "del", BRIDGE, check=False)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


# --- one run ----------------------------------------------------------------------------------


def plan_ram(args, cfg, directory: Path, expert_bytes: int) -> int:
    """The budget in which one rank alone caches 1/4 of all experts (dense weights, KV pool,
    activations and working set included)."""
    from latentkv.config import CacheConfig
    from latentkv.streaming.planner import make_plan

    probe = make_plan(
        cfg, directory, 1 << 50, args.weight_dtype, CacheConfig(), args.context + args.decode_tokens, 1
    )
    fixed = probe.dense_bytes + probe.kv_bytes + probe.activation_bytes + probe.working_bytes
    return fixed + expert_bytes // 4


def worker_argv(args, ram_gb: float) -> list[str]:
    return [
        "generate", args.model, "--prompt-ids", "1", "--weight-dtype", args.weight_dtype, "--ram-gb", f"{ram_gb:.4f}",
        "--threads", "1", "--cluster-timeout", "300", "--cluster-start-timeout", "900", "--disk-gbps", f"{args.rank_gbps:.4f}",
    ]  # fmt: skip


def one_run(args, n: int, ram_gb: float, label: str, warm: bool = False, shaped: bool = True) -> dict:
    """N ranks (1: one process, no cluster): the head's measurement and every rank's cgroup peak."""
    from latentkv.experts.history import FILE_NAME

    tmp = Path(args.work) / f"{label}-{n}"
    tmp.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (Path(args.store) / FILE_NAME).unlink()  # every run starts without a usage history
    limit = int(ram_gb * GIB) + args.margin_mib * (1 << 20)
    groups = [Cgroups(f"lkv-dist-{os.getpid()}-{r}", limit) for r in range(n)]
    lan = Lan(n, args.lan_mbit if shaped else None) if n > 1 else None
    latency = str(args.lan_latency_ms if shaped else 0)
    procs = []
    row: dict = {"label": label, "ranks": n, "ram_gb": ram_gb, "limit": limit, "shaped": shaped and n > 1}
    try:
        for g in groups[1:]:
            g.throttle(args.device, int(args.rank_gbps * 1e9))
        drop_caches()
        for r in range(n):
            env = dict(os.environ, OMP_NUM_THREADS="1", LATENTKV_CACHE=str(args.cache))
            if n > 1:
                env.update(
                    WORLD_SIZE=str(n), RANK=str(r), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR=Lan.address(0), MASTER_PORT=str(args.port),
                )  # fmt: skip
            if r == 0:
                what = [
                    args.model,
                    f"{ram_gb:.4f}",
                    args.weight_dtype,
                    str(args.context),
                    str(args.decode_tokens),
                ]
                what += ["warm" if warm else "cold", f"{args.rank_gbps:.4f}"]
                child = [sys.executable, __file__, "--head-child", latency, "--", *what]
            else:
                child = [sys.executable, __file__, "--rank-child", latency, "--", *worker_argv(args, ram_gb)]
            join = (
                f'echo $$ > {groups[r].mem}/cgroup.procs; echo $$ > {groups[r].blk}/cgroup.procs; exec "$@"'
            )
            cmd = ["sh", "-c", join, "sh", *(lan.prefix(r) if lan else []), *child]
            out = (tmp / f"rank{r}.out").open("w")
            err = (tmp / f"rank{r}.log").open("w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
        _throttle_head_after_load(args, groups[0], tmp / "rank0.log", procs[0])
        t0 = time.monotonic()
        codes = [p.wait(args.timeout) for p in procs]
        row["seconds"] = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        row["peaks"] = [g.peak() for g in groups]
        row["oom_kills"] = [g.oom_kills() for g in groups]
        for g in groups:
            g.close()
        if lan is not None:
            lan.close()
    row["returncodes"] = codes
    lines = (tmp / "rank0.out").read_text().strip().splitlines()
    if codes != [0] * n or not lines:
        row["error"] = (tmp / "rank0.log").read_text()[-3000:]
        return row
    row.update(json.loads(lines[-1]))
    return row


def _throttle_head_after_load(args, group: Cgroups, log: Path, proc) -> None:
    """The head reads its dense weights once at load, unthrottled; its disk is throttled from
    the moment the load is done (before the cluster starts decoding)."""
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if "loaded " in log.read_text(errors="replace"):
            break
        time.sleep(0.2)
    group.throttle(args.device, int(args.rank_gbps * 1e9))


# --- the table --------------------------------------------------------------------------------


def summarize(args, row: dict, moe_layers: int) -> dict:
    """Per-rank figures and the bounds of a finished run (over its timed decode steps)."""
    if "error" in row:
        return row
    tokens, ranks = row["tokens"], row["ranks"]
    per_token = [r["bytes_read"] / tokens for r in ranks]
    row["read_bytes_per_token"] = per_token
    worst = max(per_token)
    row["disk_bound_tok_s"] = args.rank_gbps * 1e9 / worst if worst else float("inf")
    head_sent = ranks[0]["bytes_sent"] / tokens
    workers_sent = sum(r["bytes_sent"] for r in ranks[1:]) / tokens
    row["exchange_bytes_per_token"] = head_sent + workers_sent
    row["head_net_wait_ms_per_token"] = 1e3 * ranks[0]["net_wait_seconds"] / tokens
    trips = moe_layers if len(ranks) > 1 else 0  # one exchange per MoE layer per token
    row["exchange_s_per_token_1gbe"] = (
        max(head_sent, workers_sent) * 8 / (args.lan_mbit * 1e6) + trips * args.lan_latency_ms / 1e3
    )
    row["exchange_share_of_token"] = row["exchange_s_per_token_1gbe"] * row["tok_s"]
    return row


def _each(ranks: list[dict], key: str, fmt: str) -> str:
    return "/".join(fmt.format(x[key]) for x in ranks)


def table(rows: list[dict], cores: dict[int, float], one: float | None) -> str:
    head = (
        "| ranks | tok/s | vs 1 rank | disk bound tok/s | core bound tok/s | % of the lower bound | hit rate per rank | "
        "recall per rank | GB/s read per rank (bytes over the timed steps' time) | MiB read/token (most) | exchange KiB/token | head's network wait "
        "ms/token | exchange at 1 GbE + 0.2 ms (share of a token) | peak GiB per rank |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {len(r['peaks'])} | failed (rc {r['returncodes']}, oom kills {r['oom_kills']}) |"
            )
            continue
        ranks = r["ranks"]
        core = cores.get(len(ranks))
        bound = min(b for b in (r["disk_bound_tok_s"], core or float("inf")))
        each = partial(_each, ranks)
        wall_gbps = "/".join(f"{x['bytes_read'] / r['seconds'] / 1e9:.2f}" for x in ranks)
        lines.append(
            f"| {len(ranks)} | {r['tok_s']:.2f} | {r['tok_s'] / one:.2f}x | {r['disk_bound_tok_s']:.2f} | "
            f"{'-' if core is None else f'{core:.2f}'} | {r['tok_s'] / bound:.0%} | {each('hit_rate', '{:.0%}')} | "
            f"{each('recall', '{:.0%}')} | {wall_gbps} | {max(r['read_bytes_per_token']) / 2**20:.0f} | "
            f"{r['exchange_bytes_per_token'] / 1024:.0f} | {r['head_net_wait_ms_per_token']:.1f} | "
            f"{1e3 * r['exchange_s_per_token_1gbe']:.2f} ms ({r['exchange_share_of_token']:.1%}) | "
            + "/".join(f"{p / GIB:.2f}" for p in r["peaks"])
            + " |"
        )
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------


def run(args) -> int:
    from experts import measure_disk
    from latentkv.config import ModelConfig
    from latentkv.experts.store_file import read_manifest
    from latentkv.models.registry import resolve
    from latentkv.streaming.attach import ensure_store

    directory = resolve(args.model)
    cfg = ModelConfig.from_hf(directory)
    os.environ["LATENTKV_CACHE"] = str(args.cache)  # where the ranks look for stores, here too
    args.store = ensure_store(directory, args.weight_dtype, progress=True)
    manifest = read_manifest(args.store)
    args.device = disk_device(Path(args.store))
    disk = measure_disk(Path(args.store), drop=True)
    earlier = _earlier(args)
    args.rank_gbps = args.rank_gbps or earlier.get("rank_read_gbps") or disk["gbps"] / args.read_share
    ram = (
        args.ram_gb
        or earlier.get("ram_gb_per_rank")
        or plan_ram(args, cfg, directory, manifest.expert_bytes) / GIB
    )
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    print(
        f"disk: {disk['gbps']:.2f} GB/s O_DIRECT; each rank reads at {args.rank_gbps:.2f} GB/s; "
        f"--ram-gb {ram:.2f} per rank",
        file=sys.stderr,
    )
    rows, cores, unshaped = [], {}, []
    for n in args.ranks:
        rows.append(summarize(args, one_run(args, n, ram, "disk"), moe_layers))
        if not args.no_core_bound:
            core = one_run(args, n, args.core_ram_gb, "core", warm=True)
            cores[n] = core.get("tok_s")
            rows[-1]["core_run"] = core
        if args.unshaped and n > 1:
            unshaped.append(summarize(args, one_run(args, n, ram, "unshaped", shaped=False), moe_layers))
        print(
            f"{n} ranks: {rows[-1].get('tok_s')} tok/s (core bound {cores.get(n)})",
            file=sys.stderr,
            flush=True,
        )
    done = {len(r["peaks"]) for r in rows}
    rows = [r for r in earlier.get("rows", []) if len(r["peaks"]) not in done] + rows
    rows.sort(key=lambda r: len(r["peaks"]))
    cores = {**{int(k): v for k, v in earlier.get("core_bound_tok_s", {}).items()}, **cores}
    unshaped = [r for r in earlier.get("unshaped", []) if len(r["peaks"]) not in done] + unshaped
    one = next((r["tok_s"] for r in rows if len(r["peaks"]) == 1 and "tok_s" in r), float("nan"))
    print(table(rows, cores, one))
    if args.out:
        result = {
            "model": args.model,
            "expert_bytes": manifest.expert_bytes,
            "disk": disk,
            "rank_read_gbps": args.rank_gbps,
            "ram_gb_per_rank": ram,
            "lan_mbit": args.lan_mbit,
            "lan_latency_ms": args.lan_latency_ms,
            "rows": rows,
            "core_bound_tok_s": cores,
            "unshaped": unshaped,
            "argv": [*earlier.get("argv", []), sys.argv[1:]] if earlier else [sys.argv[1:]],
            "disks_measured": [*earlier.get("disks_measured", []), disk],
            "cpu": f"{machine.cpu_model()} x {os.cpu_count()}",
            "uname": " ".join(os.uname()),
            "python": platform.python_version(),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


def _earlier(args) -> dict:
    """With --merge: the results file so far (its per-rank read limit and budget are kept, so
    rows run in separate invocations compare)."""
    if not (args.merge and args.out and Path(args.out).exists()):
        return {}
    return json.loads(Path(args.out).read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--rank-child", "--head-child"):  # CHILD LATENCY_MS -- ARGS
        add_latency(float(argv[1]) / 2e3)
        rest = argv[3:]
        if argv[0] == "--head-child":
            model, ram, dtype, context, tokens, warm, gbps = rest
            code = head_child(
                model, float(ram), dtype, int(context), int(tokens), warm == "warm", float(gbps)
            )
            if os.environ.get("WORLD_SIZE"):  # a cluster's head: as the CLI ends one
                from latentkv.cluster.rendezvous import end_process

                code = end_process(code)
            return code
        from latentkv.cli import main as cli

        return cli(rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the experts benchmark model's folder")
    p.add_argument("--ranks", default="1,2,3", help="cluster sizes to run (default: 1,2,3)")
    p.add_argument(
        "--ram-gb", type=float, default=None, help="every rank's budget (default: one rank caches 1/4)"
    )
    p.add_argument(
        "--core-ram-gb", type=float, default=8.0, help="budget of the core-bound runs (all cached)"
    )
    p.add_argument("--weight-dtype", default="int8", help="dense weights' format (default: int8)")
    p.add_argument("--context", type=int, default=16, help="prompt tokens prefilled first (default: 16)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded and timed (default: 32)")
    p.add_argument(
        "--read-share", type=float, default=3.0, help="each rank reads at 1/this of the disk (default: 3)"
    )
    p.add_argument("--lan-mbit", type=int, default=1000, help="each rank's link, tbf (default: 1000)")
    p.add_argument(
        "--lan-latency-ms", type=float, default=0.2, help="round trip added per message pair (default 0.2)"
    )
    p.add_argument("--margin-mib", type=int, default=256, help="memory limit = plan + this (default: 256)")
    p.add_argument("--port", type=int, default=29561, help="MASTER_PORT inside the namespaces")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-core-bound", action="store_true", help="skip the all-cached runs")
    p.add_argument("--unshaped", action="store_true", help="also run each cluster without tbf and latency")
    p.add_argument("--work", default="/tmp/latentkv-distributed", help="logs and per-run JSON")
    p.add_argument(
        "--cache", default=str(Path.home() / ".cache" / "latentkv"), help="LATENTKV_CACHE of the ranks"
    )
    p.add_argument(
        "--rank-gbps",
        type=float,
        default=None,
        help="each rank's read limit (default: measured / --read-share)",
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "--merge",
        action="store_true",
        help="add these rank counts' rows to --out (its read limit and budget kept): a table in several runs",
    )
    args = p.parse_args(argv)
    args.ranks = [int(x) for x in args.ranks.split(",")]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
