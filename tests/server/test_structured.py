"""Structured output through the live server and the CLI, on the trained builtin:fixture.

Outputs are validated with jsonschema_rs (independent of llguidance, which constrains them).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema_rs
import pytest

from latentkv.cli import main

SCHEMAS = json.loads((Path(__file__).parent.parent / "data" / "json_schemas.json").read_text())
MODEL = "builtin:fixture"


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve):
    live = serve(MODEL, tmp_path_factory.mktemp("structured") / "server.log", "--max-num-seqs", "8")
    yield live
    live.stop()


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_completions_follow_each_of_twenty_schemas(server):
    client = server.client(timeout=120)
    for case in SCHEMAS:
        out = client.completions.create(
            model=MODEL,
            prompt=f"# {case['name']}\nvalue = ",
            max_tokens=160,
            temperature=0,
            extra_body={"response_format": _fmt(case["schema"])},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (case["name"], choice.text)
        jsonschema_rs.validate(case["schema"], json.loads(choice.text))


def test_chat_json_object_and_sampled_choices(server):
    client = server.client(timeout=120)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "give me a config"}],
        response_format={"type": "json_object"},
        max_tokens=120,
        n=3,
        temperature=1.0,
        seed=7,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_a_streamed_answer_joins_into_valid_json(server):
    schema = SCHEMAS[17]["schema"]  # weather_call
    client = server.client(timeout=120)
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        response_format=_fmt(schema),
        max_tokens=120,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop" and len(pieces) > 3
    jsonschema_rs.validate(schema, json.loads("".join(pieces)))


@pytest.mark.parametrize(
    ("response_format", "param", "words"),
    [
        (_fmt({"type": "strnig"}), "response_format.json_schema.schema", "strnig"),
        (_fmt({"type": "string", "pattern": "(("}), "response_format.json_schema.schema", "unclosed group"),
        (_fmt({"$ref": "#/$defs/nowhere"}), "response_format.json_schema.schema", "nowhere"),
        ({"type": "json_schema"}, "response_format", "json_schema"),
        ({"type": "xml"}, "response_format.type", "response_format.type"),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
            "response_format.json_schema.name",
            "name",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, None, "schema"),
    ],
)
def test_a_bad_response_format_is_an_openai_shaped_400(server, response_format, param, words):
    for route, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        response = httpx.post(
            f"{server.url}{route}",
            json={**extra, "max_tokens": 4, "response_format": response_format},
            headers=server.headers,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and words in error["message"]
        if param is not None:
            assert error["param"] == param


def test_generate_json_schema_on_the_cli(capsys, tmp_path):
    schema = SCHEMAS[0]["schema"]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    code = main(
        [
            "generate",
            MODEL,
            "--prompt",
            "person = ",
            "--json-schema",
            str(path),
            "--max-tokens",
            "60",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["stats"]["finish_reason"] == "stop"
    jsonschema_rs.validate(schema, json.loads(out["text"]))


@pytest.mark.parametrize(
    ("content", "words"),
    [('{"type": "strnig"}', "strnig"), ("not json", "not a JSON file"), ("[1]", "is an object")],
)
def test_a_bad_json_schema_file_is_one_line_and_exit_2(capsys, tmp_path, content, words):
    path = tmp_path / "schema.json"
    path.write_text(content)
    code = main(["generate", MODEL, "--prompt", "x", "--json-schema", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, tool):
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    jsonschema_rs.validate(tool["function"]["parameters"], json.loads(call.function.arguments))


def test_a_required_tool_call_comes_back_as_tool_calls(server):
    client = server.client(timeout=120)
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        _check_call(call, WEATHER)


def test_a_named_tool_choice_calls_that_tool(server):
    client = server.client(timeout=120)
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    [call] = out.choices[0].message.tool_calls
    _check_call(call, TIME)


def test_tool_calls_stream_as_deltas(server):
    client = server.client(timeout=120)
    calls, reasons, content = [], [], []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            content.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls" and "".join(content) == ""
    [call] = calls
    assert call.index == 0
    _check_call(call, WEATHER)


def test_auto_without_a_call_is_plain_content(server):
    client = server.client(timeout=120)
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "strnig",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
            "object",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            None,
            "nope",
        ),
        ({"tool_choice": "required"}, None, "tool_choice needs tools"),
        ({"tools": [WEATHER, WEATHER]}, None, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None, "name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    },
                ]
            },
            "messages",
            "not JSON",
        ),
    ],
)
def test_bad_tools_are_openai_shaped_400s(server, extra, param, words):
    body = {"messages": CHAT, "max_tokens": 4, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]
    if param is not None:
        assert error["param"] == param
