"""Load a model for running: weights, tokenizer and end-of-sequence ids, with errors fit for users.

    loaded = load("builtin:tiny", EngineConfig(cache=CacheConfig("tq4")))
    loaded.model, loaded.tokenizer, loaded.directory

A load goes one way. `resolve_load` decides everything the flags and config.json decide, with
no weight read: the device (`resolve_device`: the one place a device is chosen; every layer
below is handed it), the weight and expert formats (the registry's names), MODEL's folder, a
KV tier that can store the model's latent rows, --compile's support, the --ram-gb plan. Its
`LoadSpec` goes to `build`, which makes the parts from the bottom up: the expert store or the
cluster, the model over it, the tokenizer, the compiled step.

The commands, the server (in-process or in its engine process) and the benchmarks all load
through here, so a model that one of them accepts the others accept too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from latentkv.errors import UserError

if TYPE_CHECKING:
    import torch

    from latentkv.cluster.head import Cluster
    from latentkv.config import CacheConfig, EngineConfig, ModelConfig
    from latentkv.experts.device_cache import DeviceCache
    from latentkv.experts.streamed import ExpertStreamer
    from latentkv.kv.cache import KVTier
    from latentkv.models.model import Model
    from latentkv.streaming.gpu_plan import GpuPlan
    from latentkv.streaming.planner import Plan
    from latentkv.tokenizer import Tokenizer


def resolve_device(name: str) -> torch.device:
    """--device -> the one torch device the model's weights, its KV caches and its passes use:
    cpu; cuda (refused in one line where torch sees no CUDA device); auto (cuda when torch sees
    one, else cpu). Everything below `runtime` is handed this device; nothing there picks one."""
    import torch

    from latentkv.config import DEVICES

    if name not in DEVICES:
        raise UserError(f"unknown --device {name!r}; choose from {', '.join(DEVICES)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = (
            "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        )
        raise UserError(f"--device cuda: {why} (torch {torch.__version__}); use --device cpu")
    return torch.device(name)


def check_device(engine: EngineConfig) -> torch.device:
    """The device of `engine`, refused in one line where this torch cannot use it or the run's
    experts cannot follow it there: a cluster's ranks hand their experts over in host memory;
    experts streamed from disk (--ram-gb) reach a GPU through its VRAM cache, which --vram-gb
    plans; --vram-gb plans a GPU, so it needs one."""
    device = resolve_device(engine.device)
    if engine.vram_gb is not None and device.type != "cuda":
        raise UserError(
            f"--vram-gb plans a GPU's memory: it needs --device cuda (the run is on {device.type})"
        )
    if device.type != "cpu":
        if engine.cluster is not None:
            raise UserError(f"--device {engine.device}: a cluster runs on the CPU only (drop --device)")
        if engine.ram_gb is not None and engine.vram_gb is None:
            raise UserError(
                f"--device {engine.device} with --ram-gb: add --vram-gb V, the GPU's budget, so that its "
                "memory is planned too (`latentkv plan MODEL --vram-gb V --ram-gb G` shows the split)"
            )
    return device


def check_tier(model_cfg: ModelConfig, cache: CacheConfig) -> None:
    """Refuse a tier that cannot store this model's latent rows (e.g. tq4 on a 24-wide latent)."""
    from latentkv.kv.cache import SHAPES_ONLY, CacheLayout, resolve_tier

    try:
        resolve_tier(CacheLayout.for_model(model_cfg, SHAPES_ONLY), cache)
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
    device_cache: DeviceCache | None = None  # the routed experts cached on the device (--vram-gb)

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
    """`build(resolve_load(...))`: resolve what the flags mean (every refusal before a weight is
    read), then load the weights (progress on stderr) and the tokenizer if there is one."""
    return build(resolve_load(model_arg, engine, max_model_len, max_num_seqs, draft_tokens), quiet)


