"""Streaming detokenization: the incremental Detokenizer against decoding the whole output again
at every token (what `latentkv generate` and `chat` did before it).

    .venv/bin/python benchmarks/detokenize.py --model builtin:fixture --tokens 256,1024,4096 \\
        --out benchmarks/results/detokenize-fixture.json

The text is the fixture's held-out Python (multi-byte characters included); each row is the
median of --repeats runs of streaming its first N tokens, both ways alternating, and reports
microseconds per token. The deltas of both ways are checked to add up to the same text.
Run on an otherwise idle machine (check `uptime`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from latentkv.models.registry import resolve
from latentkv.tokenizer import Detokenizer, Tokenizer


class WholeRedecode:
    """The old way: decode every id so far at each token, emit what grew (held on U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        delta, self.emitted = text[len(self.emitted) :], text
        return delta


def _stream(make, ids: list[int]) -> tuple[float, str]:
    t0 = time.perf_counter()
    streamer = make()
    out = [streamer.push(t) for t in ids]
    out.append(streamer.flush())
    return time.perf_counter() - t0, "".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:fixture")
    p.add_argument("--tokens", default="256,1024,4096", help="comma-separated output lengths")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    directory = resolve(args.model)
    tok = Tokenizer(directory)
    text = (
        (directory / "heldout.txt").read_text()
        if (directory / "heldout.txt").exists()
        else "héllo wörld € " * 4000
    )
    all_ids = tok.encode(text, add_special_tokens=False)
    _stream(lambda: Detokenizer(tok), all_ids[:64])  # warm up both before timing
    _stream(lambda: WholeRedecode(tok), all_ids[:64])
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        ids = all_ids[:n]
        new, old = [], []
        for r in range(args.repeats):
            order = [("new", lambda: Detokenizer(tok)), ("old", lambda: WholeRedecode(tok))]
            for name, make in order if r % 2 == 0 else order[::-1]:
                seconds, out = _stream(make, ids)
                assert out == tok.decode(ids), f"{name} streamed text differs from the full decode"
                (new if name == "new" else old).append(seconds)
        rows.append(
            {
                "tokens": len(ids),
                "incremental_us_per_token": round(statistics.median(new) / len(ids) * 1e6, 2),
                "whole_redecode_us_per_token": round(statistics.median(old) / len(ids) * 1e6, 2),
            }
        )
    print(f"{'tokens':>7} {'incremental us/token':>21} {'re-decode us/token':>19}")
    for row in rows:
        print(
            f"{row['tokens']:>7} {row['incremental_us_per_token']:>21} {row['whole_redecode_us_per_token']:>19}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
