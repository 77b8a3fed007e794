"""Constrained decoding: a grammar narrows the tokens a sequence may sample, through llguidance.

    spec = GrammarSpec.json_schema(schema)          # plain data in SamplingParams (crosses the pipe)
    check_grammar(spec)                             # GrammarError naming what is wrong (the 400)
    grammars = Grammars(tokenizer_json, vocab_size, eos_ids)   # once per engine, built lazily
    c = grammars.constraint(spec)                   # per sequence, at admission
    grammars.prepare([c, ...])                      # the step's masks start on a helper thread ...
    logits = model.decode_batch(...)                # ... while the model runs
    token = sample(c.allow(logits_row), ...)        # waits for its mask, -inf where not allowed
    c.consume(token); c.stopped                     # the grammar is complete: the sequence ends

Why llguidance: benchmarks/grammar_mask.py measured it against xgrammar on vocabularies of
GLM-5's and DeepSeek-V3's sizes (docs/server.md#structured-output). It compiles a schema
lazily (no per-schema pass over the vocabulary before the first token) and computes a mask in
Rust with the GIL released, so the step's masks run beside the model's forward pass.

A sequence without a grammar is never touched: its logits row goes to `sample` as it came.
The logprobs a request asks for stay those of the model's own distribution (unmasked).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

KINDS = ("json_schema", "json_object", "lark", "regex")
# JSON as `json.dumps` writes it, ", " and ": " and no other whitespace: a model cannot wander
# off into whitespace (flexible whitespace lets a small model emit newlines for ever).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or schema that cannot constrain anything; the message says what is wrong."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: `kind` one of KINDS, `source` its text (a JSON schema
    as JSON text, a Lark grammar, a regex; empty for json_object)."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema))  # key order kept: properties come in it

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    def grammar(self) -> str:
        """llguidance's grammar text; GrammarError when the source does not convert."""
        from llguidance import LLMatcher

        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; valid: {', '.join(KINDS)}")
        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            return LLMatcher.grammar_from_lark(self.source)
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None


def check_grammar(spec: GrammarSpec) -> None:
    """GrammarError naming what is wrong with the grammar (a schema keyword llguidance does not
    support, a bad regex, a `$ref` that goes nowhere, ...); no tokenizer needed."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(spec.grammar())
    if is_error:
        raise GrammarError(_first_line(messages[0] if messages else "the grammar is invalid"))


def _first_line(message: str) -> str:
    """llguidance's message as one line (a regex error spans several)."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip()) or message


class Constraint:
    """One sequence's grammar state: the tokens it may take next, and whether it is complete."""

    def __init__(self, matcher, grammars: Grammars):
        self.matcher = matcher
        self.grammars = grammars
        self._mask: tuple[Future, torch.Tensor, int] | None = None  # (job, bitmask, row) from prepare

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only end of sequence)."""
        return self.matcher.is_stopped()

    def allow(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with -inf at every token the grammar does not allow now (a new tensor)."""
        if self._mask is None:
            self.grammars.prepare([self])
        job, bitmask, row = self._mask
        self._mask = None
        job.result()
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {self.matcher.get_error()}")
        allowed = unpack(bitmask[row], logits.shape[-1]).to(logits.device)
        if not bool(allowed.any()):
            raise GrammarError("the grammar allows no token here")
        return torch.where(
            allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        )

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask row (int32 words, bit j of word i = token 32 i + j) -> bool [vocab]."""
    bits = (
        words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=words.device)
    ) & 1  # [words, 32]
    return bits.flatten()[:vocab].bool()


class Grammars:
    """Constraints for one tokenizer and vocabulary; masks computed off the calling thread."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None

    def _ready(self):
        """The llguidance tokenizer (built on first use: ~1 s for a 150k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                text = self.tokenizer_json.read_text(encoding="utf-8")
                eos = list(self.eos_ids) or None
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
                self._executor = llguidance.LLExecutor(1)
            if self._pool is None:  # (again after close: the constraints may be used on)
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="latentkv-grammar")
            return self._tokenizer

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh constraint; GrammarError if the grammar does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ready(), spec.grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return Constraint(matcher, self)

    def prepare(self, constraints: list[Constraint]) -> None:
        """Start computing each constraint's next mask (one job for all of them) on the helper
        thread; `Constraint.allow` waits for it. llguidance releases the GIL while it works."""
        if not constraints:
            return
        self._ready()
        # host memory: llguidance writes it through a pointer
        bitmask = torch.zeros(
            (len(constraints), (self.vocab_size + 31) // 32), dtype=torch.int32, device=torch.device("cpu")
        )
        pairs = [(c.matcher, row) for row, c in enumerate(constraints)]

        def fill() -> None:
            self._executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(pairs)
            )

        job = self._pool.submit(fill)
        for row, c in enumerate(constraints):
            c._mask = (job, bitmask, row)

    def close(self) -> None:
        """Stop the helper thread (a later `prepare` starts another)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