@dataclass(frozen=True)
class LoadSpec:
    """What the flags mean for one load, every check made: the model's folder and config, the
    weight and expert formats (`engine`), the device, the KV the memory is planned for, the
    --ram-gb plan, the cluster. Built by `resolve_load`; `build` only reads it."""

    model_arg: str  # MODEL as given (named in the load's report and the cluster's handshake)
    directory: Path  # where MODEL resolved to
    model_cfg: ModelConfig
    engine: EngineConfig  # formats, KV tier, threads, --compile, --ram-gb, the cluster
    device: torch.device
    max_model_len: int  # tokens of KV per sequence planned for (streamed experts, a cluster)
    max_num_seqs: int
    draft_tokens: int  # MTP draft tokens per step planned for (0: none)
    plan: Plan | None = None  # --ram-gb: the budget's split (the expert cache, the KV pool)
    # --vram-gb: the GPU's and the host's split, and where the routed experts live. `build` follows
    # it on any device (tests set it for a CPU run to exercise the VRAM cache's path there)
    gpu_plan: GpuPlan | None = None

    @property
    def weight_format(self) -> str:
        return self.engine.weight_dtype

    @property
    def expert_format(self) -> str:
        return self.engine.experts


def resolve_load(
    model_arg: str,
    engine: EngineConfig,
    max_model_len: int | None = None,
    max_num_seqs: int = 1,
    draft_tokens: int = 0,
) -> LoadSpec:
    """Every decision of a load, from config.json and the flags alone (no weight read): the
    device, the formats (named in the registry of `latentkv.weights`), MODEL's folder, a KV tier
    that can store the model's rows, --compile's support, and with `engine.ram_gb` the plan for
    `max_model_len` (default: the model's context, at most 4096) x `max_num_seqs` tokens of KV
    and MTP drafting of `draft_tokens` per step. UserError, one line, for anything refused."""
    from latentkv.config import ModelConfig
    from latentkv.models.compiled import check_compilable
    from latentkv.models.registry import resolve
    from latentkv.weights import format_class

    device = check_device(engine)
    with _user_errors():
        for fmt in (engine.weight_dtype, engine.experts):
            format_class(fmt)  # ValueError naming the registered formats
        directory = resolve(model_arg)
        cfg = ModelConfig.from_hf(directory)
        check_tier(cfg, engine.cache)
        if engine.compile:
            check_compilable(
                engine.cache.kv_cache_dtype, engine.cache.recent_window, (engine.weight_dtype, engine.experts)
            )
        length = max_model_len or min(cfg.max_position_embeddings, 4096)
        spec = LoadSpec(model_arg, directory, cfg, engine, device, length, max_num_seqs, draft_tokens)
        if engine.vram_gb is not None:
            spec = dataclasses.replace(spec, gpu_plan=_gpu_plan(spec))
        elif engine.ram_gb is not None and engine.cluster is None:  # a cluster plans every rank itself
            spec = dataclasses.replace(spec, plan=_stream_plan(spec))
    return spec


def build(spec: LoadSpec, quiet: bool = False) -> Loaded:
    """Load what `spec` says, downward: the expert store (streamed runs: converted on first use)
    or the cluster, then the model over it on `spec.device`, the tokenizer, the compiled step."""
    import torch

    from latentkv.tokenizer import Tokenizer

    engine = spec.engine
    if engine.threads:
        torch.set_num_threads(engine.threads)
    t0 = time.perf_counter()
    streamer = cluster = device_cache = None
    with _user_errors():
        if engine.cluster is not None:
            model, streamer, cluster = _build_head(spec, quiet)
        elif spec.gpu_plan is not None and spec.gpu_plan.expert_home != "vram":
            model, streamer, device_cache = _build_device_cached(spec, quiet)
        elif spec.plan is not None:
            model, streamer = _build_streamed(spec, quiet)
        else:
            model = _load_resident(spec, quiet)
    seconds = time.perf_counter() - t0
    tokenizer = Tokenizer.of_model(spec.directory)
    if not quiet:
        _report_load(spec.model_arg, model, engine, seconds)
    tier = model.tier(engine.cache)  # check_tier refused a tier that cannot store these rows
    if engine.compile:
        model.compile_decode(tier, progress=not quiet)
    return Loaded(model, tokenizer, spec.directory, seconds, tier, streamer, cluster, device_cache)


@contextlib.contextmanager
def _user_errors():
    """A model, config, checkpoint or flag that cannot be used: one line for the user."""
    from latentkv.config import ConfigError
    from latentkv.models.compiled import CompileUnavailable
    from latentkv.models.loader import CheckpointError
    from latentkv.models.registry import ModelNotFound

    try:
        yield
    except (ModelNotFound, ConfigError, CheckpointError, CompileUnavailable, ValueError) as exc:
        raise UserError(str(exc)) from None


