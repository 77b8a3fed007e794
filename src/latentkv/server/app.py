"""The FastAPI application: routes, the API-key gate, request counting, startup and shutdown.

    GET  /health                 200 once the model serves; 503 + Retry-After while it loads
    GET  /metrics                Prometheus exposition through prometheus_client (server.metrics)
    GET  /v1/models              the served model (and GET /v1/models/{id})
    POST /v1/completions         server.completions
    POST /v1/chat/completions    server.chat
    POST /tokenize, POST /detokenize, GET /tokenizer_info   vLLM's tokenizer endpoints

With an API key set, every route but /health and /metrics needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from latentkv import version
from latentkv.server import errors, openapi
from latentkv.server.chat import create_chat_completion
from latentkv.server.completions import create_completion
from latentkv.server.errors import APIError, bad_request
from latentkv.server.generation import check_model
from latentkv.server.prompts import check_ids, encode
from latentkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from latentkv.server.state import Ready, ServerState
from latentkv.server.timeouts import read_body, timeout_error

log = logging.getLogger("latentkv.server")
OPEN_PATHS = ("/health", "/metrics")
ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)
LOADING_RETRY_S = 5
MAX_BODY_BYTES = 32 << 20  # a larger request body is 413 (read no further)
SAMPLE_EVERY_S = 1.0


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        sampler = asyncio.create_task(_sample(state))
        try:
            yield
        finally:
            sampler.cancel()
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="latentkv", version=version(), lifespan=lifespan)
    app.state.latentkv = state
    errors.install(app)
    openapi.install(app)
    app.add_middleware(Gate, state=state)
    served = state.config.served_model_name

    @app.get("/health")
    async def health(r: Serving):
        store = _store_health(r)
        if store is not None and store["degraded"]:
            raise degraded(store)
        cluster = r.scheduler.stats().cluster
        if cluster is not None and cluster["status"] != "ok":  # serving all the same (the head reads
            # a lost rank's experts): 200, degraded; else `serving` answered 503 already
            return {"status": "degraded", "reason": cluster["reason"], "advice": cluster["advice"]}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(r: Serving):
        return {"object": "list", "data": [_model_card(state, r)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, r: Serving):
        if model_id != served:
            raise APIError(
                404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        return _model_card(state, r)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, r: Serving):
        return await create_completion(body, request, r, served)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, r: Serving):
        return await create_chat_completion(body, request, r, served)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, r: Serving):
        check_model(body.model, served)
        if body.messages is not None:
            ids = r.chat.prompt_ids(r.tokenizer, body.messages, body.add_generation_prompt)
        else:
            ids = encode(r.tokenizer, body.prompt, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": r.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [r.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, r: Serving):
        check_model(body.model, served)
        ids = check_ids(body.tokens, r.cfg.vocab_size, "tokens")
        if r.tokenizer is None:
            raise bad_request("this model has no tokenizer.json", param="tokens")
        return {"prompt": r.tokenizer.decode(ids, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(r: Serving):
        if r.tokenizer is None:
            raise APIError(404, "this model has no tokenizer.json")
        return _tokenizer_info(r)

    return app


async def serving(request: Request) -> Ready:
    """The loaded model, or 503 + Retry-After while it loads (or after it failed to).
    (async: a plain def dependency would hop through a worker thread on every request)"""
    state: ServerState = request.app.state.latentkv
    if state.ready is not None:
        if (failure := state.ready.scheduler.failure) is not None:
            retry = LOADING_RETRY_S if getattr(state.ready.scheduler, "restarting", False) else 60
            raise APIError(
                503,
                f"the model stopped serving: {failure}",
                code="engine_stopped",
                headers={"Retry-After": str(retry)},
            )
        cluster = state.ready.scheduler.stats().cluster
        if cluster is not None and not cluster["serving"]:
            raise APIError(
                503,
                f"degraded: {cluster['reason']}; {cluster['advice']}",
                code="unavailable",
                headers={"Retry-After": "30"},
            )
        return state.ready
    if state.error is not None:
        raise APIError(503, f"the model failed to load: {state.error}", headers={"Retry-After": "60"})
    raise APIError(503, "the model is loading", headers={"Retry-After": str(LOADING_RETRY_S)})


Serving = Annotated[Ready, Depends(serving)]


def _store_health(r: Ready) -> dict | None:
    """The expert store's health (`experts.health.StoreHealth.as_dict`), when experts stream."""
    experts = r.scheduler.stats().experts
    return experts.get("store") if experts else None


