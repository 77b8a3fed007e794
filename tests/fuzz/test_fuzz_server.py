"""Schemathesis against a live server, from the server's own /openapi.json (issue 13).

Cases come from every operation's documented request schema, valid ones (positive) and ones
that break it (negative: wrong types, missing fields, out-of-range values). Every answer must
be one the document lists for that operation, in its content type and schema (the OpenAI
error shape for errors), and never a 5xx or a traceback; after the run the server still
serves, its log holds no traceback and its session folder lost nothing.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from budget import long, quick
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory):
    """builtin:tiny with a short context (a case asking for many tokens is a quick 400), a
    session folder holding one session to keep, and a queue small enough to reach 429."""
    root = tmp_path_factory.mktemp("fuzz-server")
    kv = root / "kv"
    flags = ["--max-model-len", "48", "--max-num-seqs", "2", "--max-queue", "16", "--kv-dir", str(kv)]
    live = serve("builtin:tiny", root / "server.log", *flags)
    live.kv_dir = kv
    with live.http() as http:  # a saved session: the fuzz must not lose it
        assert (
            http.post(
                "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "session": "keep"}
            ).status_code
            == 200
        )
    live.kept = (kv / "keep.kv").read_bytes()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers, timeout=30)


@pytest.fixture(scope="module")
def operations(schema) -> list:
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    return ops


def _one_case(server, operations, data) -> None:
    operation = data.draw(st.sampled_from(operations), label="operation")
    mode = data.draw(st.sampled_from(MODES), label="mode")
    case = data.draw(operation.as_strategy(generation_mode=mode), label="case")
    response = case.call(base_url=server.url, headers=server.headers, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    case.validate_response(response, checks=CHECKS)


def _still_serves(server) -> None:
    with server.http() as http:
        ok = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert http.get("/health").status_code == 200
    assert server.process.poll() is None
    assert "Traceback" not in server.log_text()
    assert (server.kv_dir / "keep.kv").read_bytes() == server.kept  # nothing on disk lost


@quick(scale=2.5)
@given(data=st.data())
def test_schemathesis_cases_get_documented_answers(server, operations, data):
    _one_case(server, operations, data)


def test_the_server_still_serves_after_the_fuzz(server):
    _still_serves(server)


@pytest.mark.slow
@long()
@given(data=st.data())
def test_schemathesis_cases_long(server, operations, data):
    _one_case(server, operations, data)


@pytest.mark.slow
def test_the_server_still_serves_after_the_long_fuzz(server):
    _still_serves(server)


def test_the_document_is_the_one_served(server):
    """The fuzz reads what clients read: /openapi.json behind the same key, no 422 anywhere."""
    with httpx.Client(base_url=server.url, headers=server.headers) as http:
        doc = http.get("/openapi.json").json()
    assert '"422"' not in str(doc).replace("'", '"')
