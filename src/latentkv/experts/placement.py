"""Which rank of a cluster owns which routed expert (stdlib only; docs/distributed.md).

    placement = place({3: 64, 5: 64}, extent, [Rank(budget, gbps), Rank(budget, gbps)], load)
    placement.owner(3, 17)          # the rank that reads and computes expert 17 of layer 3
    placement.share(1)              # {layer: [experts of rank 1]}

Every rank owns a share of every MoE layer (the head too, unless its `Rank.takes_experts` is
False), so each layer's reads are spread over every disk. Within a layer the experts are dealt
out most used first (expected load: the usage history's counts per token, else even), each to
the rank where it adds the least to the layer's expected read time: free while the rank's cache
still has room for it (its budget's share of this layer, for the most used experts it owns),
after that its expected bytes over the rank's disk speed. Ties go to the rank with the least
load (its compute), then the fewest experts, then the lowest rank, so the result depends only on
its inputs and every rank that computes it gets the same one.

The placement is written into the plan (`latentkv plan --nodes N --placement-out FILE`) and into
each share of the experts (`latentkv experts convert --placement FILE --rank R`); its `digest`
names it, and a worker started with another placement is refused at start-up.
"""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from latentkv import fs

MAX_FILE_BYTES = 256 << 20  # a placement (untrusted): an owner per expert of every layer

FORMAT = "latentkv-placement"
VERSION = 1


class PlacementError(ValueError):
    """A placement file that cannot be used (the message says why)."""


@dataclass(frozen=True)
class Rank:
    """What placement needs to know of one rank."""

    cache_bytes: int  # its expert cache (from its plan)
    disk_gbps: float = 1.0  # its disk's read speed (relative speeds are what matter)
    takes_experts: bool = True  # False: owns no experts (a head told to keep none)

    def __post_init__(self) -> None:
        if self.cache_bytes < 0 or not self.disk_gbps > 0:
            raise ValueError(f"a rank needs cache_bytes >= 0 and disk_gbps > 0 (got {self})")