def _build_head(spec: LoadSpec, quiet: bool):
    """The head of a cluster (torchrun, WORLD_SIZE > 1): (model, its own streamer, the cluster)."""
    from latentkv.cluster.load import load_head
    from latentkv.cluster.rendezvous import StoreGone

    try:
        model, head = load_head(
            spec.directory,
            spec.model_arg,
            spec.engine,
            quiet,
            spec.max_model_len,
            spec.max_num_seqs,
            spec.draft_tokens,
            device=spec.device,
        )
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
        if (line := describe(fmt)) is not None:
            print(line, file=sys.stderr)


def _stream_plan(spec: LoadSpec) -> Plan:
    """--ram-gb split for `spec` (the expert store planned before it is written); refused in one
    line when it does not fit."""
    from latentkv.streaming.planner import GIB, make_plan

    engine = spec.engine
    return _fitted(spec, f"--ram-gb {engine.ram_gb}", make_plan, int(engine.ram_gb * GIB))


def _gpu_plan(spec: LoadSpec) -> GpuPlan:
    """--vram-gb (and --ram-gb, default: a share of available memory) split for `spec`, by the
    planner `latentkv plan --vram-gb` prints; refused in one line when it does not fit, or when
    the experts' format cannot be converted for the GPU in its VRAM slots."""
    from latentkv.streaming.gpu_plan import make_gpu_plan
    from latentkv.streaming.planner import GIB

    engine = spec.engine
    ram = None if engine.ram_gb is None else int(engine.ram_gb * GIB)
    flag = f"--vram-gb {engine.vram_gb:g}"
    plan = _fitted(spec, flag, make_gpu_plan, int(engine.vram_gb * GIB), ram)
    if plan.expert_home != "vram" and spec.device.type == "cuda":
        from latentkv.weights.int4 import Int4Linear, layout

        # the host would hold int4 experts as portable nibbles: a second copy on the device
        if spec.expert_format == Int4Linear.format and layout() is None:
            raise UserError(
                f"{flag}: int4 experts cannot be cached in VRAM on this CPU (torch's int4 op packs them "
                "in a layout latentkv cannot convert in place on the GPU); use --expert-dtype bf16 or "
                "int8, or a budget where every expert fits in VRAM"
            )
    return plan


def _fitted(spec: LoadSpec, flag: str, make, *budgets: int | None):
    """`make(config, folder, *budgets, formats, KV, ...)` for `spec`: a planner's split (the
    expert store planned before it is written), refused in one line naming `flag` when it does
    not fit."""
    from latentkv.streaming.attach import default_store_dir

    plan = make(
        spec.model_cfg,
        spec.directory,
        *budgets,
        spec.weight_format,
        spec.engine.cache,
        spec.max_model_len,
        spec.max_num_seqs,
        store_dir=default_store_dir(spec.directory, spec.expert_format),
        draft_tokens=spec.draft_tokens,
        expert_dtype=spec.expert_format,
    )
    if not plan.fits:
        raise UserError(f"{flag}: {plan.problems[0]} (see `latentkv plan`)")
    return plan


