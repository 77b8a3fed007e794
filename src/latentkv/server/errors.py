"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure.

FastAPI's own answers are replaced: a body that does not validate is 400 (never 422), an
unknown route 404, and an unexpected exception 500, all in the same shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("latentkv.server")

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An HTTP error answer: status, message and OpenAI's type/param/code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def install(app: FastAPI) -> None:
    """Route every error through APIError's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = describe_validation(exc.errors())
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def describe_validation(errors) -> tuple[str, str | None]:
    """The first validation error as one readable line, and the field it names (OpenAI's `param`)."""
    if not errors:
        return "invalid request", None
    # A value's own check (e.g. invalid Unicode in one alternative of a union) says more than
    # the other alternatives' type mismatches.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    raw_loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union field (prompt, content, stop) reports each alternative's type name in loc: drop them.
    loc = [part for part in raw_loc if not _is_type_name(part)]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    if first.get("type") == "missing":
        message = "field required"
    param = ".".join(loc) or None
    if loc != raw_loc and loc and loc[-1] in UNION_FIELDS:  # every alternative failed: say what fits
        return f"{param}: must be {UNION_FIELDS[loc[-1]]}", param
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {message}" if param else message) + more, param


UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}


def _is_type_name(part: str) -> bool:
    # exact names, not prefixes: "stream" and "stream_options" are fields, "str" a type
    return part.startswith(("list[", "function-", "constrained-")) or part in (
        "str",
        "int",
        "TextPart",
        "StrictInt",
    )
