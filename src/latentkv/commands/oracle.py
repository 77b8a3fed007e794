"""`latentkv oracle`: agreement with transformers on tiny random models, per KV tier.

f32 (always run) is the gate: token-exact, logits within the tolerance. Other tiers report
their agreement and logit error; they are information, not failures.
"""

from __future__ import annotations

import argparse
import json
import sys

from latentkv.commands.common import add_cache_arguments, weight_dtypes
from latentkv.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="only this tiny model (repeatable); default: all")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument(
        "--record", action="store_true", help="rewrite the committed reference files from transformers"
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    add_cache_arguments(p, multiple=True, default="f32", note=". f32 always runs: it is the gate")
    p.add_argument(
        "--weight-dtype",
        default="f32",
        metavar="LIST",
        help="comma-separated weight formats (f32, bf16, int8, int4); f32 always runs and gates, the "
        "others report their agreement like the lossy KV tiers (default: f32)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("the oracle compares against transformers: pip install 'latentkv[dev]'") from None
    import torch

    from latentkv.commands.common import cache_configs
    from latentkv.config import CacheConfig, check_threads
    from latentkv.eval import oracle

    if args.threads is not None:
        torch.set_num_threads(check_threads(args.threads))  # a ConfigError is one line (cli.main)
    names = args.model or list(oracle.SPECS)
    if unknown := [n for n in names if n not in oracle.SPECS]:
        raise UserError(f"unknown oracle model(s) {unknown}; available: {', '.join(oracle.SPECS)}")
    caches = cache_configs(args, default="f32")
    more_weights = tuple(w for w in weight_dtypes(args.weight_dtype) if w != "f32")
    if all(c.kv_cache_dtype != oracle.GATED_TIER for c in caches):
        caches.insert(0, CacheConfig(oracle.GATED_TIER))  # the gate always runs
    rows = []
    for name in names:
        spec = oracle.SPECS[name]
        directory = oracle.ensure_built(name)
        if args.record:
            ref, _ = oracle.hf_reference(spec, directory)
            oracle.REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
            oracle.reference_path(name).write_text(json.dumps(ref, indent=1) + "\n")
        rows += oracle.check_tiers(spec, directory, oracle.load_reference(name), caches, "f32", more_weights)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(table(rows, with_tiers=len(caches) > 1 or bool(more_weights), with_weights=bool(more_weights)))
        print(f"(tolerance {oracle.LOGIT_TOLERANCE:g} on float32 logits, gating f32 only)", file=sys.stderr)
    return 0 if all(r.ok is not False for r in rows) else 1


def table(rows, with_tiers: bool, with_weights: bool = False) -> str:
    """Fixed-width rows; the tier columns appear when more than f32 was asked for, the weights
    column when weight formats other than f32 were."""
    if not with_tiers:
        lines = [
            f"{'model':<18} {'tf':>6} {'greedy':>7} {'max_abs_logit_diff':>19} {'reference':>10}  result"
        ]
        for r in rows:
            lines.append(
                f"{r.name:<18} {r.tf:>6} {r.greedy:>7} {r.max_abs_logit_diff:>19.2e} "
                f"{_ref(r):>10}  {_result(r)}"
            )
        return "\n".join(lines)
    lines = [
        f"{'model':<18} {'weights  ' if with_weights else ''}{'kv':<7} {'tf':>6} {'greedy':>7} {'prefix':>6} {'max_abs_logit_diff':>19} "
        f"{'reference':>10}  result"
    ]
    for r in rows:
        lines.append(
            f"{r.name:<18} {f'{r.weight_dtype:<7}  ' if with_weights else ''}{r.kv_cache_dtype:<7} {r.tf:>6} {r.greedy:>7} {r.greedy_prefix:>6} "
            f"{r.max_abs_logit_diff:>19.2e} {_ref(r):>10}  {_result(r)}"
        )
    return "\n".join(lines)


def _ref(row) -> str:
    return "same" if row.reference_matches else "CHANGED"


def _result(row) -> str:
    return {True: "ok", False: "FAIL", None: "-"}[row.ok]
