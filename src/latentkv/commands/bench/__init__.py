"""`latentkv bench decode|attention|resume|batch|speculative`: decode tok/s per KV tier (optionally beside
transformers), the attention read alone per tier, resuming a saved conversation against
prefilling it again, batched decode (B sequences together), and MTP speculative decoding. Tables print as markdown; --json / --out give JSON. One module per
subcommand, each with `add` (its arguments), `run` (-> JSON payload) and `table`; what each
times lives a layer down, in `latentkv.eval.bench.measure_NAME`."""

from __future__ import annotations

import argparse
import importlib

from latentkv.commands.common import emit

SUBCOMMANDS = ("decode", "attention", "resume", "batch", "speculative")


def _module(name: str):
    return importlib.import_module(f"latentkv.commands.bench.{name}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in SUBCOMMANDS:
        _module(name).add(sub)


def run(args: argparse.Namespace) -> int:
    module = _module(args.bench)
    emit(module.run(args), args, lambda payload: _with_notes(module.table(payload["rows"]), payload["notes"]))
    return 0


def _with_notes(table: str, notes: list[str]) -> str:
    return table + ("\n\n" + "\n".join(f"- {note}" for note in notes) if notes else "")
