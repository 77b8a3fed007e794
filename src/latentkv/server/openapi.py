"""/openapi.json as the server answers: every error status a route can send, in OpenAI's error
shape, and no 422 (FastAPI's default, which this server never sends: errors.install).

Which statuses each route sends (docs/server.md, "Errors"):
    400  a body that does not validate (wrong type, out of range, not valid Unicode, bad JSON)
    401  --api-key is set and the key is missing or wrong (every route but /health, /metrics)
    404  an unknown model (or a model without tokenizer.json, for /tokenizer_info)
    408  the request's headers or body did not arrive within --request-timeout (any route)
    409  a session file held by another process, or a session path that is not a file
    413  a body over MAX_BODY_BYTES (any route)
    429  the request's sequences do not fit beside the open ones; Retry-After
    500  the model failed on this request
    503  the model is loading, failed to load or stopped; the server is shutting down; an expert
         the request needs is damaged on disk (also /health while it is), or the disk refused a
         session file; Retry-After
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from latentkv.server.errors import TYPES

DESCRIPTIONS = {
    400: "invalid request: a field of the wrong type or out of range, text that is not valid Unicode, "
    "JSON that does not parse, prompt + max_tokens over the context",
    401: "--api-key is set and the Authorization: Bearer key is missing or wrong",
    404: "unknown model (or no tokenizer.json)",
    408: "the request's headers or body did not arrive within --request-timeout; the connection is closed",
    409: "the session's file is held by another process, or its path is not a regular file",
    413: "the request body is over the server's limit",
    429: "the server's sequences (--max-num-seqs + --max-queue) are taken; retry after Retry-After",
    500: "the model failed on this request (other requests go on)",
    503: "the model is loading, failed to load or stopped, or the server is shutting down; an expert the "
    "request needs is damaged on disk (/health: the expert store is degraded), or the disk refused a session file",
}
GENERATE = (400, 401, 404, 408, 409, 413, 429, 500, 503)
ROUTE_ERRORS = {
    "/health": (408, 413, 503),
    "/metrics": (408, 413),
    "/v1/models": (401, 408, 413, 503),
    "/v1/models/{model_id}": (401, 404, 408, 413, 503),
    "/v1/completions": GENERATE,
    "/v1/chat/completions": GENERATE,
    "/tokenize": (400, 401, 404, 408, 413, 503),
    "/detokenize": (400, 401, 404, 408, 413, 503),
    "/tokenizer_info": (401, 404, 408, 413, 503),
}
RETRY_AFTER = (429, 503)
STREAMING = ("/v1/completions", "/v1/chat/completions")
ERROR_SCHEMA = {
    "type": "object",
    "title": "ErrorResponse",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": sorted(set(TYPES.values()))},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def install(app: FastAPI) -> None:
    """Replace app.openapi with the truthful document (built once)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi


def document(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = ERROR_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        statuses = ROUTE_ERRORS.get(path.replace(":path", ""), (408, 413))
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/metrics":  # Prometheus text, not JSON
                operation["responses"]["200"] = {
                    "description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            if path in STREAMING:  # "stream": true answers server-sent events
                ok = responses.setdefault("200", {"description": "Successful Response"})
                events = {"description": "data: {chunk JSON}, then data: [DONE]", "schema": {}}
                ok.setdefault("content", {})["text/event-stream"] = events
            for status in statuses:
                responses[str(status)] = _error_response(status)
    return schema


def _error_response(status: int) -> dict:
    response = {
        "description": DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if status in RETRY_AFTER:
        response["headers"] = {
            "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
        }
    return response
