"""Build the next-line multiple-choice task from held-out text (fixed seed, reproducible).

    .venv/bin/python tools/make_mc_task.py            # from builtin:fixture's heldout.txt
    .venv/bin/python tools/make_mc_task.py --heldout some.txt --out-dir /tmp/task --items 50

Writes OUT_DIR/nextline.jsonl (one item per line: id, context, choices, answer, line) and
OUT_DIR/nextline.yaml (the lm-evaluation-harness task). How items are drawn:
`latentkv.eval.mc.build_items`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentkv.eval import mc

REPO = Path(__file__).resolve().parent.parent
DEFAULT_HELDOUT = REPO / "src" / "latentkv" / "builtin" / "fixture" / "heldout.txt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = mc.BuildConfig()
    p.add_argument(
        "--heldout", type=Path, default=DEFAULT_HELDOUT, help="held-out text (default: the fixture's)"
    )
    p.add_argument("--out-dir", type=Path, default=mc.TASK_DIR, help="where to write the JSONL and YAML")
    p.add_argument("--items", type=int, default=defaults.items, help=f"items (default: {defaults.items})")
    p.add_argument("--seed", type=int, default=defaults.seed, help=f"seed (default: {defaults.seed})")
    p.add_argument(
        "--context-lines",
        type=int,
        default=defaults.context_lines,
        help=f"at most this many preceding lines (default: {defaults.context_lines})",
    )
    p.add_argument(
        "--context-chars",
        type=int,
        default=defaults.context_chars,
        help=f"at most this many characters of context (default: {defaults.context_chars})",
    )
    args = p.parse_args(argv)
    if not args.heldout.is_file():
        p.error(f"no held-out text at {args.heldout}")
    cfg = mc.BuildConfig(
        items=args.items, seed=args.seed, context_lines=args.context_lines, context_chars=args.context_chars
    )
    items = mc.build_items(args.heldout.read_text(encoding="utf-8"), cfg)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    mc.write_jsonl(items, args.out_dir / "nextline.jsonl")
    try:
        source = args.heldout.resolve().relative_to(REPO)
    except ValueError:
        source = args.heldout.name
    command = f"tools/make_mc_task.py --heldout {source} --items {cfg.items} --seed {cfg.seed}"
    built = f"Built by `{command}` (context: <= {cfg.context_lines} lines, <= {cfg.context_chars} chars)."
    (args.out_dir / "nextline.yaml").write_text(mc.task_yaml("nextline.jsonl", built))
    print(f"{len(items)} items -> {args.out_dir}/nextline.jsonl, nextline.yaml", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
