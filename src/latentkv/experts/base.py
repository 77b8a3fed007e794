"""The expert seam: a MoE layer hands its `ExpertStore` the rows routed to each expert.

    jobs = [Job(3, rows3), Job(17, rows17)]   # rows of x [N, D] routed to each expert
    results = store.run(x, jobs)          # every job started (reads issued, rows sent) ...
    shared = shared_expert(x)             # ... so the layer computes meanwhile
    for e, y in results: ...              # (id, expert(x[rows])) as each is ready, any order
    store.prefetch([5, 9])                # a hint: these will be asked for soon (may be ignored)

Contract (what a store may rely on, and what the MoE layer promises):
  - One store per MoE layer, built with the layer (`ExpertSource.store`). A forward pass calls
    `run` once per layer, with a job for every expert it needs (distinct ids, 0 <= id <
    num_experts); it weights the outputs by the router and adds them in its own fixed order, so
    the sum is bit-identical whatever order they arrive in. Where the
    experts are computed is the store's business: in this process (`LocalStore`, over
    `get`/`arrivals`), or where they live (another rank's share, issue 23).
  - A `LocalStore`'s `get(ids)` returns Expert objects valid until its next `get`, and not
    longer: a store that loads experts lazily may evict or reuse their memory after that.
    `at_once` bounds how many it is asked for at a time (a store from disk: one token's k).
  - `prefetch(ids)` is advice (e.g. the next layer's router run early); it returns at once.
  - `stacked` is the whole layer as two stacked tensors when the store keeps them resident in
    a plain dtype (f32, bf16): the MoE layer's fast paths (every expert at once, gathered
    experts) read it. `packed` is the whole layer's routed part as one kernel call when the
    store keeps int8/int4 experts resident (`weights.swiglu.PackedExperts`: the same sum as `run`
    gives the layer, bit for bit). A store with neither (streamed) is served through `run`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from latentkv.weights.base import Linear
from latentkv.weights.swiglu import PackedExperts, fused_swiglu


@dataclass
class Expert:
    """down(silu(gate(x)) * up(x)), with gate and up as one fused Linear [2I, D] (gate rows first).
    A dense MLP and a shared expert are the same computation."""

    gate_up: Linear  # D -> 2I
    down: Linear  # I -> D

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        """x [N, D] -> [N, D] (plus `residual` [N, D] if given). `decode` (one token per
        sequence) changes nothing here: a dense MLP has one path; the MoE layer picks by it.
        int8 and int4 experts run as one kernel call where they can (`weights.swiglu`)."""
        fused = fused_swiglu(self.gate_up, self.down, x.shape[0])
        if fused is not None and (residual is None or residual.shape == x.shape):
            return fused(x, residual)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down.add_to(residual, F.silu(gate) * up)

    @property
    def width(self) -> int:
        """The intermediate width I."""
        return self.down.in_features

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass(frozen=True)
class StackedExperts:
    """Every routed expert of a layer in two tensors of one plain dtype."""

    gate_up: torch.Tensor  # [E, 2I, D]  gate rows first, then up
    down: torch.Tensor  # [E, D, I]

    @property
    def expert_bytes(self) -> int:
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()


@dataclass(frozen=True)
class Job:
    """The rows of a MoE input routed to one expert."""

    expert: int
    rows: torch.Tensor | None  # [n] int64 indices into the input's rows; None: every row

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The job's rows of x [N, D] -> [n, D] (a lone token's x as it is)."""
        return x if self.rows is None else x.index_select(0, self.rows)

    def apply(self, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        """expert(the job's rows of x) -> [n, D], unweighted: what a store hands back."""
        return expert(self.inputs(x))


class ExpertStore(Protocol):
    """The routed experts of one MoE layer: everything the MoE layer asks of them."""

    num_experts: int
    stacked: StackedExperts | None  # the whole layer stacked, when resident in a plain dtype
    packed: PackedExperts | None  # the whole layer in one call, when resident int8/int4

    def run(self, x: torch.Tensor, jobs: Sequence[Job]) -> Iterator[tuple[int, torch.Tensor]]:
        """(job.expert, expert(job's rows of x)) for every job (distinct experts), in any order:
        each as soon as it is ready. Every job has started (reads issued, rows sent) when this
        returns, so the caller computes meanwhile and then iterates; closing the iterator before
        its end releases what the pass holds."""
        ...

    def prefetch(self, ids: Sequence[int]) -> None:
        """Advice: these experts will be asked for soon. Returns at once."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes this store holds resident now."""
        ...


class LocalStore:
    """Base of the stores whose experts are computed in this process: `run` is built on
    `arrivals`, which is built on `get` (a subclass implements `get`, and `arrivals` when it
    can hand experts over as each becomes ready)."""

    num_experts: int
    stacked: StackedExperts | None = None
    packed: PackedExperts | None = None
    # Ask for at most this many experts at once (None: all of a pass's): a store reading from
    # disk beside a bounded cache must not hold a long prompt's whole layer at once.
    at_once: int | None = None

    def get(self, ids: Sequence[int], first: bool = True) -> Mapping[int, Expert]:
        """The experts `ids`, valid until the next `get` or `arrivals` on this store. `first`:
        False for a further ask of the same pass (a store counting passes counts it once)."""
        raise NotImplementedError

    def arrivals(self, ids: Sequence[int], first: bool = True) -> Iterator[tuple[int, Expert]]:
        """What `get` returns, as (id, expert) pairs, each as it becomes ready; every read has
        started when this returns. By default `get`'s, in order."""
        return iter(self.get(ids, first).items())

    def run(self, x: torch.Tensor, jobs: Sequence[Job]) -> Iterator[tuple[int, torch.Tensor]]:
        """`ExpertStore.run`: each job's expert applied as it arrives, `at_once` experts at a
        time. The first chunk is asked for now; later ones as the caller iterates."""
        if not jobs:
            return iter(())
        step = self.at_once or len(jobs)
        chunks = [jobs[i : i + step] for i in range(0, len(jobs), step)]
        first = self.arrivals([j.expert for j in chunks[0]], True)
        return self._computed(x, chunks, first)

    def _computed(
        self, x: torch.Tensor, chunks: list[Sequence[Job]], arriving: Iterator[tuple[int, Expert]]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        for i, chunk in enumerate(chunks):
            if i:
                arriving = self.arrivals([j.expert for j in chunk], False)
            by_id = {j.expert: j for j in chunk}
            try:
                for e, expert in arriving:
                    yield e, by_id[e].apply(expert, x)
            finally:
                close = getattr(arriving, "close", None)
                if close is not None:
                    close()

    def prefetch(self, ids: Sequence[int]) -> None:
        """Advice only; a store with nothing to read ahead ignores it."""


class ExpertSource(Protocol):
    """Where a model's routed experts live when the loader does not read them from the
    checkpoint (streamed from disk, other machines): the loader builds every MoE layer with
    its store (`latentkv.models.weights.load_model(..., experts=source)`)."""

    # Each MoE layer predicts the next MoE layer's experts from its hidden state and calls that
    # store's `prefetch` (worth it when a store reads ahead: the router runs twice per layer).
    predicts: bool

    def store(self, layer: int) -> ExpertStore:
        """The store of MoE layer `layer` (the checkpoint's layer index)."""
        ...


class ExpertFront(Protocol):
    """Serves each MoE layer's routed experts on the model's device from a store in host memory
    (a `DeviceCache`): the loader reads the layer's resident experts onto `host` (or takes an
    `ExpertSource`'s store) and builds the MoE layer with `over(layer, that store, resident)`."""

    host: torch.device  # where the loader reads resident routed experts
    predicts: bool  # as `ExpertSource.predicts`

    def over(self, layer: int, store: ExpertStore, resident: bool) -> ExpertStore:
        """Layer `layer`'s store on the device, in front of `store`; `resident`: `store` holds
        every expert in host memory (read by the loader), else it is a source's (streamed)."""
        ...
