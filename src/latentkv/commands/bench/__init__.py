"""`latentkv bench decode|attention|resume|batch`: decode tok/s per KV tier (optionally beside
transformers), the attention read alone per tier, resuming a saved conversation against
prefilling it again, and batched decode (B sequences together). Tables print as markdown; --json / --out give JSON. One module per
subcommand, each with `add` (its arguments), `run` (-> JSON payload) and `table`."""

from __future__ import annotations

import argparse
import importlib
import json

SUBCOMMANDS = ("decode", "attention", "resume", "batch")


def _module(name: str):
    return importlib.import_module(f"latentkv.commands.bench.{name}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in SUBCOMMANDS:
        _module(name).add(sub)


def run(args: argparse.Namespace) -> int:
    module = _module(args.bench)
    payload = module.run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        print(module.table(payload["rows"]))
        if payload["notes"]:
            print("\n" + "\n".join(f"- {note}" for note in payload["notes"]))
    return 0
