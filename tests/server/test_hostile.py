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
