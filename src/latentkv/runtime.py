"""Load a model for running: weights, tokenizer and end-of-sequence ids, with errors fit for users.

    loaded = load("builtin:tiny", EngineConfig(cache=CacheConfig("tq4")))
    loaded.model, loaded.tokenizer, loaded.directory

The commands, the server (in-process or in its engine process) and the benchmarks all load
through here, so a model that one of them accepts the others accept too. A KV tier that cannot
store the model's latent rows is refused from config.json alone, before any weight is read.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from latentkv.errors import UserError

if TYPE_CHECKING:
    from latentkv.config import CacheConfig, EngineConfig, ModelConfig
    from latentkv.models.model import Model
    from latentkv.tokenizer import Tokenizer


def check_tier(model_cfg: ModelConfig, cache: CacheConfig) -> None:
    """Refuse a tier that cannot store this model's latent rows (e.g. tq4 on a 24-wide latent)."""
    from latentkv.kv.cache import CacheLayout, codecs_for

    if cache.kv_cache_dtype == "f32":
        return
    try:
        codecs_for(CacheLayout.for_model(model_cfg), cache)
    except ValueError as exc:
        raise UserError(str(exc)) from None


@dataclass
class Loaded:
    model: Model
    tokenizer: Tokenizer | None  # None: the model folder has no tokenizer.json (token ids only)
    directory: Path
    seconds: float


def load(model_arg: str, engine: EngineConfig, quiet: bool = False) -> Loaded:
    """Resolve MODEL, check the KV tier against its config.json, then load the weights (progress
    on stderr) and the tokenizer if there is one."""
    import torch

    from latentkv.config import ConfigError, ModelConfig
    from latentkv.models.compiled import CompileUnavailable, check_compilable
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound, resolve
    from latentkv.models.weights import load_model
    from latentkv.tokenizer import Tokenizer

    if engine.threads:
        torch.set_num_threads(engine.threads)
    t0 = time.perf_counter()
    try:
        directory = resolve(model_arg)
        check_tier(ModelConfig.from_hf(directory), engine.cache)
        if engine.compile:
            check_compilable(engine.cache)
        model = load_model(directory, engine.weight_dtype, progress=not quiet)
    except (ModelNotFound, ConfigError, CheckpointError, CompileUnavailable) as exc:
        raise UserError(str(exc)) from None
    seconds = time.perf_counter() - t0
    tokenizer = Tokenizer.of_model(directory)
    if not quiet:
        params = model.num_parameters()
        print(
            f"loaded {model_arg} ({model.cfg.model_type}, {params / 1e6:.1f}M parameters, "
            f"{engine.weight_dtype} weights) in {seconds:.2f} s",
            file=sys.stderr,
        )
    if engine.compile:
        model.compile_decode(engine.cache, progress=not quiet)
    return Loaded(model, tokenizer, directory, seconds)


def stop_ids(cfg: ModelConfig, directory: str | Path) -> tuple[int, ...]:
    """The model's end-of-sequence ids, with generation_config.json's (chat models list several)."""
    from latentkv.config import read_json_object

    ids = list(cfg.eos_token_ids)
    path = Path(directory) / "generation_config.json"
    extra = read_json_object(path).get("eos_token_id") if path.exists() else None  # ConfigError if broken
    for value in extra if isinstance(extra, list) else [extra]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return tuple(ids)
