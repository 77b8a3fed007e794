"""Experts streamed from disk under a real memory limit (issue 16): tok/s, hit rate, prefetch
recall and read speed per expert-cache budget, against the disk-bound limit.

    # the model (once): benchmarks/build_expert_model.py
    .venv/bin/python benchmarks/experts.py ~/.cache/latentkv/experts-bench \\
        --fractions 0.125,0.25,0.5 --tokens 32 --out benchmarks/results/experts-bench.json

    # the thesis table: one RAM budget, a long context, the KV tier moves RAM to the experts
    .venv/bin/python benchmarks/experts.py ~/.cache/latentkv/experts-bench --ram-gb 8 \\
        --tiers f32,fp8,tq4-r8 --context 131072 --fill random --tokens 32 \\
        --out benchmarks/results/experts-thesis.json

`--fill random` builds the context from random latent rows appended to every layer's cache
(what `latentkv bench decode --fill random` does) and prefills only the last 16 tokens: the
memory of a long context, without minutes of prefill. The plan and the cgroup limit count the
whole context at the tier's real bytes, as a server planning that context would.

Each run is a child process in its own memory cgroup (v2 memory.max or v1 limit_in_bytes, which
count page cache; root), limited to the plan's RAM plus --margin-mib, after the page cache is
dropped. First the store's O_DIRECT read speed is measured (every extent once, 4 threads): the
disk-bound limit of a budget is that speed / the expert bytes it missed per token, and a run's
efficiency is its tok/s over that limit. Run on an idle machine (check `uptime`).

`--llamacpp [TWIN.gguf]` adds llama.cpp (mmap) on the model's GGUF twin (benchmarks/expert_twin.py)
after each of our runs: the same cgroup limit, the page cache dropped, llama-bench's generation
speed (benchmarks/llamacpp_experts.py); a second table gives ours / llama.cpp per budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp_experts  # noqa: E402
import routing_trace  # noqa: E402

GIB = 1 << 30
RANDOM_FILL_PROMPT = 1  # --fill random: tokens prefilled after the random rows (one: a decode step)


def measure_disk(store: Path, drop: bool, threads: int = 4, max_bytes: int = 4 * GIB) -> dict:
    """O_DIRECT read speed over the store's extents (cold: the page cache is dropped first)."""
    from latentkv.experts import memlimit
    from latentkv.experts.reader import ExpertReader

    if drop:
        _drop(memlimit)
    with ExpertReader(store, direct=None, threads=threads) as r:
        keys = [
            (layer, e) for layer, entry in sorted(r.manifest.layers.items()) for e in range(entry.n_experts)
        ]
        stride = max(entry.layout.stride for entry in r.manifest.layers.values())
        keys = keys[: max(1, max_bytes // stride)]
        t0 = time.perf_counter()
        for f in [r.submit(*k) for k in keys]:
            f.result()
        wall = time.perf_counter() - t0
        direct = r.stats.direct_reads == r.stats.reads
        return {
            "bytes": r.stats.bytes_read,
            "seconds": wall,
            "gbps": r.stats.bytes_read / wall / 1e9,
            "o_direct": direct,
        }


def _drop(memlimit) -> None:
    try:
        memlimit.drop_page_cache()
    except OSError as exc:
        print(f"experts.py: could not drop the page cache ({exc}); runs are not cold", file=sys.stderr)


def _child_cmd(args, budget: int, tier: str, prompt_len: int) -> list[str]:
    filled = 0
    if args.fill == "random" and prompt_len > RANDOM_FILL_PROMPT:
        filled, prompt_len = prompt_len - RANDOM_FILL_PROMPT, RANDOM_FILL_PROMPT
    cmd = [sys.executable, __file__, args.model, "--child", "--budget", str(budget)]
    cmd += ["--kv-cache-dtype", tier, "--prompt-len", str(prompt_len), "--filled", str(filled)]
    cmd += ["--tokens", str(args.tokens), "--policy", args.policy, "--weight-dtype", args.weight_dtype]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    if args.routing_trace:
        cmd += ["--routing-trace", args.routing_trace]
        cmd += (
            ["--trace-first-layer", str(args.trace_first_layer)] if args.trace_first_layer is not None else []
        )
    return cmd + (["--history"] if args.history else [])


def run_child(args: argparse.Namespace) -> int:
    """In the limited process: load streamed, prefill, decode greedily; print one JSON line."""
    import torch

    from latentkv.experts.streamed import StreamConfig
    from latentkv.models.registry import resolve
    from latentkv.streaming.attach import ensure_store, load_streamed

    if args.threads:
        torch.set_num_threads(args.threads)
    directory = resolve(args.model)
    store = ensure_store(directory, args.weight_dtype)
    t0 = time.perf_counter()
    config = StreamConfig(budget=args.budget, policy=args.policy, history=args.history)
    model, streamer = load_streamed(directory, store, config, weight_dtype=args.weight_dtype, device="cpu")
    if args.routing_trace:  # route and prefetch as the trace says (the parent checked it)
        routing_trace.attach(model, routing_trace.load(args.routing_trace), args.trace_first_layer)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g)
    cache = model.make_cache(model.tier(args.kv_cache_dtype))
    if args.filled:
        from latentkv.eval.bench.workload import fill_random

        cache.reserve(args.filled + args.prompt_len + args.tokens)  # one allocation, no doubling
        fill_random(cache, args.filled)
    t0 = time.perf_counter()
    logits = model.forward(prompt, cache)[-1]
    prefill_s = time.perf_counter() - t0
    before = streamer.snapshot()
    t0 = time.perf_counter()
    for _ in range(args.tokens):
        logits = model.forward(logits.argmax().reshape(1), cache)[-1]
    decode_s = time.perf_counter() - t0
    after = streamer.snapshot()
    streamer.close()
    delta = {
        k: after[k] - before[k]
        for k in (
            "asked",
            "hits",
            "prefetched",
            "misses",
            "predicted",
            "recalled",
            "bytes_read",
            "read_seconds",
            "wait_seconds",
        )
    }
    print(
        json.dumps(
            {
                "load_s": load_s,
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "tok_s": args.tokens / decode_s,
                "hit_rate": delta["hits"] / max(1, delta["asked"]),
                "recall": delta["recalled"] / max(1, delta["predicted"]),
                "bytes_per_token": delta["bytes_read"] / args.tokens,
                "read_gbps": delta["bytes_read"] / delta["read_seconds"] / 1e9
                if delta["read_seconds"]
                else 0.0,
                "wait_share": delta["wait_seconds"] / decode_s,
                "resident_bytes": after["resident_bytes"],
                "budget": after["budget"],
                "decode": delta,
            }
        )
    )
    return 0


def _plan(args, tier: str, context: int, ram: int | None):
    from latentkv.config import CacheConfig, ModelConfig
    from latentkv.models.registry import resolve
    from latentkv.streaming.planner import make_plan

    directory = resolve(args.model)
    cfg = ModelConfig.from_hf(directory)
    return make_plan(cfg, directory, ram or 1 << 50, args.weight_dtype, CacheConfig(tier), context, 1)


def one_run(args, label: str, budget: int, tier: str, context: int, disk_gbps: float) -> dict:
    from latentkv.experts import memlimit

    plan = _plan(args, tier, context, None)
    fixed = plan.dense_bytes + plan.kv_bytes + plan.activation_bytes + plan.working_bytes
    limit = fixed + budget + args.margin_mib * (1 << 20)
    cmd = _child_cmd(args, budget, tier, max(1, context - args.tokens))
    if not args.no_drop_caches:
        _drop(memlimit)
    if args.no_limit:
        import subprocess

        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        run = memlimit.LimitedRun(p.returncode, -1, 0, p.stdout, p.stderr, time.perf_counter() - t0)
    else:
        run = memlimit.run_limited(cmd, limit, timeout=args.timeout)
    row = {"label": label, "tier": tier, "budget": budget, "limit": limit, "peak": run.peak_bytes}
    row.update(returncode=run.returncode, oom_kills=run.oom_kills, seconds=run.seconds)
    if run.returncode != 0:
        row["error"] = run.stderr[-2000:]
        return row
    row.update(json.loads(run.stdout.strip().splitlines()[-1]))
    missed = row["bytes_per_token"]
    row["disk_bound_tok_s"] = disk_gbps * 1e9 / missed if missed else float("inf")
    row["of_disk_bound"] = row["tok_s"] / row["disk_bound_tok_s"] if missed else None
    return row


def table(rows: list[dict], disk: dict) -> str:
    head = "| run | KV | budget GiB | limit GiB | peak GiB | tok/s | hit rate | recall | MiB/token | read GB/s | disk-bound tok/s | % of bound |"
    lines = [
        f"O_DIRECT read speed: {disk['gbps']:.2f} GB/s ({disk['bytes'] / 1e9:.1f} GB, o_direct={disk['o_direct']})",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['label']} | {r['tier']} | {r['budget'] / GIB:.2f} | {r['limit'] / GIB:.2f} | failed (rc {r['returncode']}, oom kills {r['oom_kills']}) |"
            )
            continue
        bound = r["of_disk_bound"]
        lines.append(
            f"| {r['label']} | {r['tier']} | {r['budget'] / GIB:.2f} | {r['limit'] / GIB:.2f} | {r['peak'] / GIB:.2f} | "
            f"{r['tok_s']:.3f} | {r['hit_rate']:.1%} | {r['recall']:.1%} | {r['bytes_per_token'] / 2**20:.0f} | "
            f"{r['read_gbps']:.2f} | {r['disk_bound_tok_s']:.3f} | {'-' if bound is None else f'{bound:.0%}'} |"
        )
    return "\n".join(lines)