def device_slots(plan: GpuPlan) -> int:
    """Experts the VRAM cache holds: the plan's cache plus its staging for a pass (one layer's
    experts and the next layer's prefetch); at least one."""
    extent = max(1, plan.expert_extent_bytes)
    return max(1, plan.vram_experts + plan.staging_bytes // extent)


def _build_device_cached(spec: LoadSpec, quiet: bool) -> tuple[Model, ExpertStreamer | None, DeviceCache]:
    """The model on `spec.device` with its routed experts in host memory behind a VRAM cache:
    every expert resident on the host (`pinned`), or streamed from the disk store into a host
    cache of the plan's pinned bytes (`disk`): (model, the streamer or None, the cache)."""
    from latentkv.experts.device_cache import DeviceCache
    from latentkv.experts.streamed import StreamConfig
    from latentkv.streaming.attach import load_streamed
    from latentkv.streaming.planner import GIB

    engine, plan = spec.engine, spec.gpu_plan
    assert plan is not None
    slots = device_slots(plan)
    cache = DeviceCache(
        spec.device, slots, engine.expert_policy, prefetch_max=spec.model_cfg.num_experts_per_tok
    )
    streamer = None
    if plan.expert_home == "pinned":
        model = _load_resident(spec, quiet, front=cache)
        where = "host RAM (page-locked)" if spec.device.type == "cuda" else "host RAM"
    else:
        store = _expert_store(spec, quiet)
        config = StreamConfig(budget=plan.pinned_expert_bytes, policy=engine.expert_policy)
        model, streamer = load_streamed(
            spec.directory,
            store,
            config,
            spec.weight_format,
            progress=not quiet,
            device=spec.device,
            front=cache,
        )
        where = f"a host cache of {plan.pinned_expert_bytes / GIB:.2f} GiB over the disk store {store}"
    if not quiet:
        _note(
            f"routed experts in {where}, {slots} of {plan.experts_total} cached on {spec.device} "
            f"({slots * plan.expert_extent_bytes / GIB:.2f} GiB, {engine.expert_policy}; --vram-gb "
            f"{engine.vram_gb}: see `latentkv plan`)"
        )
        for note in streamer.notes if streamer is not None else ():
            _note(note)
    return model, streamer, cache


def _load_resident(spec: LoadSpec, quiet: bool, front: DeviceCache | None = None) -> Model:
    """The model with its routed experts read from the checkpoint (onto the host behind `front`)."""
    from latentkv.models.weights import load_model

    return load_model(
        spec.directory,
        spec.weight_format,
        progress=not quiet,
        device=spec.device,
        expert_dtype=spec.engine.expert_dtype,
        front=front,
    )


def _expert_store(spec: LoadSpec, quiet: bool) -> Path:
    """The model's expert store, converted on first use; drafting (`draft_tokens`) with a store
    that lacks the MTP layer's experts is refused."""
    from latentkv.streaming.attach import ensure_store, mtp_store_problem

    store = ensure_store(spec.directory, spec.expert_format, progress=not quiet)
    if spec.draft_tokens and (problem := mtp_store_problem(spec.directory, store)) is not None:
        raise UserError(problem)
    return store


def _build_streamed(spec: LoadSpec, quiet: bool) -> tuple[Model, ExpertStreamer]:
    """Convert the experts if needed, load the dense weights over them: (model, streamer).
    Drafting (`draft_tokens`) with a store that lacks the MTP layer's experts is refused."""
    from latentkv.experts.streamed import StreamConfig
    from latentkv.streaming.attach import load_streamed
    from latentkv.streaming.planner import GIB

    engine, plan = spec.engine, spec.plan
    assert plan is not None
    store = _expert_store(spec, quiet)
    config = StreamConfig(budget=plan.expert_cache_bytes, policy=engine.expert_policy)
    model, streamer = load_streamed(
        spec.directory, store, config, spec.weight_format, progress=not quiet, device=spec.device
    )
    if not quiet:
        _note(
            f"streaming experts from {store}: cache {plan.expert_cache_bytes / GIB:.2f} GiB "
            f"({plan.cached_experts} of {plan.experts_total} experts, {engine.expert_policy}); "
            f"KV pool {plan.kv_bytes / GIB:.2f} GiB for {spec.max_model_len} tokens x {spec.max_num_seqs}"
        )
        for note in streamer.notes:
            _note(note)
        if spec.draft_tokens:
            _note(
                "drafting with streamed experts: each round also asks for the MTP layer's experts and "
                f"routes {spec.draft_tokens + 1} tokens per sequence through every MoE layer; the pause "
                "rule stops drafting while it measures slower (docs/speculative.md)"
            )
    return model, streamer


def device_cache_line(cache: DeviceCache) -> str:
    """One line of the VRAM expert cache's counters."""
    t = cache.snapshot()
    return (
        f"experts cached on {cache.device}: hit rate {t['hit_rate']:.1%} ({t['hits']} of {t['asked']}), "
        f"{t['copies']} copies ({t['prefetch_copies']} ahead), {t['bytes_copied'] / 2**20:.1f} MiB copied, "
        f"{t['cached']} of {t['slots']} slots"
    )


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