@dataclass(frozen=True)
class Placement:
    """owners[layer][e] is the rank that owns expert e of that layer."""

    nodes: int
    owners: Mapping[int, tuple[int, ...]]

    def __post_init__(self) -> None:
        for layer, row in self.owners.items():
            if any(not 0 <= r < self.nodes for r in row):
                raise PlacementError(f"layer {layer}: an owner outside ranks 0..{self.nodes - 1}")

    def owner(self, layer: int, expert: int) -> int:
        return self.owners[layer][expert]

    def share(self, rank: int) -> dict[int, list[int]]:
        """{layer: the experts `rank` owns, ascending} (layers where it owns none left out)."""
        out = {}
        for layer, row in sorted(self.owners.items()):
            mine = [e for e, r in enumerate(row) if r == rank]
            if mine:
                out[layer] = mine
        return out

    def counts(self) -> list[int]:
        """Experts owned per rank, over all layers."""
        n = [0] * self.nodes
        for row in self.owners.values():
            for r in row:
                n[r] += 1
        return n

    @property
    def digest(self) -> str:
        """16 hex digits naming this placement (equal placements, equal digests)."""
        body = json.dumps(self._body(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(body).hexdigest()[:16]

    def _body(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "nodes": self.nodes,
            "owners": {str(layer): list(row) for layer, row in sorted(self.owners.items())},
        }

    def to_json(self) -> dict:
        return {**self._body(), "digest": self.digest}

    @classmethod
    def from_json(cls, d: object, where: str = "placement") -> Placement:
        try:
            if d["format"] != FORMAT or d["version"] != VERSION:  # type: ignore[index]
                raise PlacementError(
                    f"{where}: format {d.get('format')!r} version {d.get('version')!r}, this latentkv "  # type: ignore[union-attr]
                    f"reads {FORMAT} {VERSION}"
                )
            nodes = int(d["nodes"])  # type: ignore[index]
            owners = {int(k): tuple(int(r) for r in v) for k, v in d["owners"].items()}  # type: ignore[index]
        except PlacementError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlacementError(f"{where}: not a placement ({exc!r})") from None
        if nodes < 1:
            raise PlacementError(f"{where}: nodes must be >= 1 (got {nodes})")
        placement = cls(nodes, owners)
        if "digest" in d and d["digest"] != placement.digest:  # type: ignore[operator,index]
            raise PlacementError(
                f"{where}: its digest does not match its owners (the file was edited or damaged)"
            )
        return placement

    def save(self, path: str | Path) -> None:
        """Write it crash-safely (DiskError, one line, when the disk refuses)."""
        fs.write_atomic(path, (json.dumps(self.to_json(), indent=1) + "\n").encode(), "saving the placement")

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        path = Path(path)
        try:
            raw = fs.load_json(fs.read_bounded(path, MAX_FILE_BYTES, "reading the placement"), 8)
        except fs.DiskError as exc:
            if exc.errno == errno.ENOENT:
                raise PlacementError(f"no placement file at {path}") from None
            raise PlacementError(str(exc)) from None
        except ValueError as exc:
            raise PlacementError(f"{path}: cannot read it as JSON ({exc})") from None
        if isinstance(raw, dict) and "placement" in raw and "owners" not in raw:
            raw = raw["placement"]  # a `plan --json` output holds it under "placement"
        return cls.from_json(raw, str(path))

    def check_layers(self, layers: Mapping[int, int]) -> None:
        """Refuse a placement of another model: it must cover exactly `layers` (layer -> experts)."""
        mine = {layer: len(row) for layer, row in self.owners.items()}
        if mine != dict(layers):
            raise PlacementError(
                f"the placement covers layers {_describe(mine)}, this model has {_describe(dict(layers))}"
            )


def _describe(layers: Mapping[int, int]) -> str:
    if not layers:
        return "none"
    sizes = sorted(set(layers.values()))
    return f"{sorted(layers)} ({'/'.join(map(str, sizes))} experts)"


def place(
    layers: Mapping[int, int],
    extent_bytes: Mapping[int, int] | int,
    ranks: Sequence[Rank],
    load: Mapping[int, Sequence[float]] | None = None,
) -> Placement:
    """Deal every layer's experts out over `ranks` (see the module docstring). `layers`: layer ->
    experts; `extent_bytes`: one expert's bytes (per layer, or one for all); `load`: layer ->
    expected uses per token of each expert (None, or a layer missing: even)."""
    takers = [r for r, spec in enumerate(ranks) if spec.takes_experts]
    if not takers:
        raise ValueError("no rank takes experts: at least one must own them")
    total_experts = sum(layers.values()) or 1
    owners: dict[int, tuple[int, ...]] = {}
    carried = [0.0] * len(ranks)  # load dealt in earlier layers: ties go to who has less
    for layer, n in sorted(layers.items()):
        extent = extent_bytes if isinstance(extent_bytes, int) else extent_bytes[layer]
        uses = list(load[layer]) if load is not None and layer in load else []
        if len(uses) != n or not sum(uses) > 0:
            uses = [1.0] * n
        # each rank's cache slots for this layer: its budget spread over all layers' experts
        slots = [int(spec.cache_bytes // max(1, extent) * n / total_experts) for spec in ranks]
        owners[layer] = _deal(uses, extent, ranks, takers, slots, carried)
    return Placement(len(ranks), owners)


def _deal(
    uses: list[float],
    extent: int,
    ranks: Sequence[Rank],
    takers: list[int],
    slots: list[int],
    carried: list[float],
) -> tuple[int, ...]:
    """One layer: most used first, each to the rank where it adds least to the expected read time
    (`carried`: each rank's load from earlier layers, a tie-break; updated)."""
    n = len(uses)
    owner = [0] * n
    seconds = [0.0] * len(ranks)  # expected read seconds per token (relative)
    work = [0.0] * len(ranks)  # expected uses per token (compute)
    held = [0] * len(ranks)
    for e in sorted(range(n), key=lambda e: (-uses[e], e)):

        def cost(r: int, e: int = e) -> tuple[float, float, int, float, int]:
            read = 0.0 if held[r] < slots[r] else uses[e] * extent / (ranks[r].disk_gbps * 1e9)
            return (seconds[r] + read, work[r] + uses[e], held[r], carried[r], r)

        r = min(takers, key=cost)
        if held[r] >= slots[r]:
            seconds[r] += uses[e] * extent / (ranks[r].disk_gbps * 1e9)
        work[r] += uses[e]
        held[r] += 1
        owner[e] = r
    for r in takers:
        carried[r] += work[r]
    return tuple(owner)


def expected_reads(
    placement: Placement,
    extent_bytes: Mapping[int, int] | int,
    ranks: Sequence[Rank],
    load: Mapping[int, Sequence[float]] | None = None,
    top_k: int | None = None,
) -> list[dict[int, float]]:
    """Per rank, per layer: the expected bytes it reads from disk per token, its cache holding
    its most used experts (its budget spread over all the experts it owns). `load` as in
    `place`; without it each expert is used top_k / experts times per token."""
    out: list[dict[int, float]] = [{} for _ in ranks]
    for r, spec in enumerate(ranks):
        share = placement.share(r)
        owned = [(layer, e) for layer, ids in share.items() for e in ids]
        uses = {key: _uses(load, key, placement, top_k) for key in owned}
        extents = {
            key: extent_bytes if isinstance(extent_bytes, int) else extent_bytes[key[0]] for key in owned
        }
        room = spec.cache_bytes
        cached = set()
        for key in sorted(owned, key=lambda k: (-uses[k], k)):
            if extents[key] <= room:
                cached.add(key)
                room -= extents[key]
        for layer in placement.owners:
            out[r][layer] = sum(
                uses[(layer, e)] * extents[(layer, e)]
                for e in share.get(layer, ())
                if (layer, e) not in cached
            )
    return out


def _uses(load, key: tuple[int, int], placement: Placement, top_k: int | None) -> float:
    layer, e = key
    n = len(placement.owners[layer])
    if load is not None and layer in load and len(load[layer]) == n and sum(load[layer]) > 0:
        return float(load[layer][e])
    return (top_k or 1) / n
