"""Split a GPU's memory and the host's between the model's parts (`latentkv plan --vram-gb`).

    VRAM V = dense weights          every tensor but the routed experts (bf16 by default on a GPU)
           + KV pool                max_model_len x max_num_seqs x the tier's real row bytes (+ DSA keys)
           + activations            CUDA_CONTEXT + per sequence: logits, scores, hidden states
           + staging                slots that experts not cached in VRAM are copied into for a pass:
                                    one layer's (min(E, k x tokens)) plus the next layer's prefetch (k)
           + VRAM expert cache      the rest (every expert, and no staging, when they all fit)

    host R = HOST_BASE              the interpreter, torch, the CUDA driver's host side
           + pinned experts         every expert in page-locked RAM when they all fit: copies to the
                                    GPU then run at the bus's speed, overlapped with compute
           or host expert cache     else as many as fit, the rest read from the disk store
              + read buffers        (k + SPARE_BUFFERS) extents for reads in flight
              + staging             STAGING_BUFFERS page-locked extents the reads are copied
                                    through on their way to the GPU (so those copies overlap)

Where the routed experts live follows: `vram` (all resident on the GPU), `pinned` (all in host
RAM, the hottest cached in VRAM) or `disk` (streamed: disk -> host cache -> page-locked staging
buffer -> VRAM). Bytes per token assume routing spread evenly over the experts (the CPU planner's
convention) and that the VRAM cache and the host cache hold different experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from latentkv.config import CacheConfig, ModelConfig
from latentkv.experts.device_cache import STAGING_BUFFERS
from latentkv.experts.reader import SPARE_BUFFERS
from latentkv.kv.cache import SHAPES_ONLY, CacheLayout, resolve_tier
from latentkv.streaming.planner import (
    ACTIVATION_BASE,
    DEFAULT_RAM_SHARE,
    GIB,
    available_memory,
    dense_bytes,
    expert_extent_bytes,
    gguf_bytes_per_element,
    tensor_shapes,
)

CUDA_CONTEXT = 1 << 30  # the CUDA context, cuBLAS workspaces and the caching allocator's slack
HOST_BASE = ACTIVATION_BASE
GPU_WEIGHT_DTYPE = "bf16"  # the default on a GPU: the tensor cores' format


@dataclass
class GpuPlan:
    vram_bytes: int
    ram_bytes: int
    ram_source: str
    weight_dtype: str
    kv_cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    dense_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int  # on the GPU
    staging_bytes: int  # VRAM slots for experts copied in for a pass (0 when all are resident)
    vram_expert_bytes: int
    vram_experts: int
    host_bytes: int  # HOST_BASE + the read and staging buffers (disk only)
    pinned_expert_bytes: int  # page-locked host RAM holding experts
    pinned_experts: int
    expert_home: str  # "vram", "pinned" or "disk"
    expert_bytes: int
    expert_extent_bytes: int
    experts_total: int
    moe_layers: int
    top_k: int
    host_to_device_bytes_per_token: int  # expected, routing even
    disk_bytes_per_token: int  # expected, routing even
    fits: bool
    problems: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def make_gpu_plan(
    cfg: ModelConfig,
    model_dir: Path,
    vram_bytes: int,
    ram_bytes: int | None,
    weight_dtype: str = GPU_WEIGHT_DTYPE,
    cache: CacheConfig | None = None,
    max_model_len: int = 4096,
    max_num_seqs: int = 1,
    store_dir: Path | None = None,
    draft_tokens: int = 0,
    expert_dtype: str | None = None,
) -> GpuPlan:
    """`expert_dtype`: the routed experts' format (default: `weight_dtype`), which sizes them
    unless `store_dir` holds their converted store."""
    cache = cache or CacheConfig()
    source = "--ram-gb"
    if ram_bytes is None:
        avail, where = available_memory()
        ram_bytes = int(avail * DEFAULT_RAM_SHARE)
        source = f"{DEFAULT_RAM_SHARE:.0%} of {where} ({avail / GIB:.1f} GiB)"
    layout = CacheLayout.for_model(cfg, SHAPES_ONLY)
    per_token = resolve_tier(layout, cache).bytes_per_token  # latent rows and indexer keys
    kv = per_token * max_model_len * max_num_seqs
    shapes, has_mtp_experts, _ = tensor_shapes(cfg, model_dir)
    dense = dense_bytes(shapes, weight_dtype, gguf_bytes_per_element(model_dir))
    act = CUDA_CONTEXT + max_num_seqs * 4 * (
        cfg.vocab_size + cfg.num_heads * max_model_len + 16 * cfg.hidden_size
    )
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types) + int(has_mtp_experts)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    extent, _ = expert_extent_bytes(cfg, model_dir, expert_dtype or weight_dtype, store_dir)
    total = moe_layers * E
    all_experts = total * extent
    fixed = dense + kv + act
    problems = []
    if fixed + all_experts <= vram_bytes:  # every expert resident on the GPU
        home, staging, vram_experts, pinned, host = "vram", 0, total, 0, HOST_BASE
    else:
        tokens = max_num_seqs * (1 + draft_tokens)
        staging = (min(E, k * tokens) + k) * extent if moe_layers else 0
        vram_experts = max(0, vram_bytes - fixed - staging) // extent if extent else 0
        if fixed + staging > vram_bytes:
            problems.append(
                f"dense weights, KV pool, activations and expert staging need "
                f"{(fixed + staging) / GIB:.2f} GiB of VRAM, more than the {vram_bytes / GIB:.2f} GiB budget"
            )
        if HOST_BASE + all_experts <= ram_bytes:  # every expert pinned in host RAM
            home, pinned, host = "pinned", total, HOST_BASE
        else:
            host = HOST_BASE + (k + SPARE_BUFFERS + STAGING_BUFFERS) * extent
            home, pinned = "disk", max(0, ram_bytes - host) // extent if extent else 0
            if host > ram_bytes:
                problems.append(
                    f"the host needs {host / GIB:.2f} GiB (runtime, read and staging buffers), more than the "
                    f"{ram_bytes / GIB:.2f} GiB budget"
                )
    cold = k * moe_layers * extent  # every expert of a token read, nothing cached
    in_vram = min(1.0, vram_experts / total) if total else 1.0
    on_host = 1.0 if home != "disk" else min(1.0, (vram_experts + pinned) / total)
    return GpuPlan(
        vram_bytes=vram_bytes,
        ram_bytes=ram_bytes,
        ram_source=source,
        weight_dtype=weight_dtype,
        kv_cache_dtype=cache.kv_cache_dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        dense_bytes=dense,
        kv_bytes=kv,
        kv_bytes_per_token=per_token,
        activation_bytes=act,
        staging_bytes=staging,
        vram_expert_bytes=vram_experts * extent,
        vram_experts=int(vram_experts),
        host_bytes=host,
        pinned_expert_bytes=pinned * extent,
        pinned_experts=int(pinned),
        expert_home=home,
        expert_bytes=all_experts,
        expert_extent_bytes=extent,
        experts_total=total,
        moe_layers=moe_layers,
        top_k=k,
        host_to_device_bytes_per_token=int(cold * (1 - in_vram)),
        disk_bytes_per_token=int(cold * (1 - on_host)),
        fits=not problems,
        problems=problems,
    )


def format_gpu_plan(p: GpuPlan) -> str:
    def gib(n: int) -> str:
        return f"{n / GIB:9.3f} GiB"

    homes = {
        "vram": "every expert resident in VRAM: nothing crosses the bus after loading",
        "pinned": "every expert in pinned host RAM, the hottest cached in VRAM; copies overlap compute",
        "disk": "experts streamed from the disk store into a host cache, then through page-locked staging "
        "buffers into VRAM; copies overlap compute",
    }
    lines = [
        f"VRAM budget     {gib(p.vram_bytes)}   (--vram-gb)",
        f"  dense weights {gib(p.dense_bytes)}   ({p.weight_dtype})",
        f"  KV pool       {gib(p.kv_bytes)}   ({p.kv_cache_dtype}: {p.kv_bytes_per_token} B/token incl. "
        f"indexer keys, x {p.max_model_len} tokens x {p.max_num_seqs} seqs)",
        f"  activations   {gib(p.activation_bytes)}   (incl. the CUDA context)",
        f"  staging       {gib(p.staging_bytes)}   (slots experts are copied into for a pass)",
        f"  expert cache  {gib(p.vram_expert_bytes)}   ({p.vram_experts} of {p.experts_total} experts, "
        f"{p.expert_extent_bytes / 2**20:.2f} MiB each)",
        f"RAM budget      {gib(p.ram_bytes)}   ({p.ram_source})",
        f"  runtime       {gib(p.host_bytes)}",
        f"  pinned experts{gib(p.pinned_expert_bytes)}   ({p.pinned_experts} of {p.experts_total})",
        f"experts         {homes[p.expert_home]}",
        f"per token       {p.host_to_device_bytes_per_token / 2**20:.1f} MiB host -> GPU, "
        f"{p.disk_bytes_per_token / 2**20:.1f} MiB from disk (routing even)",
    ]
    lines += [f"does not fit: {msg}" for msg in p.problems]
    return "\n".join(lines)
