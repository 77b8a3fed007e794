"""`latentkv serve MODEL`: the OpenAI-compatible HTTP server (docs/server.md).

What can be checked from config.json alone (the model resolves, the KV tier fits it,
--max-model-len fits its context) is checked before the socket opens; the weights then load in
the background while /health answers 503.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latentkv.commands.common import (
    add_cluster_arguments,
    add_model_arguments,
    add_speculative_arguments,
    engine_config,
    run_as_worker,
    speculative_config,
)
from latentkv.errors import UserError
from latentkv.runtime import check_device, check_tier

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, compile=False)  # batched decode is eager; a compiled lone step would differ
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the name clients pass as `model` (default: MODEL)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $LATENTKV_API_KEY, else no key)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        metavar="N",
        help="sequences decoded together in one batch (default: 8)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting for a batch slot before new ones get 429 (default: 64)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="context per sequence, prompt + generated (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--kv-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder of the session KV files (default: $LATENTKV_CACHE/sessions, else ~/.cache/latentkv/sessions)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the model and its scheduler in a child process, so HTTP work and decode steps "
        "use separate cores instead of sharing one GIL (default: on; --no-engine-process keeps "
        "one process)",
    )
    p.add_argument(
        "--pin-cpus",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with the engine process (Linux): run it on the last --threads CPUs this process may "
        "use (default: all but one) and the HTTP process on the others (default: off, placement "
        "is the OS's; give several servers on one machine their own CPUs with taskset instead)",
    )
    add_speculative_arguments(p)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a request's headers, and then its body, may take to arrive; a client slower than "
        "that gets 408 and its connection is closed (default: 30)",
    )
    p.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level (default: info)"
    )
    add_cluster_arguments(p)


def run(args: argparse.Namespace) -> int:
    if (status := run_as_worker(args)) is not None:
        return status
    uvicorn = _import_server_deps()
    config = server_config(args)
    from latentkv.server.app import create_app
    from latentkv.server.state import ServerState

    server = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    state = ServerState(config, on_failure=stop)
    app = create_app(state)
    from latentkv.server.timeouts import protocol

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            http=protocol(config.request_timeout_s),
        )
    )
    print(
        f"latentkv serve: {config.model} as {config.served_model_name!r} on http://{config.host}:{config.port}/v1 "
        f"(KV tier {config.engine.cache.kv_cache_dtype}, {config.max_num_seqs} sequences per batch); "
        "loading the weights in the background",
        file=sys.stderr,
    )
    server.run()
    return 1 if state.error is not None else 0


def server_config(args: argparse.Namespace):
    """The ServerConfig of the flags, after the checks config.json allows."""
    from latentkv.config import ConfigError, ModelConfig, ServerConfig, env_api_key
    from latentkv.models.registry import ModelNotFound, resolve

    engine = engine_config(args)
    check_device(engine)  # before the socket opens (the engine process would find it too late)
    try:
        model_cfg = ModelConfig.from_hf(resolve(args.model))
    except (ModelNotFound, ConfigError) as exc:
        raise UserError(str(exc)) from None
    check_tier(model_cfg, engine.cache)
    spec = speculative_config(args, args.model)  # a model without an MTP layer is refused here
    context = model_cfg.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > context:
        raise UserError(
            f"--max-model-len {args.max_model_len} exceeds the model's context of {context} tokens"
        )
    try:
        return ServerConfig(
            model=args.model,
            served_model_name=args.served_model_name if args.served_model_name is not None else args.model,
            engine=engine,
            host=args.host,
            port=args.port,
            api_key=args.api_key if args.api_key is not None else env_api_key(),
            max_num_seqs=args.max_num_seqs,
            max_queue=args.max_queue,
            max_model_len=args.max_model_len,
            kv_dir=args.kv_dir,
            engine_process=args.engine_process,
            pin_cpus=args.pin_cpus,
            speculative_draft_tokens=spec.draft_tokens if spec is not None else 0,
            request_timeout_s=args.request_timeout,
        )
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def _import_server_deps():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise UserError(
            f"serving needs the server extra ({exc.name} is missing): pip install 'latentkv[server]'"
        ) from None
    return uvicorn
