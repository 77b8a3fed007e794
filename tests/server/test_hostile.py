"""Hostile requests, one test per class of failure (issue 13): each gets an OpenAI-shaped 4xx
naming the field, or is served; never a 500. The server keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _post(server, path: str, **kwargs) -> httpx.Response:
    with server.http() as http:
        return http.post(path, **kwargs)


# --- class 3: extreme sampling values ---------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-39},
        {"temperature": 5e-324},
        {"temperature": 1e-300, "top_p": 1e-46},
        {"top_p": 1e-46},
        {"top_p": 5e-324},
        {"temperature": 1e300},
    ],
)
def test_tiny_and_huge_sampling_values_are_served(server, sampling):
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "seed": 1, **sampling}
    response = _post(server, "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **sampling}
    assert _post(server, "/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": [5], "temperature": NaN}', "temperature"),
        (b'{"prompt": [5], "temperature": Infinity}', "temperature"),
        (b'{"prompt": [5], "temperature": 1e999}', "temperature"),
        (b'{"prompt": [5], "top_p": NaN}', "top_p"),
        (b'{"prompt": [5], "top_p": -1e-300}', "top_p"),
        (b'{"prompt": [5], "temperature": -5e-324}', "temperature"),
    ],
)
def test_nan_inf_and_negative_sampling_values_are_400_naming_the_field(server, raw, param):
    response = _post(server, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert error_of(response, 400)["param"] == param


# --- class 2: text that is not valid Unicode ----------------------------------------------------

LONE = "\ud800"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "caf" + LONE, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udce9"], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "stop": ["a" + LONE]}, "stop"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "session": LONE}, "session"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "model": LONE}, "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi" + LONE}], "max_tokens": 1},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages.0.content.0.text",
        ),
        ("/tokenize", {"prompt": LONE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    """json.dumps writes a lone surrogate as the escape "\\ud800", as a client would send it."""
    raw = json.dumps(body).encode()
    error = error_of(_post(server, path, content=raw, headers={"content-type": "application/json"}), 400)
    assert error["param"] == param and "not valid Unicode" in error["message"], error


def test_detokenize_of_a_partial_character_answers_valid_text(server):
    response = _post(server, "/detokenize", json={"tokens": [0xC3, 5]})  # half of a 2-byte character
    assert response.status_code == 200, response.text
    response.content.decode("utf-8")  # the raw body is valid UTF-8
    assert "\\ud" not in response.text.lower()  # and no escaped surrogate inside the JSON
    assert _post(server, "/v1/completions", json={"prompt": "caf\u00e9", "max_tokens": 1}).status_code == 200


# --- class 8: the contract: strict types, a truthful OpenAPI document, 413, 409 -------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5], "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": [5], "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": [5], "max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {"prompt": [5], "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": [5], "n": "2"}, "n"),
        ("/v1/completions", {"prompt": [5], "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": [5], "temperature": False}, "temperature"),
        ("/v1/completions", {"prompt": [5], "echo": 1}, "echo"),
        ("/v1/completions", {"prompt": [5], "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": [5], "seed": "1"}, "seed"),
        ("/v1/completions", {"prompt": [5], "stop_token_ids": [True]}, "stop_token_ids.0"),
        ("/v1/completions", {"prompt": [5], "ignore_eos": "false"}, "ignore_eos"),
        (
            "/v1/completions",
            {"prompt": [5], "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"},
            "logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ],
)
def test_wrong_json_types_are_400_naming_the_field_never_coerced(server, path, body, param):
    error = error_of(_post(server, path, json=body), 400)
    assert error["param"] == param, error


def test_integers_are_still_numbers_where_floats_are_expected(server):
    body = {"prompt": [5], "max_tokens": 1, "temperature": 0, "top_p": 1}
    assert _post(server, "/v1/completions", json=body).status_code == 200


def test_the_openapi_document_lists_the_errors_actually_sent_and_no_422(server):
    with server.http() as http:
        doc = http.get("/openapi.json").json()
    assert '"422"' not in json.dumps(doc)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "409", "413", "429", "500", "503"} <= set(responses)
        assert "Retry-After" in responses["429"]["headers"]
    for path in ("/tokenize", "/detokenize"):
        assert {"400", "401", "413", "503"} <= set(doc["paths"][path]["post"]["responses"])


def test_a_body_over_the_limit_is_413_declared_or_chunked(server):
    from latentkv.server.app import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    headers = {"content-type": "application/json"}
    error = error_of(_post(server, "/v1/completions", content=big, headers=headers), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: the server counts as it reads
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    assert _post(server, "/tokenize", content=chunks(), headers=headers).status_code == 413
    assert _post(server, "/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200


def test_a_session_locked_by_another_process_is_409_and_is_left_alone(server):
    import fcntl

    server.kv_dir.mkdir(parents=True, exist_ok=True)
    held = server.kv_dir / "held.kv"
    held.write_bytes(b"not even a KV file")
    body = {"prompt": [5, 6], "max_tokens": 1, "session": "held"}
    with open(held, "rb+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # as a `latentkv chat --session held` would hold it
        error = error_of(_post(server, "/v1/completions", json=body), 409)
        assert error["code"] == "session_busy" and error["param"] == "session"
        streamed = _post(server, "/v1/completions", json=body | {"stream": True})
        assert streamed.status_code == 200 and '"session_busy"' in streamed.text  # in-band, then [DONE]
        assert streamed.text.rstrip().endswith("data: [DONE]")
    assert held.read_bytes() == b"not even a KV file"
    assert (
        _post(server, "/v1/completions", json=body).status_code == 200
    )  # free now: refused file moved aside


def test_a_session_path_that_is_a_directory_is_409_and_stays(server):
    (server.kv_dir / "adir.kv").mkdir(parents=True)
    (server.kv_dir / "adir.kv" / "keep").write_text("mine")
    body = {"prompt": [5, 6], "max_tokens": 1, "session": "adir"}
    error = error_of(_post(server, "/v1/completions", json=body), 409)
    assert error["code"] == "session_unavailable" and "directory" in error["message"]
    assert (server.kv_dir / "adir.kv" / "keep").read_text() == "mine"
