"""Tool calls: the model's syntax as its chat template writes it, parsed back into OpenAI's
`tool_calls` (whole and streamed); the grammar that forces a call produces what the parser reads.

The templates in tests/data/templates follow GLM-5's and DeepSeek-V3's conventions (see
docs/server.md#tool-calls); a conversation with an assistant's calls is rendered through them and
the assistant's turn is parsed back.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from latentkv.chat_template import compile_template, render_template
from latentkv.engine.grammar import Grammars, GrammarSpec, check_grammar
from latentkv.models.registry import builtin_path
from latentkv.server.tools import FORMATS, StreamingToolParser, format_for

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "units": {"enum": ["c", "f"]},
            },
            "required": ["city", "days"],
        },
    },
}
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "units": "c"}),
    ("get_weather", {"city": "Oslo", "days": 1}),
]
# (template, format, where the assistant's turn starts, what ends it)
CASES = {
    "glm": ("glm5.jinja", "<|assistant|>\n", "<|observation|>"),
    "deepseek": ("deepseek_v3.jinja", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
}


def _assistant_turn(name: str, content: str) -> str:
    template, start, end = CASES[name]
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(CALLS)
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
    ]
    text = render_template(
        compile_template((TEMPLATES / template).read_text()),
        messages,
        False,
        {"bos_token": "<s>", "tools": [WEATHER]},
    )
    assert "get_weather" in text.split(start)[0]  # the tools are shown before the conversation
    return text.split(start, 1)[1].split(end, 1)[0]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("content", ["", "Let me check."])
def test_calls_rendered_by_the_template_parse_back(name, content):
    turn = _assistant_turn(name, content)
    parsed = FORMATS[name].parse(turn)
    assert parsed is not None, turn
    got_content, calls = parsed
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed_calls_parse_like_whole_ones(name, chunk):
    turn = _assistant_turn(name, "Checking the weather.")
    parser = StreamingToolParser(FORMATS[name])
    streamed = "".join(parser.push(turn[i : i + chunk]) for i in range(0, len(turn), chunk))
    rest, calls = parser.finish()
    assert streamed + rest == "Checking the weather."
    assert "<" not in streamed  # no part of a marker was released as content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


@pytest.mark.parametrize("name", list(CASES))
def test_text_without_calls_or_broken_calls_stays_content(name):
    fmt = FORMATS[name]
    assert fmt.parse("just text, a < sign and <tool") is None
    broken = _assistant_turn(name, "").replace("Paris", 'Par"is').replace('"days": 3', '"days": 3,,')
    if name == "deepseek":
        assert fmt.parse(broken) is None  # arguments that are not JSON
    parser = StreamingToolParser(fmt)
    text = parser.push("plain answer < 3")
    rest, calls = parser.finish()
    assert text + rest == "plain answer < 3" and calls == []


def test_model_types_choose_the_convention():
    assert format_for("glm_moe_dsa").name == "glm" and format_for("deepseek_v3").name == "deepseek"
    assert format_for("deepseek_v32").name == "deepseek"


@pytest.fixture(scope="module")
def fixture_grammars():
    directory = builtin_path("fixture")
    grammars = Grammars(directory / "tokenizer.json", 4096, (0,))
    from latentkv.tokenizer import Tokenizer

    yield grammars, Tokenizer(directory)
    grammars.close()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_forcing_grammar_yields_calls_the_parser_reads(fixture_grammars, name, seed):
    """Random logits under the forcing grammar: whatever comes out parses into calls to the tool
    with arguments valid against its parameters."""
    grammars, tok = fixture_grammars
    fmt = FORMATS[name]
    spec = GrammarSpec("lark", fmt.grammar([WEATHER], None, many=False))
    check_grammar(spec)
    constraint = grammars.constraint(spec)
    generator = torch.Generator().manual_seed(seed)
    bias = torch.zeros(4096)
    for closing in ("<", '"', "}"):  # leave strings soon, close calls soon
        bias[tok.encode(closing)] = 3.0
    ids = []
    for _ in range(400):
        logits = torch.randn(4096, generator=generator) + bias
        token = int(constraint.allow(logits).argmax())
        constraint.consume(token)
        ids.append(token)
        if constraint.stopped or token == 0:
            break
    text = tok.decode([t for t in ids if t != 0])
    parsed = fmt.parse(text)
    assert parsed is not None, text
    assert len(parsed[1]) == 1
    for call in parsed[1]:
        assert call.name == "get_weather"
        jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(call.arguments))
