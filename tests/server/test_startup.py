"""Before the model is up: /health says 503 + Retry-After, the key gate and error shapes already
hold, and `latentkv serve` refuses bad flags before it binds a socket."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from latentkv.cli import main
from latentkv.config import EngineConfig, ServerConfig
from latentkv.server.app import create_app
from latentkv.server.state import ServerState


def _request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)  # no lifespan: the model never starts loading
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def _loading_app(api_key: str | None = None):
    config = ServerConfig(
        model="builtin:tiny", served_model_name="tiny", engine=EngineConfig(), api_key=api_key
    )
    return create_app(ServerState(config))


def _assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_health_is_503_with_retry_after_while_loading():
    app = _loading_app()
    response = _request(app, "GET", "/health")
    error = _assert_error_shape(response, 503)
    assert int(response.headers["retry-after"]) > 0 and "loading" in error["message"]
    response = _request(app, "POST", "/v1/completions", json={"prompt": "hi"})
    _assert_error_shape(response, 503)
    metrics = _request(app, "GET", "/metrics")
    assert metrics.status_code == 200 and 'latentkv_model_loaded{model_name="tiny"} 0.0' in metrics.text


def test_a_key_is_required_everywhere_but_health_and_metrics():
    app = _loading_app(api_key="sesame")
    missing = _assert_error_shape(_request(app, "GET", "/v1/models"), 401)
    wrong = _assert_error_shape(
        _request(app, "GET", "/v1/models", headers={"Authorization": "Bearer nope"}), 401
    )
    assert "missing" in missing["message"] and "invalid" in wrong["message"]
    assert missing["type"] == "authentication_error" and missing["code"] == "invalid_api_key"
    for path in ("/tokenize", "/detokenize"):
        _assert_error_shape(_request(app, "POST", path, json={}), 401)
    _assert_error_shape(_request(app, "GET", "/tokenizer_info"), 401)
    # The right key passes the gate (and meets the loading model); /health needs no key.
    ok = _request(app, "GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
    _assert_error_shape(ok, 503)
    _assert_error_shape(_request(app, "GET", "/health"), 503)


def test_unknown_routes_are_404_in_the_error_shape():
    error = _assert_error_shape(_request(_loading_app(), "GET", "/v1/nothing"), 404)
    assert "/v1/nothing" in error["message"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "999999"], "exceeds the model's context"),
        (["--kv-cache-dtype", "q3_k"], "unknown --kv-cache-dtype"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be an integer from 1 to"),
        (["--port", "70000"], "--port must be in 0..65535"),
    ],
)
def test_serve_refuses_bad_flags_before_binding(flags, message, capsys):
    assert main(["serve", "builtin:tiny", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_missing_model(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
