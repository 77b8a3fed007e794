"""benchmarks/grammar_mask.py on a small vocabulary (the fixture's): every example token is
allowed by each library's masks, and the walk times what it should (one step per token + EOS)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from latentkv.models.registry import builtin_path

ROOT = Path(__file__).resolve().parent.parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("grammar_mask", ROOT / "benchmarks" / "grammar_mask.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("library", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_walk_allows_every_example_token(library, batch):
    if library == "xgrammar":
        pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer

    bench = _bench()
    path = builtin_path("fixture") / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    schemas = json.loads(bench.SCHEMAS.read_text())[:8]
    cases = [
        {"schema": s["schema"], "tokens": tok.encode(json.dumps(s["example"]), add_special_tokens=False).ids}
        for s in schemas
    ]
    lib = bench.LIBRARIES[library](str(path), 4096, 0, 1)
    steps, compiles = bench.walk(lib, cases, batch, 4096, 0)  # asserts each token is allowed
    assert len(compiles) == len(cases) // batch
    expected = (
        sum(len(c["tokens"]) + 1 for c in cases) if batch == 1 else max(len(c["tokens"]) + 1 for c in cases)
    )
    assert len(steps) == expected
    assert all(t >= 0 and 1 <= n <= batch for t, n in steps)
