"""Arguments and loading shared by the commands that run a model."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from latentkv.cli import UserError


def add_model_arguments(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument(
            "model", metavar="MODEL", help="model directory (config.json + safetensors) or builtin:tiny"
        )
    p.add_argument(
        "--weight-dtype",
        default="f32",
        choices=["f32", "bf16"],
        help="dtype of the weight matrices in memory (default: f32; norms and router stay f32)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="f32",
        help="storage of the latent KV cache (default: f32)",
    )


def engine_config(args: argparse.Namespace):
    from latentkv.config import CacheConfig, ConfigError, EngineConfig, env_threads

    try:
        return EngineConfig(
            weight_dtype=args.weight_dtype,
            threads=args.threads if args.threads is not None else env_threads(),
            cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
        )
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None


@dataclass
class Loaded:
    model: object
    tokenizer: object | None
    directory: object
    seconds: float


def load(model_arg: str, engine, quiet: bool = False) -> Loaded:
    """Resolve MODEL, load weights (with progress on stderr) and the tokenizer if there is one."""
    import torch

    from latentkv.config import ConfigError
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve
    from latentkv.models.weights import load_model
    from latentkv.tokenizer import Tokenizer

    if engine.threads:
        torch.set_num_threads(engine.threads)
    t0 = time.perf_counter()
    try:
        directory = resolve(model_arg)
        model = load_model(directory, engine.weight_dtype, progress=not quiet)
    except (ModelNotFound, ConfigError, CheckpointError) as exc:
        raise UserError(str(exc)) from None
    seconds = time.perf_counter() - t0
    tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").exists() else None
    if not quiet:
        params = model.num_parameters()
        print(
            f"loaded {model_arg} ({model.cfg.model_type}, {params / 1e6:.1f}M parameters, "
            f"{engine.weight_dtype} weights) in {seconds:.2f} s",
            file=sys.stderr,
        )
    return Loaded(model, tokenizer, directory, seconds)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UserError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids
