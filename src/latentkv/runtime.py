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
    from latentkv.cluster.head import Cluster
    from latentkv.config import CacheConfig, EngineConfig, ModelConfig
    from latentkv.experts.streamed import ExpertStreamer
    from latentkv.kv.cache import KVTier
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
    tier: KVTier  # --kv-cache-dtype resolved for this model, once: every cache of the run is made in it
    streamer: ExpertStreamer | None = None  # the experts stream from disk (--ram-gb)
    cluster: Cluster | None = None  # the head of a cluster: the other ranks hold experts too

    def close(self) -> None:
        """Stop expert reads and save the usage history (streamed runs); a cluster's head tells
        the workers it is ending."""
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None


def load(
    model_arg: str,
    engine: EngineConfig,
    quiet: bool = False,
    max_model_len: int | None = None,
    max_num_seqs: int = 1,
    draft_tokens: int = 0,
) -> Loaded:
    """Resolve MODEL, check the KV tier against its config.json, then load the weights (progress
    on stderr) and the tokenizer if there is one. With `engine.ram_gb` the routed experts stream
    from disk, planned for `max_model_len` (default: 4096) x `max_num_seqs` tokens of KV and for
    MTP drafting of `draft_tokens` per step (0: none; the MTP layer's experts stream too)."""
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
            check_compilable(
                engine.cache.kv_cache_dtype, engine.cache.recent_window, (engine.weight_dtype, engine.experts)
            )
        streamer = cluster = None
        if engine.cluster is not None:
            model, streamer, cluster = _load_head(
                directory, model_arg, engine, quiet, max_model_len, max_num_seqs, draft_tokens
            )
        elif engine.ram_gb is not None:
            model, streamer = _load_streamed(
                directory, engine, quiet, max_model_len, max_num_seqs, draft_tokens
            )
        else:
            model = load_model(
                directory, engine.weight_dtype, progress=not quiet, expert_dtype=engine.expert_dtype
            )
    except (ModelNotFound, ConfigError, CheckpointError, CompileUnavailable, ValueError) as exc:
        raise UserError(str(exc)) from None
    seconds = time.perf_counter() - t0
    tokenizer = Tokenizer.of_model(directory)
    if not quiet:
        _report_load(model_arg, model, engine, seconds)
    tier = model.tier(engine.cache)  # check_tier refused a tier that cannot store these rows
    if engine.compile:
        model.compile_decode(tier, progress=not quiet)
    return Loaded(model, tokenizer, directory, seconds, tier, streamer, cluster)


def _load_head(
    directory: Path,
    model_arg: str,
    engine: EngineConfig,
    quiet: bool,
    max_model_len: int | None,
    max_num_seqs: int,
    draft_tokens: int,
):
    """The head of a cluster (torchrun, WORLD_SIZE > 1): (model, its own streamer, the cluster)."""
    from latentkv.cluster.load import load_head
    from latentkv.cluster.rendezvous import StoreGone
    from latentkv.config import ModelConfig

    length = max_model_len or min(ModelConfig.from_hf(directory).max_position_embeddings, 4096)
    try:
        model, head = load_head(directory, model_arg, engine, quiet, length, max_num_seqs, draft_tokens)
    except (StoreGone, TimeoutError) as exc:
        raise UserError(f"the cluster did not start: {exc}") from None
    return model, head.streamer, head.cluster


def _report_load(model_arg: str, model: Model, engine: EngineConfig, seconds: float) -> None:
    """The load's lines on stderr: parameters and formats, peak RSS, the bf16/int8/int4 kernels used."""
    from latentkv.weights import describe

    params = model.num_parameters()
    print(
        f"loaded {model_arg} ({model.cfg.model_type}, {params / 1e6:.1f}M parameters, "
        f"{engine.weights_label} weights) in {seconds:.2f} s",
        file=sys.stderr,
    )
    print(
        f"peak RSS so far {_peak_rss_mib():.0f} MiB (checkpoint pages read through mmap included)",
        file=sys.stderr,
    )
    for fmt in dict.fromkeys((engine.weight_dtype, engine.experts)):
        if fmt in ("bf16", "int8", "int4"):
            print(describe(fmt), file=sys.stderr)


def _load_streamed(
    directory: Path,
    engine: EngineConfig,
    quiet: bool,
    max_model_len: int | None,
    max_num_seqs: int,
    draft_tokens: int = 0,
) -> tuple[Model, ExpertStreamer]:
    """Plan --ram-gb, convert the experts if needed, load the dense weights: (model, streamer).
    Drafting (`draft_tokens`) with a store that lacks the MTP layer's experts is refused."""
    from latentkv.config import ModelConfig
    from latentkv.experts.streamed import StreamConfig
    from latentkv.streaming.attach import default_store_dir, ensure_store, load_streamed, mtp_store_problem
    from latentkv.streaming.planner import GIB, make_plan

    cfg = ModelConfig.from_hf(directory)
    length = max_model_len or min(cfg.max_position_embeddings, 4096)
    store = default_store_dir(directory, engine.experts)  # planned before it is written
    plan = make_plan(
        cfg,
        directory,
        int(engine.ram_gb * GIB),
        engine.weight_dtype,
        engine.cache,
        length,
        max_num_seqs,
        store_dir=store,
        draft_tokens=draft_tokens,
    )
    if not plan.fits:
        raise UserError(f"--ram-gb {engine.ram_gb}: {plan.problems[0]} (see `latentkv plan`)")
    store = ensure_store(directory, engine.experts, progress=not quiet)
    if draft_tokens and (problem := mtp_store_problem(directory, store)) is not None:
        raise UserError(problem)
    config = StreamConfig(budget=plan.expert_cache_bytes, policy=engine.expert_policy)
    model, streamer = load_streamed(directory, store, config, engine.weight_dtype, progress=not quiet)
    if not quiet:
        _note(
            f"streaming experts from {store}: cache {plan.expert_cache_bytes / GIB:.2f} GiB "
            f"({plan.cached_experts} of {plan.experts_total} experts, {engine.expert_policy}); "
            f"KV pool {plan.kv_bytes / GIB:.2f} GiB for {length} tokens x {max_num_seqs}"
        )
        for note in streamer.notes:
            _note(note)
        if draft_tokens:
            _note(
                "drafting with streamed experts: each round also asks for the MTP layer's experts and "
                f"routes {draft_tokens + 1} tokens per sequence through every MoE layer; the pause rule "
                "stops drafting while it measures slower (docs/speculative.md)"
            )
    return model, streamer


def experts_line(streamer: ExpertStreamer) -> str:
    """One line of expert-streaming telemetry."""
    t = streamer.snapshot()
    per_pass = t["bytes_read"] / max(1, t["passes"]) / 2**20
    drafting = (
        f" (main layers {t['main_hit_rate']:.1%}, MTP draft layer {t['draft_hit_rate']:.1%})"
        if t["draft_asked"]
        else ""
    )
    return (
        f"experts: hit rate {t['hit_rate']:.1%}{drafting}, prefetch recall {t['recall']:.1%}, "
        f"{per_pass:.1f} MiB read per pass, {t['read_gbps']:.2f} GB/s, "
        f"resident {t['resident_bytes'] / 2**30:.3f} of {t['budget'] / 2**30:.3f} GiB"
    )


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _note(text: str) -> None:
    print(f"latentkv: {text}", file=sys.stderr)


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
