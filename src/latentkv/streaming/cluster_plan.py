"""Plan a cluster: every rank's RAM split, which experts each owns, and what a token costs
(`latentkv plan MODEL --nodes N`; docs/distributed.md).

    rank 0 (the head)  dense weights + KV pool + activations + working set + its expert cache
    rank r > 0         the interpreter and torch (ACTIVATION_BASE) + working set + its expert cache

Placement (`latentkv.experts.placement`) deals each MoE layer's experts over the ranks by
expected load, cache room and disk speed. From it, per rank: the experts it owns and caches,
the bytes it would read per token with nothing cached (cold) and with its cache holding its most
used experts (expected), and its disk's seconds per token. The head waits, layer by layer, for
the slowest owner of that layer, so the disk-bound tok/s of the whole is
1 / sum over layers of max over ranks (the rank's expected bytes in that layer / its disk speed).

The exchange per token (each MoE layer): the head sends each rank that owns one of the token's
k experts the token's hidden state (D float32) with the ids, and gets back each remote expert's
output (D float32 each: the outputs are added at the head in the one-process order, so partial
sums cannot cross the wire; see docs/distributed.md). With even routing a rank owning a share s
of a layer is asked with probability 1 - (1 - s)^k.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from latentkv.config import CacheConfig, ModelConfig
from latentkv.experts.placement import Placement, Rank, expected_reads, place
from latentkv.experts.reader import SPARE_BUFFERS
from latentkv.streaming.planner import ACTIVATION_BASE, GIB, Plan, make_plan

HEADER_BYTES = 64  # a job's header (8 int64) per rank asked, per layer
LAN_BYTES_PER_S = 125e6  # 1 GbE
LAN_LATENCY_S = 0.2e-3  # a LAN round trip


@dataclass
class RankPlan:
    rank: int
    role: str  # "head" or "worker"
    ram_bytes: int
    resident_bytes: int  # head: dense + KV pool + activations; worker: the interpreter and torch
    working_bytes: int
    expert_cache_bytes: int
    disk_gbps: float
    experts: int  # owned, over all layers
    cached_experts: int
    owned_bytes: int  # the experts it owns, on its disk (its share)
    cold_bytes_per_token: float  # its experts' expected uses x extent, nothing cached
    expected_bytes_per_token: float  # with its cache holding its most used experts
    disk_seconds_per_token: float
    fits: bool
    problems: list[str] = field(default_factory=list)


@dataclass
class ClusterPlan:
    nodes: int
    ranks: list[RankPlan]
    placement: Placement
    head: Plan  # the head's single-machine plan (its RAM alone, every expert from its disk)
    disk_bound_tok_s: float  # the whole cluster, layer by layer the slowest owner
    single_disk_bound_tok_s: float  # the head alone with its RAM and disk
    sent_bytes_per_token: float  # head -> workers (rows, ids), even routing
    returned_bytes_per_token: float  # workers -> head (each remote expert's output)
    exchange_seconds_per_token: float  # at LAN_BYTES_PER_S and LAN_LATENCY_S per layer
    load_source: str  # "usage history" or "even"

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["placement"] = self.placement.to_json()
        d["fits"] = self.fits
        return d


def moe_layer_ids(cfg: ModelConfig, mtp_layer: int | None) -> list[int]:
    """The layers whose routed experts the store holds: the MoE layers, then the MTP layer."""
    ids = [i for i, kind in enumerate(cfg.mlp_layer_types) if kind == "sparse"]
    return ids + ([mtp_layer] if mtp_layer is not None else [])


def make_cluster_plan(
    cfg: ModelConfig,
    model_dir: Path,
    rams: Sequence[int],
    disk_gbps: Sequence[float],
    weight_dtype: str = "f32",
    cache: CacheConfig | None = None,
    max_model_len: int = 4096,
    max_num_seqs: int = 1,
    store_dir: Path | None = None,
    load: Mapping[int, Sequence[float]] | None = None,
    head_experts: bool = True,
    draft_tokens: int = 0,
    placement: Placement | None = None,
) -> ClusterPlan:
    """`rams` and `disk_gbps`: one per rank, rank 0 the head. `load`: expected uses per token of
    each expert per layer (the usage history), None for even routing. `placement`: use this one
    (a file, or the one the ranks' shares were written for) instead of placing anew."""
    nodes = len(rams)
    if nodes < 1 or len(disk_gbps) != nodes:
        raise ValueError(f"one RAM budget and one disk speed per rank (got {len(rams)} and {len(disk_gbps)})")
    head = make_plan(
        cfg, model_dir, rams[0], weight_dtype, cache, max_model_len, max_num_seqs, store_dir, draft_tokens
    )
    extent, k, E = head.expert_extent_bytes, head.top_k, cfg.n_routed_experts
    layer_ids = moe_layer_ids(cfg, cfg.num_layers if head.mtp_layers else None)
    layers = {i: E for i in layer_ids}
    main_layers = [i for i in layer_ids if i < cfg.num_layers]
    tokens = max_num_seqs * (1 + draft_tokens)
    working = (min(E, k * tokens) + k + SPARE_BUFFERS) * extent if layer_ids else 0
    resident = [head.dense_bytes + head.kv_bytes + head.activation_bytes] + [ACTIVATION_BASE] * (nodes - 1)
    free = [max(0, ram - res - working) for ram, res in zip(rams, resident, strict=True)]
    specs = [
        Rank(free[r], disk_gbps[r], takes_experts=head_experts or r > 0 or nodes == 1) for r in range(nodes)
    ]
    if placement is None:
        placement = place(layers, extent, specs, load)
    elif placement.nodes != nodes:
        raise ValueError(f"the placement is for {placement.nodes} ranks, the cluster has {nodes}")
    else:
        placement.check_layers(layers)
    counts = placement.counts()
    caches = [min(free[r], counts[r] * extent) for r in range(nodes)]
    specs = [Rank(caches[r], disk_gbps[r], specs[r].takes_experts) for r in range(nodes)]
    reads = expected_reads(placement, extent, specs, load, k)
    cold = expected_reads(placement, extent, [Rank(0, s.disk_gbps) for s in specs], load, k)
    ranks = []
    for r in range(nodes):
        main = [layer for layer in reads[r] if layer in main_layers]
        expected = sum(reads[r][layer] for layer in main)
        problems = []
        if resident[r] + working > rams[r]:
            what = (
                "dense weights, KV pool, activations and working set"
                if r == 0
                else "torch and the working set"
            )
            problems.append(
                f"rank {r}: {what} need {(resident[r] + working) / GIB:.2f} GiB, more than its "
                f"{rams[r] / GIB:.2f} GiB budget"
            )
        ranks.append(
            RankPlan(
                rank=r,
                role="head" if r == 0 else "worker",
                ram_bytes=rams[r],
                resident_bytes=resident[r],
                working_bytes=working,
                expert_cache_bytes=caches[r],
                disk_gbps=disk_gbps[r],
                experts=counts[r],
                cached_experts=caches[r] // extent if extent else 0,
                owned_bytes=counts[r] * extent,
                cold_bytes_per_token=sum(cold[r][layer] for layer in main),
                expected_bytes_per_token=expected,
                disk_seconds_per_token=expected / (disk_gbps[r] * 1e9),
                fits=not problems,
                problems=problems,
            )
        )
    per_layer = [max(reads[r][layer] / (disk_gbps[r] * 1e9) for r in range(nodes)) for layer in main_layers]
    bound = sum(per_layer)
    single = head.expected_bytes_per_token / (disk_gbps[0] * 1e9)
    sent, returned, trips = _exchange(cfg, placement, main_layers, k)
    return ClusterPlan(
        nodes=nodes,
        ranks=ranks,
        placement=placement,
        head=head,
        disk_bound_tok_s=1 / bound if bound else float("inf"),
        single_disk_bound_tok_s=1 / single if single else float("inf"),
        sent_bytes_per_token=sent,
        returned_bytes_per_token=returned,
        exchange_seconds_per_token=max(sent, returned) / LAN_BYTES_PER_S + trips * LAN_LATENCY_S,
        load_source="even" if load is None else "usage history",
    )


def _exchange(cfg: ModelConfig, placement: Placement, layers: list[int], k: int) -> tuple[float, float, int]:
    """Expected (bytes the head sends, bytes it gets back, round trips) per decoded token, even routing."""
    row = cfg.hidden_size * 4
    sent = returned = 0.0
    trips = 0
    for layer in layers:
        owners = placement.owners[layer]
        n = len(owners)
        remote_share = [sum(1 for o in owners if o == r) / n for r in range(1, placement.nodes)]
        asked = sum(1 - (1 - s) ** k for s in remote_share)
        sent += asked * (row + HEADER_BYTES + 16 * k)
        returned += k * sum(remote_share) * row + asked * HEADER_BYTES
        trips += 1 if asked else 0
    return sent, returned, trips


def format_cluster_plan(p: ClusterPlan) -> str:
    def gib(n: float) -> str:
        return f"{n / GIB:8.2f}"

    lines = [
        f"{p.nodes} ranks; rank 0 is the head (dense weights, KV pool {p.head.kv_cache_dtype} for "
        f"{p.head.max_model_len} tokens x {p.head.max_num_seqs}); experts placed by {p.load_source} routing",
        "rank  role      RAM GiB  resident  working  cache GiB  experts  cached  share GiB  "
        "cold MiB/tok  expected MiB/tok  disk GB/s  disk s/tok",
    ]
    for r in p.ranks:
        lines.append(
            f"{r.rank:4d}  {r.role:6s}  {gib(r.ram_bytes)}  {gib(r.resident_bytes)}  {gib(r.working_bytes)}"
            f"  {gib(r.expert_cache_bytes)}  {r.experts:7d}  {r.cached_experts:6d}  {gib(r.owned_bytes)}"
            f"  {r.cold_bytes_per_token / 2**20:12.1f}  {r.expected_bytes_per_token / 2**20:16.1f}"
            f"  {r.disk_gbps:9.2f}  {r.disk_seconds_per_token:10.3f}"
        )
    lines += [
        f"disk-bound decode: {p.disk_bound_tok_s:.2f} tok/s for the cluster (each layer waits for its slowest "
        f"owner), {p.single_disk_bound_tok_s:.2f} tok/s for the head alone with its RAM and disk",
        f"exchange per token: {p.sent_bytes_per_token / 2**20:.2f} MiB sent, "
        f"{p.returned_bytes_per_token / 2**20:.2f} MiB returned (float32 rows and per-expert outputs), "
        f"{p.exchange_seconds_per_token * 1e3:.1f} ms at 1 GbE with 0.2 ms per round trip",
        f"placement {p.placement.digest}",
    ]
    lines += [f"does not fit: {msg}" for r in p.ranks for msg in r.problems]
    return "\n".join(lines)


def usage_load(store: Path | None) -> dict[int, list[float]] | None:
    """Expected uses per token of each expert, from the usage history beside the expert store
    at `store`; None when there is none (or it has seen no token)."""
    from latentkv import fs
    from latentkv.experts.history import FILE_NAME, MAX_BYTES, MAX_DEPTH

    if store is None:
        return None
    try:
        raw = fs.read_bounded(Path(store) / FILE_NAME, MAX_BYTES, "reading the usage history")
        body = fs.load_json(raw, MAX_DEPTH)["usage"]
        tokens = int(body["tokens"])
        layers = (
            {int(k): [int(c) / tokens for c in v] for k, v in body["layers"].items()} if tokens > 0 else None
        )
    except (fs.DiskError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return layers
