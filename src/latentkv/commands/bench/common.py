"""Helpers shared by the `latentkv bench` subcommands: output flags, list parsing, threads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentkv.errors import UserError


def add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")


def ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} needs positive integers, got {text!r}")
    from latentkv.config import check_tokens

    for value in values:
        check_tokens(what, value)
    return values


def tiers(text: str) -> list[str]:
    from latentkv.config import ConfigError, parse_kv_cache_dtypes

    try:
        return list(dict.fromkeys(parse_kv_cache_dtypes(text)))
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def set_threads(threads: int | None) -> None:
    import torch

    from latentkv.config import ConfigError, check_threads, env_threads

    try:
        threads = threads if threads is not None else env_threads()
        if threads is not None:
            torch.set_num_threads(check_threads(threads))
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def progress(text: str, quiet: bool) -> None:
    if not quiet:
        print(f"  {text}", file=sys.stderr)


def num(value: float | None, fmt: str = ",.1f", missing: str = "n/a") -> str:
    return missing if value is None else format(value, fmt)


STATISTICS = ("fastest", "median")


def pick(repeats: int, measure, statistic: str = "fastest"):
    """One row from `repeats` measurements, by decode tok/s: the fastest (noise on a shared box
    only slows) or the median (the lower middle one of an even count), with every run's decode
    tok/s in its `decode_tps_runs` (in the order they ran)."""
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose from {', '.join(STATISTICS)}")
    rows = [measure() for _ in range(repeats)]
    ranked = sorted(rows, key=lambda row: row.decode_tps)
    row = ranked[-1] if statistic == "fastest" else ranked[(len(ranked) - 1) // 2]
    row.decode_tps_runs = [r.decode_tps for r in rows]
    return row


def ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def checked_cache_configs(model, tiers: list[str]) -> list:
    """One CacheConfig per tier name (from `tiers`), each checked against the loaded model's
    widths before any timing. (`commands.common.cache_configs` builds them from the KV flags.)"""
    from latentkv.config import CacheConfig
    from latentkv.runtime import check_tier

    configs = [CacheConfig(t) for t in tiers]
    for config in configs:
        check_tier(model.cfg, config)
    return configs
