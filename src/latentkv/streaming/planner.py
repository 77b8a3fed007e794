"""Split a RAM budget between what must stay resident and the expert cache (`latentkv plan`).

    RAM G = dense weights          every tensor but the routed experts, in the weight format
          + KV pool                max_model_len x max_num_seqs x (latent rows of every layer at
                                   the tier's real bytes + the DSA indexer keys, float32)
          + activations            ACTIVATION_BASE + per sequence: logits, attention scores over
                                   max_model_len per head, a few hidden states
          + working set            one layer's experts read for a pass that did not fit
                                   (min(E, k x max_num_seqs x (1 + draft tokens))) + the
                                   prefetch reads in flight (k) + the free read buffers kept
                                   for reuse (SPARE_BUFFERS)
          + expert cache           the rest

A smaller KV tier shrinks the KV pool and the expert cache gets the difference. Cold bytes per
token = k x MoE layers x one expert's extent (every expert read); with a cache holding a share
f of the experts and routing spread evenly, about (1 - f) of that is read per token.

Sizes come from the checkpoint's tensors, or, for a folder with config.json and no weights yet,
from the config (`models/shapes.py`: every tensor the loader reads), so a model can be planned
before it is downloaded. With `disk_gbps` the plan also bounds decode speed by the disk:
tok/s <= disk GB/s / bytes read per token (expected and cold), compute not counted.

The MTP draft layer (layer `num_hidden_layers`, when the checkpoint has one with routed experts)
is one more MoE layer in the store and the cache: its experts count in the totals, and each
drafted token asks for k of them (`draft_cold_bytes_per_token` when none is cached). With
--draft-tokens N a verify pass feeds N + 1 tokens per sequence, which widens the working set.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.experts.reader import SPARE_BUFFERS
from latentkv.experts.store_file import ALIGN, ExpertFileError, read_manifest
from latentkv.kv.cache import SHAPES_ONLY, CacheLayout, resolve_tier
from latentkv.models.loader import Checkpoint, has_weights
from latentkv.models.mtp import routed_layer
from latentkv.models.shapes import checkpoint_shapes
from latentkv.weights.base import make_linear

GIB = 1 << 30
DEFAULT_RAM_SHARE = 0.8  # of available memory (MemAvailable, or the cgroup limit if lower)
ACTIVATION_BASE = 512 << 20  # the interpreter, torch and allocator slack
EXPERTS_DIR = "experts"


@dataclass
class Plan:
    ram_bytes: int
    ram_source: str
    weight_dtype: str
    expert_dtype: str
    sizes_from: str  # "the checkpoint" or "config.json alone"
    kv_cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    dense_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int  # latent rows of every layer + indexer keys
    activation_bytes: int
    working_bytes: int
    expert_cache_bytes: int
    expert_bytes: int  # all routed experts
    expert_extent_bytes: int  # one expert on disk (and in the cache)
    moe_layers: int  # the main model's
    mtp_layers: int  # the MTP draft layer, when its routed experts stream (0 or 1)
    draft_tokens: int  # planned for --speculative mtp --draft-tokens N (0: no drafting)
    top_k: int
    cached_experts: int
    experts_total: int  # routed experts over all MoE layers, the MTP layer's included
    cold_bytes_per_token: int  # the main model's, nothing cached
    draft_cold_bytes_per_token: int  # the MTP layer's per drafted token, nothing cached
    expected_bytes_per_token: int
    fits: bool
    all_experts_fit: bool
    problems: list[str]
    disk_gbps: float | None = None  # given to estimate speed (GB/s, 1e9 bytes)
    disk_bound_tok_s: float | None = None  # disk GB/s / expected bytes per token; None: no reads
    cold_disk_bound_tok_s: float | None = None  # the same with nothing cached

    def as_dict(self) -> dict:
        return asdict(self)


def available_memory() -> tuple[int, str]:
    """(bytes, where from): MemAvailable, or this process's cgroup limit when lower."""
    avail = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    source = "MemAvailable"
    limit = _cgroup_limit()
    if limit is not None and limit < avail:
        return limit, "the cgroup memory limit"
    return avail or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), source


