"""The expert seam: a MoE layer asks its `ExpertStore` for the experts a batch routed to.

    experts = store.get([3, 17, 40])      # {id: Expert}, valid until the next `get` on this store
    y = experts[17](x)                    # SwiGLU: down(silu(gate(x)) * up(x)), each a `Linear`
    store.prefetch([5, 9])                # a hint: these will be asked for soon (may be ignored)

Contract (what a store may rely on, and what the MoE layer promises):
  - One store per MoE layer. `get(ids)` returns every requested expert (ids are distinct,
    0 <= id < num_experts); the Expert objects stay valid until the next `get` on the same
    store, and not longer: a store that loads experts lazily may evict or reuse their memory
    after that. The layer therefore asks once per forward pass for every expert it needs
    (at most min(num_experts, tokens * k) of them) and drops the mapping before the next pass.
  - `prefetch(ids)` is advice (e.g. the next layer's router run early); it returns at once.
  - `stacked` is the whole layer as two stacked tensors when the store keeps them resident in
    a plain dtype (f32, bf16): the MoE layer's fast paths (every expert at once, gathered
    experts) read it. A store without it (streamed, or packed formats) is served through `get`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from latentkv.weights.base import Linear
from latentkv.weights.swiglu import fused_swiglu


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


class ExpertStore(Protocol):
    """The routed experts of one MoE layer."""

    num_experts: int
    stacked: StackedExperts | None  # the whole layer stacked, when resident in a plain dtype
    # True for a store that reads experts from disk beside a bounded cache: a pass asks it for at
    # most one token's k experts per `get` (never a long prompt's whole layer at once)
    bounded: bool

    def get(self, ids: Sequence[int], first: bool = True) -> Mapping[int, Expert]:
        """The experts `ids`, valid until the next `get` on this store. `first`: False for a
        further `get` of the same pass (a store counting passes counts it once)."""
        ...

    def prefetch(self, ids: Sequence[int]) -> None:
        """Advice: these experts will be asked for soon."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes this store holds resident now."""
        ...
