"""llama.cpp (mmap) decoding the GGUF twin under a memory cgroup: the comparison rows of
benchmarks/experts.py --llamacpp (issue 16).

One run: the page cache dropped, then `llama-bench -m TWIN -p PROMPT -n TOKENS -r 1 -t THREADS
-lm mmap --repack 0 -o json` in a fresh memory cgroup limited to the bytes our own run got. Its
tg (generation) speed is the row's tok/s; its pp speed is kept for reference. mmap is llama.cpp's
answer to a model larger than RAM: the experts stay in the file's pages, the kernel reads what a
token touches and evicts under the limit. `--repack 0` keeps them there (repacking copies Q4_K
tensors into anonymous memory, which is no longer mmap and does not fit the limit).

A run the cgroup's OOM killer ended, one that ran past the timeout (killed: thrashing) and one
that failed otherwise are rows too, with the reason; they never stop the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

DEFAULT_TWIN = Path.home() / ".cache" / "latentkv" / "experts-bench-gguf" / "twin.gguf"


def bench_cmd(gguf: Path, tokens: int, prompt: int, threads: int, repack: bool = False) -> list[str]:
    return [
        str(llamacpp.binary("llama-bench")),
        "-m",
        str(gguf),
        "-p",
        str(prompt),
        "-n",
        str(tokens),
        "-r",
        "1",
        "-t",
        str(threads),
        "-lm",
        "mmap",
        "--repack",
        "1" if repack else "0",
        "-o",
        "json",
    ]


def parse_bench(stdout: str) -> dict:
    """llama-bench's JSON array -> {"tok_s": tg speed, "pp_tok_s": pp speed or None}.
    ValueError when it holds no generation test."""
    start = stdout.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array")
    results = json.loads(stdout[start:])
    tg = [r for r in results if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    pp = [r for r in results if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    if not tg:
        raise ValueError("llama-bench's report has no generation (tg) test")
    return {
        "tok_s": float(tg[0]["avg_ts"]),
        "pp_tok_s": float(pp[0]["avg_ts"]) if pp else None,
        "n_gen": int(tg[0]["n_gen"]),
        "n_prompt": int(pp[0]["n_prompt"]) if pp else 0,
    }


def run_in_cgroup(cmd: list[str], limit: int | None, timeout: float) -> dict:
    """Run cmd (in a fresh memory cgroup when limit is set); a timeout kills it and is reported."""
    from latentkv.experts import memlimit

    group = memlimit.MemoryCgroup(limit) if limit is not None else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: group.add(os.getpid())) if group else None,  # joins before exec
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            timed_out = True
        return {
            "returncode": proc.returncode,
            "timed_out": timed_out,
            "peak": group.peak() if group else -1,
            "oom_kills": group.oom_kills() if group else 0,
            "seconds": time.perf_counter() - t0,
            "stdout": out,
            "stderr": err,
        }
    finally:
        if group is not None:
            group.close()


def outcome(run: dict) -> dict:
    """A run's row fields: status ok with tok/s, or oom-killed / timeout / failed with the reason."""
    row = {k: run[k] for k in ("returncode", "peak", "oom_kills", "seconds")}
    if run["timed_out"]:
        return {**row, "status": "timeout", "tok_s": None}
    if run["oom_kills"] > 0 and run["returncode"] != 0:
        return {**row, "status": "oom-killed", "tok_s": None}
    if run["returncode"] != 0:
        return {**row, "status": "failed", "tok_s": None, "error": run["stderr"][-2000:]}
    try:
        return {**row, "status": "ok", **parse_bench(run["stdout"])}
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        return {**row, "status": "failed", "tok_s": None, "error": f"{exc}: {run['stdout'][-500:]}"}


def llamacpp_run(
    gguf: Path,
    limit: int | None,
    tokens: int,
    prompt: int,
    threads: int,
    timeout: float,
    drop: bool,
    repack: bool = False,
) -> dict:
    """One llama.cpp run under `limit` bytes (None: no cgroup), cold when `drop`."""
    from latentkv.experts import memlimit

    if drop:
        try:
            memlimit.drop_page_cache()
        except OSError as exc:
            print(f"experts.py: could not drop the page cache ({exc}); llama.cpp runs warm", file=sys.stderr)
    cmd = bench_cmd(gguf, tokens, prompt, threads, repack)
    result = outcome(run_in_cgroup(cmd, limit, timeout))
    result.update(limit=limit, threads=threads, repack=repack, gguf=str(gguf))
    return result


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / llama.cpp's tok/s; None when either did not finish."""
    if not ours or not theirs:
        return None
    return ours / theirs


def table(rows: list[dict]) -> str:
    """The llama.cpp rows beside ours (rows: experts.py's, each with a "llamacpp" entry)."""
    head = "| run | limit GiB | llama.cpp | peak GiB | llama.cpp tok/s | ours tok/s | ours / llama.cpp |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lc = r["llamacpp"]
        ours, theirs, x = r.get("tok_s"), lc.get("tok_s"), r.get("ours_vs_llamacpp")
        lines.append(
            f"| {r['label']} | {r['limit'] / 2**30:.2f} | {lc['status']} ({lc['seconds']:.0f} s) | "
            f"{lc['peak'] / 2**30:.2f} | {'-' if theirs is None else f'{theirs:.3f}'} | "
            f"{'-' if ours is None else f'{ours:.3f}'} | {'-' if x is None else f'{x:.2f}x'} |"
        )
    return "\n".join(lines)