def with_llamacpp(args, row: dict) -> dict:
    """Row plus llama.cpp on the twin under the same limit (when --llamacpp), and ours / theirs."""
    if not args.llamacpp:
        return row
    lc = llamacpp_experts.llamacpp_run(
        Path(args.llamacpp),
        None if args.no_limit else row["limit"],
        args.tokens,
        max(1, args.context - args.tokens),
        args.llamacpp_threads,
        args.llamacpp_timeout,
        not args.no_drop_caches,
        args.llamacpp_repack,
    )
    row["llamacpp"] = lc
    row["ours_vs_llamacpp"] = llamacpp_experts.ratio(row.get("tok_s"), lc["tok_s"])
    return row


def _check_trace(args) -> dict | None | bool:
    """With --routing-trace: the trace's file, layers used and their statistics (None without;
    False, after one line on stderr, when the trace cannot drive this model)."""
    if not args.routing_trace:
        return None
    from latentkv.config import ModelConfig
    from latentkv.models.registry import resolve

    try:
        trace = routing_trace.load(args.routing_trace)
        cfg = ModelConfig.from_hf(resolve(args.model))
        n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
        available = trace["moe_layers"]
        first = args.trace_first_layer
        if first is None:
            first = available[(len(available) - n_moe) // 2]
        if first not in available or available.index(first) + n_moe > len(available):
            raise ValueError(
                f"the trace's MoE layers are {available}: no {n_moe} consecutive ones from {first}"
            )
        if cfg.n_routed_experts < trace["n_experts"] or cfg.num_experts_per_tok != trace["top_k"]:
            raise ValueError(
                f"the trace routes top-{trace['top_k']} of {trace['n_experts']} experts, the model "
                f"top-{cfg.num_experts_per_tok} of {cfg.n_routed_experts}"
            )
    except ValueError as exc:
        print(f"experts.py: {exc}", file=sys.stderr)
        return False
    used = available[available.index(first) : available.index(first) + n_moe]
    layers = {str(t): routing_trace.layer_stats(trace["layers"][str(t)], trace["n_experts"]) for t in used}
    return {"file": args.routing_trace, "model": trace.get("model"), "layers_used": used, "stats": layers}


def trace_summary(trace: dict) -> str:
    s = trace["stats"].values()
    mean = lambda key: sum(x[key] for x in s) / len(s)  # noqa: E731
    return (
        f"routing: trace {trace['file']} ({trace['model']}), its MoE layers {trace['layers_used']}: "
        f"prefetch recall {mean('recall'):.1%} in the trace, hottest expert {mean('max_over_mean'):.2f}x the mean, "
        f"hottest 1/8 of experts take {mean('top_eighth_share'):.1%} of the routing"
    )


def run_parent(args: argparse.Namespace) -> int:
    from latentkv.experts import memlimit
    from latentkv.experts.store_file import read_manifest
    from latentkv.models.registry import resolve
    from latentkv.streaming.attach import ensure_store

    if not args.no_limit and (why := memlimit.unavailable()):
        print(
            f"experts.py: {why}; run as root, or pass --no-limit (then nothing bounds memory)",
            file=sys.stderr,
        )
        return 2
    if args.llamacpp and not Path(args.llamacpp).is_file():
        print(
            f"experts.py: no GGUF twin at {args.llamacpp} (build it: benchmarks/expert_twin.py)",
            file=sys.stderr,
        )
        return 2
    if args.llamacpp:
        llamacpp_experts.llamacpp.binary("llama-bench")  # one line and exit when it is not built
    trace = _check_trace(args)
    if trace is False:
        return 2
    store = ensure_store(resolve(args.model), args.weight_dtype, progress=True)
    experts = read_manifest(store).expert_bytes
    disk = measure_disk(store, not args.no_drop_caches)
    rows = []
    if args.tiers:
        for tier in args.tiers.split(","):
            plan = _plan(args, tier, args.context, int(args.ram_gb * GIB))
            row = one_run(
                args,
                f"ram {args.ram_gb} GiB, ctx {args.context}",
                plan.expert_cache_bytes,
                tier,
                args.context,
                disk["gbps"],
            )
            rows.append(with_llamacpp(args, row))
    else:
        for frac in (float(f) for f in args.fractions.split(",")):
            row = one_run(
                args,
                f"{frac:g} of experts",
                int(frac * experts),
                args.kv_cache_dtype,
                args.context,
                disk["gbps"],
            )
            rows.append(with_llamacpp(args, row))
    if trace is not None:
        print(trace_summary(trace))
        print()
    print(table(rows, disk))
    if args.llamacpp:
        print()
        print(llamacpp_experts.table(rows))
    if args.out:
        out = {
            "model": args.model,
            "expert_bytes": experts,
            "disk": disk,
            "runs": rows,
            "argv": sys.argv[1:],
            "uname": " ".join(os.uname()),
        }
        if trace is not None:
            out["routing_trace"] = trace
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = main_args(argv)
    return run_child(args) if args.child else run_parent(args)


def main_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model folder (with experts/) or builtin:NAME")
    p.add_argument(
        "--fractions", default="0.125,0.25,0.5", help="expert-cache budgets as shares of all expert bytes"
    )
    p.add_argument(
        "--tiers", default=None, help="thesis mode: KV tiers compared at one --ram-gb and --context"
    )
    p.add_argument(
        "--ram-gb", type=float, default=None, help="thesis mode: the RAM budget the planner splits"
    )
    p.add_argument(
        "--context", type=int, default=64, help="tokens of context: prompt + generated (default: 64)"
    )
    p.add_argument(
        "--fill",
        choices=["prefill", "random"],
        default="prefill",
        help="how the context is built: prefill a random prompt (default), or random latent rows "
        f"appended to the cache and {RANDOM_FILL_PROMPT} prefilled tokens (long contexts)",
    )
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed (default: 32)")
    p.add_argument("--kv-cache-dtype", default="f32")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu", "least-stale"])
    p.add_argument("--weight-dtype", default="f32", help="dense weight format (the experts keep the store's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--history",
        action="store_true",
        help="use and update the store's usage history (the pinned hot set). Off by default: every "
        "run decodes the same tokens, so a history kept from earlier runs would pin exactly the "
        "experts this one needs",
    )
    p.add_argument(
        "--routing-trace",
        default=None,
        metavar="FILE",
        help="route and prefetch by a trained model's routing trace (benchmarks/routing_trace.py) "
        "instead of the model's random routers",
    )
    p.add_argument(
        "--trace-first-layer",
        type=int,
        default=None,
        help="the trace's MoE layer the model's first MoE layer takes (default: the middle ones)",
    )
    p.add_argument("--margin-mib", type=int, default=256, help="limit = plan + this (default: 256)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument(
        "--no-limit", action="store_true", help="no cgroup (tests, non-root): memory is not bounded"
    )
    p.add_argument(
        "--no-drop-caches", action="store_true", help="keep the page cache (tests on a shared machine)"
    )
    p.add_argument(
        "--llamacpp",
        nargs="?",
        const=str(llamacpp_experts.DEFAULT_TWIN),
        default=None,
        metavar="TWIN_GGUF",
        help=f"also run llama.cpp (mmap) on the GGUF twin under each limit (default twin: {llamacpp_experts.DEFAULT_TWIN})",
    )
    p.add_argument("--llamacpp-threads", type=int, default=2, help="llama.cpp threads (default: 2)")
    p.add_argument(
        "--llamacpp-timeout",
        type=float,
        default=900,
        help="seconds before a llama.cpp run counts as thrashing",
    )
    p.add_argument(
        "--llamacpp-repack",
        action="store_true",
        help="let llama.cpp repack weights (copies them out of the mmap: off by default)",
    )
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--prompt-len", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--filled", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiers and args.ram_gb is None:
        p.error("--tiers needs --ram-gb")
    if args.fill == "random" and args.llamacpp:
        p.error("--fill random cannot be combined with --llamacpp: llama-bench prefills its context")
    return args


if __name__ == "__main__":
    sys.exit(main())
