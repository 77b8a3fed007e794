"""`latentkv oracle`: token-exact agreement with transformers on tiny random models."""

from __future__ import annotations

import argparse
import json
import sys

from latentkv.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="only this tiny model (repeatable); default: all")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument(
        "--record", action="store_true", help="rewrite the committed reference files from transformers"
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("the oracle compares against transformers: pip install 'latentkv[dev]'") from None
    import torch

    from latentkv.eval import oracle

    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.model or list(oracle.SPECS)
    if unknown := [n for n in names if n not in oracle.SPECS]:
        raise UserError(f"unknown oracle model(s) {unknown}; available: {', '.join(oracle.SPECS)}")
    rows = []
    for name in names:
        spec = oracle.SPECS[name]
        directory = oracle.ensure_built(name)
        if args.record:
            ref, _ = oracle.hf_reference(spec, directory)
            oracle.REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
            oracle.reference_path(name).write_text(json.dumps(ref, indent=1) + "\n")
        rows.append(oracle.check(spec, directory, oracle.load_reference(name)))
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(f"{'model':<18} {'tf':>6} {'greedy':>7} {'max_abs_logit_diff':>19} {'reference':>10}  result")
        for r in rows:
            print(
                f"{r.name:<18} {r.tf:>6} {r.greedy:>7} {r.max_abs_logit_diff:>19.2e} "
                f"{'same' if r.reference_matches else 'CHANGED':>10}  {'ok' if r.ok else 'FAIL'}"
            )
        print(f"(tolerance {oracle.LOGIT_TOLERANCE:g} on float32 logits)", file=sys.stderr)
    return 0 if all(r.ok for r in rows) else 1
