"""`latentkv <command>`: argparse -> config dataclasses -> the command module, imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

from latentkv import version
from latentkv.errors import Unavailable, UserError

COMMANDS = {
    "demo": ("latentkv.commands.demo", "run the bundled model end to end"),
    "generate": ("latentkv.commands.generate", "generate text from a prompt"),
    "chat": ("latentkv.commands.chat", "an interactive conversation, optionally resumed from a session"),
    "oracle": ("latentkv.commands.oracle", "check the engine token for token against transformers"),
    "bench": ("latentkv.commands.bench", "benchmark prefill and decode (optionally vs transformers)"),
    "kv": ("latentkv.commands.kv", "KV cache tiers (kv stats) and KV files (kv inspect)"),
    "serve": ("latentkv.commands.serve", "an OpenAI-compatible HTTP server with continuous batching"),
    "convert": (
        "latentkv.commands.convert",
        "rewrite a checkpoint with int8/int4 weights (quantized once, loaded as is)",
    ),
    "eval": ("latentkv.commands.eval", "quality per KV tier: held-out perplexity, multiple choice"),
    "experts": (
        "latentkv.commands.experts",
        "expert stores for --ram-gb: convert a model's experts, verify one",
    ),
    "plan": (
        "latentkv.commands.plan",
        "split a RAM budget: dense weights, KV pool, activations, expert cache",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="latentkv",
        description="Run MLA mixture-of-experts models (GLM-5, DeepSeek-V3) with a compressed latent KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from latentkv.config import ConfigError, cluster_env, quiet_torch_for_cluster

    quiet_torch_for_cluster()
    code = _main(argv)
    try:
        clustered = cluster_env() is not None
    except ConfigError:
        clustered = False
    if clustered:  # a rank of a cluster: end without tearing its gloo groups down
        from latentkv.cluster.rendezvous import end_process

        return end_process(code)
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if (refusal := _not_distributed(args)) is not None:
        print(f"latentkv {args.command}: error: {refusal}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    try:
        from latentkv.commands.common import settle_weight_default

        settle_weight_default(args)
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `latentkv ... | head`: the reader left; exit quietly
        sys.stderr.close()
        return 141
    except UserError as exc:
        print(f"latentkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Unavailable as exc:  # a cluster rank was lost mid-run: nothing the flags could fix
        print(f"latentkv {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not _explained(exc):
            raise
        print(f"latentkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


# The commands that run expert-parallel when started by torchrun (WORLD_SIZE > 1).
DISTRIBUTED = {("generate",), ("chat",), ("serve",), ("bench", "decode")}


def _not_distributed(args: argparse.Namespace) -> str | None:
    """Why this command does not run under torchrun (WORLD_SIZE > 1), or None."""
    from latentkv.config import ConfigError, cluster_env

    try:
        if cluster_env() is None:
            return None
    except ConfigError as exc:
        return str(exc)
    name = (args.command, getattr(args, "bench", None)) if args.command == "bench" else (args.command,)
    if name in DISTRIBUTED:
        return None
    return (
        f"`latentkv {' '.join(name)}` does not run expert-parallel (WORLD_SIZE > 1 starts a cluster: "
        "generate, chat, serve and bench decode do); run it without torchrun"
    )


def _explained(exc: Exception) -> bool:
    """Errors whose message already says what is wrong with a file the user gave (a model
    folder's JSON, its tokenizer, a KV file): one line, exit 2, as a UserError."""
    from latentkv.config import ConfigError
    from latentkv.kv.store_header import KVFileError
    from latentkv.tokenizer import TokenizerError

    return isinstance(exc, (ConfigError, TokenizerError, KVFileError))


if __name__ == "__main__":
    # `python -m latentkv.cli`: UserError lives in latentkv.errors, so the class main catches is
    # the one the commands raise even when this file runs as __main__
    sys.exit(main())
