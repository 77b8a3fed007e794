"""Tool calls: the model's own tool-call syntax <-> OpenAI's `tool_calls`.

The model writes calls in its chat template's syntax; the server turns them into OpenAI's
`{"id", "type": "function", "function": {"name", "arguments"}}` (whole, and streamed as
`delta.tool_calls`), and with `tool_choice` "required" or a named function constrains the
output to that syntax with the tools' parameter schemas (engine.grammar, a Lark grammar).

Two conventions, chosen by the model's config.json `model_type` (written from the templates
as shipped with the models; see docs/server.md#tool-calls):

GLM (glm_moe_dsa: GLM-5, as the GLM-4.5 family writes it), one block per call:
    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>
    a string VALUE is written raw, any other as JSON; newlines between the parts are allowed.

DeepSeek (deepseek_v3, deepseek_v32), all calls in one block:
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGUMENTS}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    (V3.1's shorter `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGUMENTS}<｜tool▁call▁end｜>` is read too)

Text before the first call is the message's `content`; a call that does not parse (unknown
syntax, arguments that are not JSON) leaves the whole output as content, as vLLM's parsers do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object

    def openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out if index is None else {"index": index, **out}


class GlmFormat:
    name = "glm"
    start = "<tool_call>"
    end = "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*([^<\s]+)\s*(.*?)\s*</tool_call>", re.S)
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls), or None when there is no call."""
        at = text.find(self.start)
        if at == -1:
            return None
        calls, pos = [], at
        for match in self._CALL.finditer(text, at):
            if text[pos : match.start()].strip():
                return None  # text between calls: not the model's call syntax
            body = match.group(2)
            args = {k.strip(): _glm_value(v) for k, v in self._ARG.findall(body)}
            if self._ARG.sub("", body).strip():
                return None
            calls.append(ToolCall(match.group(1), json.dumps(args, ensure_ascii=False)))
            pos = match.end()
        if not calls or text[pos:].strip():
            return None
        return text[:at].rstrip(), calls

    def grammar(self, tools: list[dict], token_id, many: bool = True) -> str:
        """Lark: one call (or with `many`, one or more) to these tools, arguments following each tool's schema (a
        string argument is any text without '<'). `token_id(marker)`: the marker's id when the
        tokenizer has it as one token (then the grammar asks for that token)."""
        m = {k: _marker(k, token_id) for k in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>")}
        m.update({k: _marker(k, token_id) for k in ("<arg_value>", "</arg_value>")})
        rules, alts = [], []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object"}
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            parts = []
            for j, (key, schema) in enumerate(props.items()):
                value = f"v{i}_{j}"
                rules.append(
                    f"{value}: {_glm_string(schema)}"
                    if _is_string(schema)
                    else f"{value}: %json {_json_rule(schema)}"
                )
                part = f'{m["<arg_key>"]} "{_lark_text(key)}" {m["</arg_key>"]} {m["<arg_value>"]} {value} {m["</arg_value>"]}'
                parts.append(part if key in required else f"({part})?")
            rules.append(
                f'call{i}: {m["<tool_call>"]} "{_lark_text(fn["name"])}" {" ".join(parts)} {m["</tool_call>"]}'
            )
            alts.append(f"call{i}")
        return f"start: ({' | '.join(alts)}){'+' if many else ''}\n" + "\n".join(rules)


def _glm_value(raw: str):
    """A GLM argument value: JSON when it parses as JSON (numbers, objects, ...), else the text."""
    raw = raw.strip()
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class DeepSeekFormat:
    name = "deepseek"
    start = "<｜tool▁calls▁begin｜>"
    end = "<｜tool▁calls▁end｜>"
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>\s*(?:function\s*<｜tool▁sep｜>\s*(?P<name3>[^\n<]+?)\s*\n\s*```(?:json)?\s*"
        r"(?P<args3>.*?)\s*```|(?P<name31>[^<]+?)\s*<｜tool▁sep｜>\s*(?P<args31>.*?))\s*<｜tool▁call▁end｜>",
        re.S,
    )

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        at = text.find(self.start)
        if at == -1:
            return None
        inner_start = at + len(self.start)
        stop = text.find(self.end, inner_start)
        if stop == -1 or text[stop + len(self.end) :].strip():
            return None
        inner, calls, pos = text[inner_start:stop], [], 0
        for match in self._CALL.finditer(inner):
            if inner[pos : match.start()].strip():
                return None
            name = match.group("name3") or match.group("name31")
            args = match.group("args3") if match.group("name3") else match.group("args31")
            try:
                parsed = json.loads(args)
            except ValueError:
                return None
            if not isinstance(parsed, dict):
                return None
            calls.append(ToolCall(name.strip(), json.dumps(parsed, ensure_ascii=False)))
            pos = match.end()
        if not calls or inner[pos:].strip():
            return None
        return text[:at].rstrip(), calls

    def grammar(self, tools: list[dict], token_id, many: bool = True) -> str:
        """Lark: the calls block with one call (or with `many`, one or more), arguments following
        each schema."""
        m = {
            k: _marker(k, token_id)
            for k in (self.start, self.end, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
        }
        rules, alts = [], []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object"}
            rules.append(f"args{i}: %json {_json_rule(params)}")
            rules.append(
                f'call{i}: {m["<｜tool▁call▁begin｜>"]} "function" {m["<｜tool▁sep｜>"]} '
                f'"{_lark_text(fn["name"])}\\n```json\\n" args{i} "\\n```" {m["<｜tool▁call▁end｜>"]}'
            )
            alts.append(f"call{i}")
        more = "+" if many else ""
        return f"start: {m[self.start]} ({' | '.join(alts)}){more} {m[self.end]}\n" + "\n".join(rules)


FORMATS = {"glm": GlmFormat(), "deepseek": DeepSeekFormat()}
BY_MODEL_TYPE = {
    "glm_moe_dsa": "glm",
    "glm4_moe": "glm",
    "deepseek_v3": "deepseek",
    "deepseek_v32": "deepseek",
}


def format_for(model_type: str | None):
    """The tool-call convention of a model_type (GLM's for any other: the bundled models are GLM-5)."""
    return FORMATS[BY_MODEL_TYPE.get(model_type or "", "glm")]


def _marker(text: str, token_id) -> str:
    """A marker in Lark: its token by id when the tokenizer has it whole, else the text."""
    tid = token_id(text) if token_id is not None else None
    return f"<[{tid}]>" if tid is not None else f'"{_lark_text(text)}"'


def _json_rule(schema: dict) -> str:
    """A schema for Lark's %json, written as JSON is everywhere else here (engine.grammar)."""
    from latentkv.engine.grammar import JSON_OPTIONS

    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _is_string(schema) -> bool:
    """A plain string argument: GLM writes it raw (a pattern or format goes through JSON)."""
    plain = isinstance(schema, dict) and not any(k in schema for k in ("enum", "const", "pattern", "format"))
    return plain and schema.get("type") == "string"


def _glm_string(schema: dict) -> str:
    """A raw GLM string value within the schema's lengths: any text without '<'."""
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    return f"/[^<]{{{low},{int(high)}}}/" if high is not None else f"/[^<]{{{low},}}/"


def _lark_text(text: str) -> str:
    return json.dumps(text)[1:-1]


class StreamingToolParser:
    """Streamed text -> content deltas and, once the calls are complete, tool_call deltas.

    Content is released while it cannot be the start of a call; from the start marker on, text
    is held until the output ends, then parsed whole (a call is sent in one delta, as
    llama-server does; partial arguments are not streamed)."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.held = ""
        self.in_call = False
        self.seen = ""

    def push(self, text: str) -> str:
        """Content to send now."""
        self.seen += text
        if self.in_call:
            self.held += text
            return ""
        self.held += text
        at = self.held.find(self.fmt.start)
        if at != -1:
            out, self.held, self.in_call = self.held[:at], self.held[at:], True
            return out
        keep = _partial_suffix(self.held, self.fmt.start)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still held, the calls) at the end of the output."""
        if self.in_call:
            parsed = self.fmt.parse(self.held)
            if parsed is not None:
                return parsed[0], parsed[1]
        return self.held, []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolUse:
    """A chat request's tools: what the template shows, how calls are read, what is forced."""

    definitions: list[dict] | None = None  # to the chat template as `tools`
    format: object | None = None  # GlmFormat / DeepSeekFormat: calls are parsed from the output
    grammar: object | None = None  # engine.grammar.GrammarSpec when tool_choice forces a call

    @classmethod
    def of(cls, body, ready) -> ToolUse:
        """From the request; a tool whose parameters are not a usable JSON Schema is a 400."""
        from latentkv.engine.grammar import GrammarError, GrammarSpec, check_grammar
        from latentkv.server.errors import bad_request
        from latentkv.server.structured import checked

        if not body.tools or body.tool_choice == "none":
            return cls()
        definitions = [tool.model_dump(exclude_none=True) for tool in body.tools]
        for i, tool in enumerate(definitions):
            params = tool["function"].get("parameters")
            where = f"tools[{i}].function.parameters"
            if params is not None and params.get("type", "object") != "object":
                raise bad_request(f"{where}: the arguments are an object (type must be object)", param=where)
            try:
                check_grammar(GrammarSpec.json_schema(params or {"type": "object"}))
            except GrammarError as exc:
                raise bad_request(f"{where}: {exc}", param=where) from None
        fmt = format_for(ready.cfg.model_type)
        grammar = None
        if body.tool_choice == "required" or not isinstance(body.tool_choice, (str, type(None))):
            chosen = definitions
            if not isinstance(body.tool_choice, str):
                chosen = [t for t in definitions if t["function"]["name"] == body.tool_choice.function.name]
            token_id = _whole_token(ready.tokenizer)
            many = body.parallel_tool_calls is not False
            grammar = checked(GrammarSpec("lark", fmt.grammar(chosen, token_id, many)), "tools", ready)
        return cls(definitions, fmt, grammar)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; no calls (all content) when none parse."""
        parsed = self.format.parse(text) if self.format is not None else None
        return parsed if parsed is not None else (text, [])

    def stream_parser(self) -> StreamingToolParser | None:
        return StreamingToolParser(self.format) if self.format is not None else None


def _whole_token(tokenizer):
    """marker -> its id when the tokenizer encodes it as that one token, else None."""

    def token_id(text: str) -> int | None:
        if tokenizer is None:
            return None
        tid = tokenizer.token_to_id(text)
        return tid if tid is not None and tokenizer.encode(text, add_special_tokens=False) == [tid] else None

    return token_id