def _cgroup_limit() -> int | None:
    """This process's memory cgroup limit (v2 memory.max or v1 limit_in_bytes), if it has one."""
    paths = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, rel = line.split(":", 2)
        if hid == "0" and not controllers:
            paths.append(Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.max")
        elif "memory" in controllers.split(","):
            paths.append(Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / "memory.limit_in_bytes")
    limits = []
    for path in paths:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw != "max" and int(raw) < 1 << 60:
            limits.append(int(raw))
    return min(limits) if limits else None


def bytes_per_element(fmt: str) -> float:
    """Resident bytes per weight of a matrix in format `fmt` (scales included)."""
    rows, cols = 256, 1024
    return make_linear(torch.zeros(rows, cols), fmt).nbytes / (rows * cols)


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def dense_bytes(shapes: dict[str, tuple[int, ...]], fmt: str, stored: dict[str, float] | None = None) -> int:
    """Every tensor but the routed experts (`shapes`: name -> shape): matrices in the format (or,
    `stored`: name -> bytes per weight, in the format a GGUF's matrix loads in), vectors and
    routers float32."""
    per = bytes_per_element(fmt)
    stored = stored or {}
    total = 0.0
    for name, shape in shapes.items():
        if _is_routed_expert(name) or name.endswith("weight_scale_inv"):
            continue
        n = 1
        for d in shape:
            n *= d
        matrix = len(shape) == 2 and ".mlp.gate.weight" not in name
        total += n * (stored.get(name, per) if matrix else 4)
    return int(total)


def gguf_bytes_per_element(model_dir: Path | None) -> dict[str, float]:
    """name -> resident bytes per weight of each quantized matrix of a GGUF's folder, in the
    format it loads in (models/gguf.py); empty for any other folder."""
    from latentkv.models.convert import read_manifest
    from latentkv.weights.base import format_class
    from latentkv.weights.gguf_blocks import EXACT, REQUANT_GROUP

    manifest = read_manifest(model_dir) if model_dir is not None else None
    if manifest is None or manifest.get("source") != "gguf":
        return {}
    per: dict[tuple, float] = {}
    out = {}
    for name, entry in manifest["tensors"].items():
        fmt, exact = entry["format"], entry["gguf_type"] in EXACT
        group = EXACT[entry["gguf_type"]][1] if exact else REQUANT_GROUP
        key = (fmt, group, exact)
        if key not in per:
            cls = format_class(fmt)
            state = cls.quantize_state(torch.zeros(256, 1024), group_size=group)
            if exact:  # GGUF's scales stay float32 (weights/gguf_blocks.py)
                state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
            per[key] = cls.from_state(state, 1024).nbytes / (256 * 1024)
        out[name] = per[key]
    return out


def expert_extent_bytes(
    cfg: ModelConfig, model_dir: Path | None, fmt: str, store_dir: Path | None = None
) -> tuple[int, str]:
    """One expert's bytes on disk: from the converted store when there is one, else computed."""
    for d in (store_dir, model_dir / EXPERTS_DIR if model_dir is not None else None):
        if d is None:
            continue
        try:
            m = read_manifest(d)
            return max(e.layout.stride for e in m.layers.values()), "the expert store"
        except ExpertFileError:
            pass
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    n = make_linear(torch.zeros(2 * I, D), fmt).nbytes + make_linear(torch.zeros(D, I), fmt).nbytes
    return -(-n // ALIGN) * ALIGN, "computed"


def tensor_shapes(cfg: ModelConfig, model_dir: Path | None) -> tuple[dict[str, tuple[int, ...]], bool, str]:
    """(name -> shape, whether the MTP layer's routed experts are there, where the sizes come
    from): the checkpoint's tensors, or the config's when the folder has no weights (or is None)."""
    if model_dir is None or not has_weights(model_dir):
        return checkpoint_shapes(cfg), cfg.num_mtp_layers >= 1, "config.json alone"
    ckpt = Checkpoint(model_dir)
    shapes = {name: tuple(ckpt.shape(name)) for name in ckpt.keys()}  # noqa: SIM118
    return (
        shapes,
        routed_layer(cfg, ckpt) is not None,
        "the GGUF" if ckpt.gguf is not None else "the checkpoint",
    )


def make_plan(
    cfg: ModelConfig,
    model_dir: Path | None,
    ram_bytes: int | None,
    weight_dtype: str = "f32",
    cache: CacheConfig | None = None,
    max_model_len: int = 4096,
    max_num_seqs: int = 1,
    store_dir: Path | None = None,
    draft_tokens: int = 0,
    expert_dtype: str | None = None,
    disk_gbps: float | None = None,
) -> Plan:
    """`model_dir` None (or a folder without weights): sized from `cfg` alone."""
    cache = cache or CacheConfig()
    expert_dtype = expert_dtype or weight_dtype
    source = "--ram-gb"
    if ram_bytes is None:
        avail, where = available_memory()
        ram_bytes = int(avail * DEFAULT_RAM_SHARE)
        source = f"{DEFAULT_RAM_SHARE:.0%} of {where} ({avail / GIB:.1f} GiB)"
    layout = CacheLayout.for_model(cfg, SHAPES_ONLY)
    per_token = resolve_tier(layout, cache).bytes_per_token  # latent rows and indexer keys
    kv = per_token * max_model_len * max_num_seqs
    shapes, has_mtp_experts, sizes_from = tensor_shapes(cfg, model_dir)
    dense = dense_bytes(shapes, weight_dtype, gguf_bytes_per_element(model_dir))
    act = ACTIVATION_BASE + max_num_seqs * 4 * (
        cfg.vocab_size + cfg.num_heads * max_model_len + 16 * cfg.hidden_size
    )
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    mtp = int(has_mtp_experts)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    extent, _ = expert_extent_bytes(cfg, model_dir, expert_dtype, store_dir)
    tokens = max_num_seqs * (1 + draft_tokens)  # one pass's tokens (a verify pass: N + 1 each)
    working = (min(E, k * tokens) + k + SPARE_BUFFERS) * extent if moe_layers else 0
    all_experts = (moe_layers + mtp) * E * extent
    cache_bytes = max(0, min(ram_bytes - dense - kv - act - working, all_experts))
    problems = []
    if dense + kv + act + working > ram_bytes:
        problems.append(
            f"dense weights, KV pool, activations and working set need "
            f"{(dense + kv + act + working) / GIB:.2f} GiB, more than the {ram_bytes / GIB:.2f} GiB budget"
        )
    cached = cache_bytes // extent if extent else 0
    cold = k * moe_layers * extent
    share = cached / (moe_layers * E) if moe_layers else 1.0  # decoding without drafting
    expected = int(cold * (1 - min(1.0, share)))
    return Plan(
        ram_bytes=ram_bytes,
        ram_source=source,
        weight_dtype=weight_dtype,
        expert_dtype=expert_dtype,
        sizes_from=sizes_from,
        kv_cache_dtype=cache.kv_cache_dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        dense_bytes=dense,
        kv_bytes=kv,
        kv_bytes_per_token=per_token,
        activation_bytes=act,
        working_bytes=working,
        expert_cache_bytes=cache_bytes,
        expert_bytes=all_experts,
        expert_extent_bytes=extent,
        moe_layers=moe_layers,
        mtp_layers=mtp,
        draft_tokens=draft_tokens,
        top_k=k,
        cached_experts=int(cached),
        experts_total=(moe_layers + mtp) * E,
        cold_bytes_per_token=cold,
        draft_cold_bytes_per_token=k * extent * mtp,
        expected_bytes_per_token=expected,
        fits=not problems,
        all_experts_fit=cache_bytes >= all_experts,
        problems=problems,
        disk_gbps=disk_gbps,
        disk_bound_tok_s=_tok_s(disk_gbps, expected),
        cold_disk_bound_tok_s=_tok_s(disk_gbps, cold),
    )


def _tok_s(disk_gbps: float | None, bytes_per_token: int) -> float | None:
    """Tokens per second the disk allows at `bytes_per_token` of reads; None without a disk
    speed or without reads."""
    if disk_gbps is None or bytes_per_token <= 0:
        return None
    return disk_gbps * 1e9 / bytes_per_token


def format_plan(p: Plan) -> str:
    def gib(n: int) -> str:
        return f"{n / GIB:9.3f} GiB"

    lines = [
        f"RAM budget      {gib(p.ram_bytes)}   ({p.ram_source})",
        f"dense weights   {gib(p.dense_bytes)}   ({p.weight_dtype}; sizes from {p.sizes_from})",
        f"KV pool         {gib(p.kv_bytes)}   ({p.kv_cache_dtype}: {p.kv_bytes_per_token} B/token incl. "
        f"indexer keys, x {p.max_model_len} tokens x {p.max_num_seqs} seqs)",
        f"activations     {gib(p.activation_bytes)}",
        f"working set     {gib(p.working_bytes)}   (one layer's uncached experts + prefetch + spare buffers"
        + (f"; verify passes of {p.draft_tokens + 1} tokens per sequence)" if p.draft_tokens else ")"),
        f"expert cache    {gib(p.expert_cache_bytes)}   ({p.cached_experts} of "
        f"{p.experts_total} experts, "
        f"{p.expert_extent_bytes / 2**20:.2f} MiB each in {p.expert_dtype})",
        f"all experts     {gib(p.expert_bytes)}   ({p.moe_layers} MoE layers"
        + (" + the MTP draft layer)" if p.mtp_layers else ")"),
        f"cold read/token {p.cold_bytes_per_token / 2**20:9.1f} MiB   (top-{p.top_k} x {p.moe_layers} layers, "
        f"nothing cached); ~{p.expected_bytes_per_token / 2**20:.1f} MiB with this cache if routing is even",
    ]
    if p.mtp_layers:
        lines.append(
            f"MTP draft layer {p.draft_cold_bytes_per_token / 2**20:9.1f} MiB   per drafted token, nothing "
            f"cached (top-{p.top_k} of its experts; only with --speculative mtp)"
        )
    if p.all_experts_fit:
        lines.append("every expert fits: nothing will be read from disk after warm-up")
    if p.disk_gbps is not None and p.cold_disk_bound_tok_s is not None:
        expected = f"{p.disk_bound_tok_s:.2f}" if p.disk_bound_tok_s is not None else "no limit"
        lines.append(
            f"disk bound      {expected} tok/s with this cache, {p.cold_disk_bound_tok_s:.2f} cold   "
            f"(at {p.disk_gbps:g} GB/s: reads only, compute not counted)"
        )
    lines += [f"does not fit: {msg}" for msg in p.problems]
    return "\n".join(lines)