def degraded(store: dict) -> APIError:
    """/health's answer while experts of the store are damaged: 503, naming them and the repair."""
    damaged = store["damaged"]
    names = ", ".join(d["expert"] for d in damaged[:4]) + (
        f" and {len(damaged) - 4} more" if len(damaged) > 4 else ""
    )
    return APIError(
        503,
        f"the expert store is degraded: {names} cannot be read ({damaged[0]['error']}); repair it with "
        f"`{store['repair']}`: the server reads it again by itself, no restart needed",
        code="expert_store_damaged",
        headers={"Retry-After": "10"},
    )


def _model_card(state: ServerState, r: Ready) -> dict:
    return {
        "id": state.config.served_model_name,
        "object": "model",
        "created": r.created,
        "owned_by": "latentkv",
        "root": state.config.model,
        "max_model_len": r.max_model_len,
        "kv_cache_dtype": state.config.engine.cache.kv_cache_dtype,
    }


def _tokenizer_info(r: Ready) -> dict:
    """vLLM's /tokenizer_info: special tokens as text (lm-eval's remote tokenizer encodes them back)."""
    special = dict(r.chat.special)
    cfg = r.cfg
    if "eos_token" not in special and cfg.eos_token_ids:
        special["eos_token"] = r.tokenizer.decode([cfg.eos_token_ids[0]], skip_special_tokens=False)
    if "bos_token" not in special and cfg.bos_token_id is not None:
        special["bos_token"] = r.tokenizer.decode([cfg.bos_token_id], skip_special_tokens=False)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": r.tokenizer.vocab_size,
        "model_max_length": r.max_model_len,
        "chat_template": r.chat.template,
        "eos_token": special.get("eos_token"),
        "bos_token": special.get("bos_token"),
        "pad_token": special.get("pad_token"),
        "unk_token": special.get("unk_token"),
    }


class Gate:
    """Pure ASGI middleware: the API-key check, and a count of answers by route and status.

    (Pure ASGI rather than BaseHTTPMiddleware, which would buffer streams and hide disconnects.)
    """

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        key = state.config.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = _route(path)
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.key is not None and path not in OPEN_PATHS and not self._authorized(scope):
                await _send_json(counted, _unauthorized(scope))
                return
            try:
                receive = await _bounded_body(scope, receive, self.state.config.request_timeout_s)
            except asyncio.TimeoutError:
                await _send_json(counted, timeout_error(self.state.config.request_timeout_s, "body"))
                return
            if receive is None:
                await _send_json(counted, _too_large())
                return
            await self.app(scope, receive, counted)
        finally:
            self.state.metrics.count_http(route, status)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


def _unauthorized(scope) -> APIError:
    has_header = any(name == b"authorization" for name, _ in scope.get("headers", ()))
    message = (
        "invalid API key" if has_header else "missing API key: send the header 'Authorization: Bearer KEY'"
    )
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _too_large() -> APIError:
    return APIError(
        413,
        f"the request body is over {MAX_BODY_BYTES >> 20} MiB",
        code="request_too_large",
        headers={"Connection": "close"},
    )


async def _bounded_body(scope, receive, timeout: float):
    """The body read whole (at most MAX_BODY_BYTES, else None: 413; within `timeout` seconds,
    else asyncio.TimeoutError: 408) and a receive that replays it, then hands over to the
    connection's own (for disconnects)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY_BYTES:
            return None
    pending = await read_body(receive, timeout, MAX_BODY_BYTES)
    if pending is None:
        return None

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _send_json(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _route(path: str) -> str:
    if path.startswith("/v1/models"):
        return "/v1/models"
    return path if path in ROUTES else "other"


async def _sample(state: ServerState) -> None:
    """Feed the tok/s gauges once a second."""
    while True:
        await asyncio.sleep(SAMPLE_EVERY_S)
        try:
            state.sample_throughput()
        except Exception:  # noqa: BLE001 - metrics must never take the server down
            log.exception("sampling throughput failed")
