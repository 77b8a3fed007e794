"""Structured output: a request's `response_format` -> the grammar its choices are decoded under.

    grammar = response_grammar(body, ready)     # None for text; 400 naming what is wrong

`json_object` is any JSON object; `json_schema` is the schema's instances (strict or not: the
output is constrained either way, as vLLM does). The grammar is checked here, in the HTTP
process, so a bad schema is a 400 before anything is queued; the engine compiles it again
against the model's tokenizer at admission (engine.grammar).
"""

from __future__ import annotations

from latentkv.engine.grammar import GrammarError, GrammarSpec, check_grammar
from latentkv.server.errors import bad_request


def response_grammar(body, ready) -> GrammarSpec | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        spec, where = GrammarSpec.json_object(), "response_format"
    else:
        schema = fmt.json_schema.schema_
        spec = GrammarSpec.json_schema({} if schema is None else schema)
        where = "response_format.json_schema.schema"
    return checked(spec, where, ready)


def checked(spec: GrammarSpec, where: str, ready) -> GrammarSpec:
    """`spec` if it compiles (and the model can run grammars), else a 400 naming `where`."""
    if ready.tokenizer is None:
        raise bad_request("structured output needs the model's tokenizer.json", param=where)
    try:
        check_grammar(spec)
    except GrammarError as exc:
        raise bad_request(f"{where}: {exc}", param=where) from None
    return spec
