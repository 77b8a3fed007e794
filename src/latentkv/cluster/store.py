"""RemoteExperts: the ExpertStore of one MoE layer whose routed experts live on a cluster's ranks
(the head's own share among them), and ClusterSource, which builds a model with one per layer.

    run(x, jobs)     each rank that owns one of the jobs' experts gets those jobs' rows (sent
                     now, before `run` returns), the head starts its own share's reads; then the
                     outputs (unweighted, as every store's) are yielded as they come, the head's
                     and the remote ones mixed. The MoE layer weights them and adds them in its own
                     fixed order, so the result is the one process's, bit for bit: a remote rank
                     computes Expert(rows) on exactly the rows the head's own pass would give
                     that expert (`Job.apply`).
    prefetch(ids)    the head's prediction of this layer's experts, split by owner: the head's
                     own reads start, the other owners get it at once (a message each), so their
                     reads start before the rows arrive.

Nothing here is seen by the model code: it asks its store for `run` and `prefetch`, as it asks a
store of experts in memory or on this machine's disk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from latentkv.cluster.head import Cluster


class RemoteExperts:
    """One MoE layer's experts over the cluster (the `ExpertStore` protocol)."""

    stacked = None  # never all here: the MoE layer asks `run`
    packed = None  # nor packed resident here

    def __init__(self, layer: int, num_experts: int, cluster: Cluster, local):
        self.layer = layer
        self.num_experts = num_experts
        self.cluster = cluster
        self.local = local  # the head's store of this layer (its share, or a full store), or None

    def run(self, x: torch.Tensor, jobs: Sequence) -> Iterator[tuple[int, torch.Tensor]]:
        mine, theirs = [], {}
        for job in jobs:
            r = self.cluster.owner(self.layer, job.expert)
            if r == 0:
                mine.append(job)
            else:
                theirs.setdefault(r, []).append(job)
        if mine and self.local is None:
            raise RuntimeError(f"layer {self.layer}: the head owns experts but has no store")  # placement bug
        self.cluster.record(self.layer, [j.expert for js in theirs.values() for j in js], x.shape[0])
        ex = self.cluster.exchange(
            self.layer, {r: [(j.expert, j.inputs(x)) for j in js] for r, js in theirs.items()}
        )
        try:
            local = self.local.run(x, mine) if mine else iter(())
        except BaseException:
            self.cluster.finish(ex)
            raise
        return self._merge(ex, local)

    def _merge(self, ex, local) -> Iterator[tuple[int, torch.Tensor]]:
        cluster = self.cluster
        try:
            for e, y in local:
                yield e, y
                yield from cluster.outputs(ex, block=False)
            yield from cluster.outputs(ex)
        finally:
            cluster.finish(ex)
            close = getattr(local, "close", None)
            if close is not None:
                close()

    def prefetch(self, ids: Sequence[int]) -> None:
        mine, theirs = [], {}
        for e in ids:
            r = self.cluster.owner(self.layer, e)
            (mine if r == 0 else theirs.setdefault(r, [])).append(e)
        if mine and self.local is not None:
            self.local.prefetch(mine)
        if theirs:
            self.cluster.prefetch(self.layer, theirs)

    @property
    def nbytes(self) -> int:
        return self.local.nbytes if self.local is not None else 0


class ClusterSource:
    """How a head's model is built: every MoE layer's store is a RemoteExperts (the seams'
    `ExpertSource`: `models.weights.load_model(..., experts=source)`)."""

    predicts = True  # each MoE layer predicts the next one's experts (forwarded to their owners)

    def __init__(self, cluster: Cluster, streamer, num_experts: int, at_once: int):
        self.cluster = cluster
        self.streamer = streamer  # the head's ExpertStreamer (its share), or None when it owns none
        self.num_experts = num_experts
        self.at_once = at_once  # the head's own experts are asked for k at a time (one token's)

    def store(self, layer: int) -> RemoteExperts:
        local = None
        if self.streamer is not None and layer in self.streamer.manifest.layers:
            local = self.streamer.layer(layer, self.at_once)
        return RemoteExperts(layer, self.num_experts, self.cluster, local)
