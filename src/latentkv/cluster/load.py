"""Load a model as the head of a cluster: every rank joins, the placement is decided, the head
opens its own share and builds the model with a RemoteExperts store in every MoE layer
(`runtime.load` calls this when torchrun started the command; docs/distributed.md).

The placement is, in this order: the --placement file (every rank must have the same), the one
the workers' shares were written for, else placed now from every rank's RAM budget and disk
speed and the head's usage history. Each rank's budget is planned as `latentkv plan --nodes N`
plans it: the head holds the dense weights, the KV pool and its share's cache; a worker only
its share's cache.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from latentkv.cluster.head import Cluster, new_facts, start_head
from latentkv.cluster.store import ClusterSource
from latentkv.config import EngineConfig, ModelConfig
from latentkv.errors import UserError


@dataclass
class Head:
    """What the head's load returns beside the model."""

    cluster: Cluster
    streamer: object | None  # the head's ExpertStreamer (its share), or None when it owns none
    store: Path | None


def load_head(
    directory: Path,
    model_arg: str,
    engine: EngineConfig,
    quiet: bool,
    max_model_len: int,
    max_num_seqs: int,
    draft_tokens: int,
    *,
    device: torch.device,
):
    """(model, Head), the model's dense weights on `device`. UserError (one line) when a rank is refused, missing or cannot open its
    share, or the head's own parts do not fit its budget."""
    from latentkv import version
    from latentkv.config import env_cluster_secret
    from latentkv.experts.placement import Placement
    from latentkv.models.loader import Checkpoint
    from latentkv.models.mtp import routed_layer
    from latentkv.streaming.cluster_plan import make_cluster_plan, moe_layer_ids, usage_load
    from latentkv.streaming.planner import GIB
    from latentkv.streaming.shares import full_store

    cfg = engine.cluster
    mcfg = ModelConfig.from_hf(directory)
    ckpt = Checkpoint(directory)
    mtp = routed_layer(mcfg, ckpt)
    fmt = engine.experts
    given = Placement.load(cfg.placement) if cfg.placement is not None else None
    secret = cfg.secret or env_cluster_secret()
    facts = new_facts(version(), ckpt.fingerprint(), model_arg, fmt, given.digest if given else None, secret)
    head_ram = int(engine.ram_gb * GIB) if engine.ram_gb is not None else _default_ram(cfg.local_world_size)
    full = full_store(directory, fmt)
    head_gbps = cfg.disk_gbps or _disk(full)

    def plan_for(hellos, adopted):
        ranks = sorted(hellos)
        speeds = _speeds([head_gbps] + [hellos[r].disk_gbps for r in ranks])
        return make_cluster_plan(
            mcfg,
            directory,
            [head_ram] + [hellos[r].ram_bytes for r in ranks],
            speeds,
            engine.weight_dtype,
            engine.cache,
            max_model_len,
            max_num_seqs,
            store_dir=full,
            load=usage_load(full),
            head_experts=cfg.head_experts,
            draft_tokens=draft_tokens,
            placement=given or adopted,
        )

    cluster = start_head(cfg, facts, mcfg.hidden_size, mcfg.n_routed_experts, plan_for)
    try:
        plan = cluster.plan
        if not plan.ranks[0].fits:
            raise UserError(f"--ram-gb: {plan.ranks[0].problems[0]} (see `latentkv plan --nodes`)")
        if not quiet:
            from latentkv.streaming.cluster_plan import format_cluster_plan

            print(format_cluster_plan(plan), file=sys.stderr)
        head = _open_head_share(directory, ckpt.fingerprint(), engine, cluster, quiet)
        layers = set(moe_layer_ids(mcfg, mtp))
        model = _build(directory, engine, quiet, cluster, head, mcfg, mtp is None or mtp in layers, device)
    except BaseException:
        cluster.close()
        raise
    cluster.start_monitor()
    return model, head


def _default_ram(local_world_size: int) -> int:
    """This rank's share of 80% of the machine's available memory (ranks on one machine split it)."""
    from latentkv.streaming.planner import DEFAULT_RAM_SHARE, available_memory

    avail, _ = available_memory()
    return int(avail * DEFAULT_RAM_SHARE / max(1, local_world_size))


def _disk(store: Path | None) -> float | None:
    from latentkv.experts.disk import disk_gbps

    return disk_gbps(store) if store is not None else None


def _speeds(speeds: list[float | None]) -> list[float]:
    """Unmeasured disks (no store there yet) are taken as the mean of the measured ones."""
    known = [s for s in speeds if s]
    mean = sum(known) / len(known) if known else 1.0
    return [s or mean for s in speeds]


def _open_head_share(
    directory: Path, fingerprint: str, engine: EngineConfig, cluster: Cluster, quiet: bool
) -> Head:
    """The head's own experts (its share of the placement): a streamer within its budget."""
    from latentkv.experts.streamed import ExpertStreamer, StreamConfig
    from latentkv.streaming.shares import check_share, ensure_share, full_store

    placement = cluster.placement
    mine = placement.share(0)
    store = None
    if mine:
        store = ensure_share(directory, engine.experts, placement, 0, progress=not quiet)
        check_share(store, placement, 0, fingerprint)
    elif (full := full_store(directory, engine.experts)) is not None:
        store = full  # owns none, but can read a lost rank's experts from here
    if store is None:
        return Head(cluster, None, None)
    budget = cluster.plan.ranks[0].expert_cache_bytes
    config = StreamConfig(
        budget=budget,
        policy=engine.expert_policy,
        experts={layer: frozenset(ids) for layer, ids in mine.items()},
    )
    streamer = ExpertStreamer(store, fingerprint, config)
    manifest = streamer.manifest
    cluster.local_holds = lambda layer, e: layer in manifest.layers and manifest.layers[layer].holds(e)
    cluster.history = streamer.history
    return Head(cluster, streamer, store)


def _build(
    directory: Path,
    engine: EngineConfig,
    quiet: bool,
    cluster: Cluster,
    head: Head,
    mcfg,
    keep_mtp: bool,
    device: torch.device,
):
    from latentkv.models.loader import own_pages
    from latentkv.models.weights import load_model

    source = ClusterSource(cluster, head.streamer, mcfg.n_routed_experts, mcfg.num_experts_per_tok)
    try:
        model = load_model(
            directory, engine.weight_dtype, not quiet, device=device, experts=source, load_mtp=keep_mtp
        )
    except BaseException:
        if head.streamer is not None:
            head.streamer.close()
        raise
    own_pages(model.weight_tensors())
    if head.streamer is not None:
        head.streamer.pin_hot_set()
    return model
