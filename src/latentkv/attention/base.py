"""The attention seam: one backend per (tier, device), chosen once, asked for every layer.

A backend computes absorbed MLA attention over cached latent rows (see `latentkv.models.mla`
for the math): queries [H, S, Lkv+R] (softmax scale folded in) -> latent context [H, S, Lkv].
Two entry points, one per shape of work:

    attend(query, reader, allowed, positions)   one sequence's S queries over its rows
                                                (`latentkv.kv.cache.RowReader`), tiled
    attend_selected(query, reader, index, pos)  one decode token over the rows at `index` (DSA's
                                                top-k), however the backend reads them
    attend_batch(query, readers, blocked)       one new token of each of B sequences stored
                                                alike, over padded rows (batched decode)
    attend_padded(query, rows, blocked, Lkv)    the same over float32 rows already padded
                                                [B, T, Lkv+R] (a slot pool's)

The backend owns the arithmetic: the cache's readers (`latentkv.kv.cache`) hand it the stored
rows and their scales, nothing more. The torch reference (`reference.py`: `readers.py` per kind
of reader, over `consumers.py`, each codec's way of reading its stored rows) is what every other
backend is tested against. A Triton or CUDA backend registers here
with `@register_backend`, states which tiers and devices it serves in `refuse(tier, device)`
(None: served; else the reason), and is picked before the reference when it serves the pair.
"""

from __future__ import annotations

from typing import Protocol

import torch

from latentkv.kv.cache import KVTier, RowReader


class AttentionBackend(Protocol):
    name: str

    def refuse(self, tier: KVTier, device: torch.device) -> str | None:
        """None when this backend serves caches of `tier` on `device`; otherwise why not."""
        ...

    def attend(
        self,
        query: torch.Tensor,
        reader: RowReader,
        allowed: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def attend_selected(
        self, query: torch.Tensor, reader: RowReader, index: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor: ...

    def attend_batch(
        self, query: torch.Tensor, readers: list[RowReader], blocked: torch.Tensor | None
    ) -> torch.Tensor: ...

    def attend_padded(
        self, query: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor | None, kv_lora_rank: int
    ) -> torch.Tensor: ...


# Batched reads hold at most this many float32 values ([B, T, width]) padded; beyond it every
# sequence is read on its own (tiled), which bounds memory at long contexts. Read at call time
# (tests lower it).
BATCH_ATTEND_ELEMENTS = 8 * 1024 * 1024

# Registered backends, most specific first; the torch reference (registered last) serves all.
BACKENDS: list[AttentionBackend] = []
# (tier key, recent window, device) -> backend: plain data, which a compiled step guards on
_CHOSEN: dict[tuple[tuple, int, str], AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add a backend ahead of those registered before it (the reference stays the fallback)."""
    if any(b.name == backend.name for b in BACKENDS):
        raise ValueError(f"attention backend {backend.name!r} is registered twice")
    BACKENDS.insert(0, backend)
    _CHOSEN.clear()
    return backend


def backend_for(tier: KVTier, device: torch.device) -> AttentionBackend:
    """The backend for caches of `tier` (a resolved tier: its codecs and recent window) whose
    rows live on `device`, chosen once per pair; raises ValueError listing every backend's
    reason when none serves it."""
    key = (tier.key, tier.recent_window, str(device))
    if key not in _CHOSEN:
        _CHOSEN[key] = _choose(tier, torch.device(device))
    return _CHOSEN[key]


def _choose(tier: KVTier, device: torch.device) -> AttentionBackend:
    reasons = []
    for backend in BACKENDS:
        reason = backend.refuse(tier, device)
        if reason is None:
            return backend
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(f"no attention backend serves KV tier {tier.name} on {device}: " + "; ".join(reasons))
