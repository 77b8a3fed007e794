"""Constrained decoding (engine.grammar) on the trained builtin:fixture.

Every output is checked with jsonschema_rs, a validator independent of llguidance; the mixed
batch is checked against the plain engine running each free request alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from latentkv.engine.generate import generate
from latentkv.engine.grammar import GrammarError, Grammars, GrammarSpec, check_grammar, unpack
from latentkv.engine.request import Request
from latentkv.engine.sampling import SamplingParams
from latentkv.engine.scheduler import Scheduler
from latentkv.models.registry import builtin_path
from latentkv.models.weights import load_model
from latentkv.tokenizer import Tokenizer

SCHEMAS = json.loads((Path(__file__).parent.parent / "data" / "json_schemas.json").read_text())
EOS = 0  # the fixture's <|endoftext|>


@pytest.fixture(scope="module")
def fixture():
    directory = builtin_path("fixture")
    model = load_model(directory, device="cpu")
    grammars = Grammars(directory / "tokenizer.json", model.cfg.vocab_size, (EOS,))
    yield model, Tokenizer(directory), grammars
    grammars.close()


def _scheduler(model, grammars, **kwargs) -> Scheduler:
    scheduler = Scheduler(model, model.tier(), grammars=grammars, **kwargs)
    scheduler.start()
    return scheduler


def _tokens(handle) -> tuple[list[int], object]:
    events = list(handle)
    return [e.token for e in events[:-1]], events[-1]


def test_the_twenty_schemas_examples_are_valid():
    """The test data itself: each example is an instance of its schema."""
    assert len(SCHEMAS) == 20
    for case in SCHEMAS:
        jsonschema_rs.validate(case["schema"], case["example"])


def test_unpack_reads_bit_j_of_word_i_as_token_32i_plus_j():
    words = torch.tensor([1 | -(1 << 31), 1 << 3], dtype=torch.int32)  # bit 31 is the sign bit
    allowed = unpack(words, 40)
    assert allowed.nonzero().flatten().tolist() == [0, 31, 35]


def test_schema_valid_json_on_twenty_schemas(fixture):
    model, tok, grammars = fixture
    scheduler = _scheduler(model, grammars, max_num_seqs=8)
    try:
        handles = [
            scheduler.submit(
                Request(
                    tok.encode(f"# {case['name']}\nconfig = "),
                    SamplingParams(max_tokens=160, grammar=GrammarSpec.json_schema(case["schema"])),
                )
            )
            for case in SCHEMAS
        ]
        for case, handle in zip(SCHEMAS, handles, strict=True):
            tokens, finished = _tokens(handle)
            text = tok.decode(tokens)
            assert finished.reason == "stop", (case["name"], text)
            jsonschema_rs.validate(case["schema"], json.loads(text))
    finally:
        scheduler.shutdown()


def test_a_mixed_batch_leaves_the_free_requests_tokens_alone(fixture):
    """Free requests batched beside constrained ones: the tokens each gets alone (plain engine)."""
    model, tok, grammars = fixture
    text = (builtin_path("fixture") / "heldout.txt").read_text()
    free = [(tok.encode(text[400 * i : 400 * i + 200]), 12 + i) for i in range(3)]
    scheduler = _scheduler(model, grammars, max_num_seqs=6)
    try:
        constrained = [
            scheduler.submit(
                Request(
                    tok.encode("settings = "),
                    SamplingParams(max_tokens=40, grammar=GrammarSpec.json_schema(SCHEMAS[i]["schema"])),
                )
            )
            for i in range(3)
        ]
        handles = [scheduler.submit(Request(p, SamplingParams(max_tokens=n))) for p, n in free]
        batched = [_tokens(h)[0] for h in handles]
        for handle in constrained:
            assert _tokens(handle)[1].reason == "stop"
    finally:
        scheduler.shutdown()
    for (prompt, n), got in zip(free, batched, strict=True):
        alone = generate(model, prompt, n, SamplingParams(), stop_ids=(EOS,)).tokens
        assert got == alone


def test_generate_with_a_constraint_follows_the_schema(fixture):
    model, tok, grammars = fixture
    schema = SCHEMAS[17]["schema"]  # weather_call
    out = generate(
        model,
        tok.encode("call = "),
        100,
        SamplingParams(temperature=0.8, seed=5),
        tokenizer=tok,
        stop_ids=(EOS,),
        constraint=grammars.constraint(GrammarSpec.json_schema(schema)),
    )
    assert out.stats.finish_reason == "stop"
    jsonschema_rs.validate(schema, json.loads(out.text))


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "strnig"}, "strnig"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "integer", "minimum": "zero"}, "minimum"),
    ],
)
def test_a_bad_schema_names_what_is_wrong(schema, words):
    with pytest.raises(GrammarError, match=words):
        check_grammar(GrammarSpec.json_schema(schema))


def test_a_scheduler_without_grammars_refuses_a_grammar(fixture):
    model, _, _ = fixture
    scheduler = Scheduler(model, model.tier())
    with pytest.raises(ValueError, match="tokenizer.json"):
        scheduler.submit(Request([5, 6], SamplingParams(grammar=GrammarSpec.json_object())))
