"""Grammar-constrained decoding: per-token mask time of llguidance and xgrammar on vocabularies of
GLM-5's and DeepSeek-V3's sizes (the measurement behind latentkv's choice of library).

No model hub is reachable here, so the tokenizers are built: a byte-level BPE trained with the
`tokenizers` package on Python source (the standard library, then installed packages until the
vocabulary is full) up to GLM-5's vocab_size (154880) and DeepSeek-V3's (129280), with each
model's special tokens (chat roles, tool-call markers) added. They are cached under
~/.cache/latentkv/bench-tokenizers (`--build` makes them; a build takes minutes, untimed).

For every schema of tests/data/json_schemas.json, its example instance is tokenized and walked
token by token: at each position the library computes the allowed-token bitmask (timed), the
example's token is checked to be allowed, and the matcher consumes it; the last mask (where EOS
must be allowed) counts too. Batch 8 runs eight schemas' walks in lock step and times each
step's masks for all eight through the library's batch call (2 threads). Per-token = one
sequence's mask; per-step = the whole batch's. Compile = schema -> matcher, per schema.

    python benchmarks/grammar_mask.py --build                    # once: the two tokenizers
    /work/bin/quiet-run python benchmarks/grammar_mask.py --out benchmarks/results/grammar-mask.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "tests" / "data" / "json_schemas.json"
CACHE = Path(os.environ.get("LATENTKV_CACHE", Path.home() / ".cache" / "latentkv")) / "bench-tokenizers"

# vocab_size from each model's config.json; special tokens from their tokenizer_config.json
VOCABS = {
    "glm5": {
        "vocab_size": 154880,
        "eos": "<|endoftext|>",
        "special": [
            "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<think>",
            "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
            "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink",
        ],
    },
    "deepseek-v3": {
        "vocab_size": 129280,
        "eos": "<｜end▁of▁sentence｜>",
        "special": [
            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>", "<think>", "</think>",
        ],
    },
}  # fmt: skip


def corpus_files(limit_bytes: int) -> list[str]:
    """Python sources: the standard library first, then site-packages, up to limit_bytes."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    out, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            size = path.stat().st_size
            if size > 400_000:
                continue
            out.append(str(path))
            total += size
            if total >= limit_bytes:
                return out
    return out


def build_tokenizer(name: str, corpus_mb: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = VOCABS[name]
    out = CACHE / name / "tokenizer.json"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    files = corpus_files(corpus_mb << 20)
    t0 = time.perf_counter()
    tok.train_from_iterator(_texts(files), trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    print(f"{name}: trained {got} tokens on {len(files)} files in {time.perf_counter() - t0:.0f} s")
    if got < spec["vocab_size"]:
        raise SystemExit(f"{name}: only {got} of {spec['vocab_size']} tokens: raise --corpus-mb")
    tok.save(str(out))
    return out


def _texts(files: list[str]):
    for name in files:
        try:
            yield Path(name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


# --- the two libraries, behind one small interface ---------------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int, threads: int):
        import llguidance

        self.lib = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(threads)
        self.version = importlib.metadata.version("llguidance")

    def matcher(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        m = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int, threads: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.lib = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(threads)
        self.version = importlib.metadata.version("xgrammar")

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


LIBRARIES = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def walk(lib, cases, batch: int, vocab_size: int, eos: int) -> tuple[list[float], list[float]]:
    """Per-step mask seconds over every case's walk, `batch` cases in lock step; compile seconds."""
    steps, compiles = [], []
    bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for start in range(0, len(cases) - batch + 1, batch):
        group = cases[start : start + batch]
        t0 = time.perf_counter()
        matchers = [lib.matcher(c["schema"]) for c in group]
        compiles.append((time.perf_counter() - t0) / batch)
        walks = [c["tokens"] + [eos] for c in group]
        for pos in range(max(len(w) for w in walks)):
            live = [
                (i, m, w[pos]) for i, (m, w) in enumerate(zip(matchers, walks, strict=True)) if pos < len(w)
            ]
            t0 = time.perf_counter()
            if batch == 1:
                lib.fill(live[0][1], bitmask, 0)
            else:
                lib.fill_batch([m for _, m, _ in live], bitmask)
            steps.append((time.perf_counter() - t0, len(live)))
            for row, (_, m, token) in enumerate(live):
                assert allowed(bitmask, row, token), f"{lib.name} refused token {token} at {pos}"
                if token != eos:
                    lib.consume(m, token)
    return steps, compiles


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(name: str, libs: list[str], repeats: int, threads: int) -> list[dict]:
    from tokenizers import Tokenizer

    spec = VOCABS[name]
    path = CACHE / name / "tokenizer.json"
    if not path.exists():
        raise SystemExit(f"no tokenizer at {path}: run with --build first")
    tok = Tokenizer.from_file(str(path))
    eos = tok.token_to_id(spec["eos"])
    schemas = json.loads(SCHEMAS.read_text())
    cases = [
        {"schema": s["schema"], "tokens": tok.encode(json.dumps(s["example"]), add_special_tokens=False).ids}
        for s in schemas
    ]
    rows = []
    for lib_name in libs:
        lib = LIBRARIES[lib_name](str(path), spec["vocab_size"], eos, threads)
        for batch in (1, 8):
            steps, compiles = [], []
            for _ in range(repeats):
                s, c = walk(lib, cases if batch == 1 else cases[:16], batch, spec["vocab_size"], eos)
                steps += s
                compiles += c
            per_step = [t for t, _ in steps]
            per_token = [t / n for t, n in steps]
            rows.append(
                {
                    "vocab": name,
                    "vocab_size": spec["vocab_size"],
                    "library": lib_name,
                    "version": lib.version,
                    "batch": batch,
                    "steps": len(steps),
                    "step_ms_median": 1e3 * statistics.median(per_step),
                    "step_ms_p99": 1e3 * percentile(per_step, 0.99),
                    "token_ms_median": 1e3 * statistics.median(per_token),
                    "token_ms_p99": 1e3 * percentile(per_token, 0.99),
                    "compile_ms_median": 1e3 * statistics.median(compiles),
                    "compile_ms_max": 1e3 * max(compiles),
                }
            )
            r = rows[-1]
            print(
                f"| {name} ({r['vocab_size']}) | {lib_name} {lib.version} | {batch} | "
                f"{r['token_ms_median']:.3f} | {r['token_ms_p99']:.3f} | {r['step_ms_median']:.3f} | "
                f"{r['step_ms_p99']:.3f} | {r['compile_ms_median']:.1f} | {r['compile_ms_max']:.1f} |",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--build", action="store_true", help="train the two tokenizers (cached) and exit")
    parser.add_argument("--corpus-mb", type=int, default=160, help="Python source to train on (MB)")
    parser.add_argument("--vocab", default="glm5,deepseek-v3")
    parser.add_argument("--library", default="llguidance,xgrammar")
    parser.add_argument("--repeats", type=int, default=3, help="walks over the schemas per row")
    parser.add_argument("--threads", type=int, default=2, help="threads of the batch calls")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.vocab.split(",")
    if args.build:
        for name in names:
            build_tokenizer(name, args.corpus_mb)
        return
    print(
        "| vocabulary | library | batch | token median ms | token p99 ms | step median ms | step p99 ms | compile median ms | compile max ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name in names:
        rows += measure(name, args.library.split(","), args.repeats, args.threads)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "benchmark": "grammar_mask",
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "cpu": platform.processor() or platform.machine(),
                    "cpu_model": machine.cpu_model(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "threads": args.threads,
                    "schemas": str(SCHEMAS.relative_to(ROOT)),
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
