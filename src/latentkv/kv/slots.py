"""One tensor per layer for the float32 caches of the sequences a server decodes together.

A batched decode step reads every running sequence's rows at once as a padded [B, T, width]
tensor and writes one new row into each cache per layer. With each cache in its own buffers
that is a padding copy and B small writes per layer and step, which on a small model costs as
much as the layer's arithmetic. A `SlotPool` holds the rows (and DSA indexer keys) of up to
`slots` float32 caches side by side,

    rows[layer]   [slots, capacity, Lkv + R]     keys[layer]   [slots, capacity, D_index]

and a cache placed in it keeps working as before: its buffers become views of its slot
(`_Buffer.bind`), so `append`, `view`, `state`, sessions and KV files see no difference.
`latentkv.models.batch.decode_batch` given the pool writes a step's B new rows with one
`index_put_` per layer and reads the padded rows as a slice (or one gather) of the slot axis.

Capacity grows by doubling for every slot at once, whoever asks (a bound buffer that needs
more room asks the pool), up to `max_bytes`; past that the pool hands every cache its own
storage back and takes none until all of those have been released. A released slot is zeroed, so the rows
past a sequence's end are finite (masked out, and 0 * finite adds nothing to the context).
"""

from __future__ import annotations

import torch

from latentkv.kv.cache import CacheLayout, LatentCache, _Buffer

# Default bound on the pool's tensors: beyond it the caches go back to their own buffers.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class SlotPool:
    def __init__(
        self, layout: CacheLayout, slots: int, capacity: int = 64, max_bytes: int = DEFAULT_MAX_BYTES
    ):
        if slots < 1:
            raise ValueError(f"a slot pool needs at least one slot (got {slots})")
        self.layout = layout
        self.slots = slots
        self.max_bytes = max_bytes
        self.capacity = 0
        self.rows: list[torch.Tensor] = []
        self.keys: dict[int, torch.Tensor] = {}
        self._owner: list[LatentCache | None] = [None] * slots
        self._slot: dict[int, int] = {}  # id(cache) -> slot
        # caches handed back over max_bytes and not yet released (held, so their ids stay theirs)
        self._evicted: dict[int, LatentCache] = {}
        self._initial = capacity
        self._allocate(capacity)

    # --- placement ------------------------------------------------------------------------

    def place(self, cache: LatentCache) -> bool:
        """Move a float32 cache's rows into a free slot; False (cache untouched) when the cache
        is of another tier, there is no free slot, or its rows would not fit under max_bytes."""
        if not cache.tier.poolable or cache.layout != self.layout or id(cache) in self._slot:
            return False
        if self._evicted or None not in self._owner:
            return False
        if cache.length > self.capacity:
            if self.bytes_for(max(cache.length, 2 * self.capacity)) > self.max_bytes:
                return False
            self._grow(cache.length)
        slot = self._owner.index(None)
        with torch.inference_mode():
            for tensor, buffer in self._pairs(cache):
                pooled = tensor[slot]
                pooled[: cache.length] = buffer.data[: cache.length]
                buffer.bind(pooled, self)
        self._owner[slot] = cache
        self._slot[id(cache)] = slot
        return True

    def release(self, cache: LatentCache) -> None:
        """Give a placed cache its own buffers back (its committed rows copied out) and free
        its slot. Call it between passes (a pass in progress writes past `length`)."""
        self._evicted.pop(id(cache), None)
        slot = self._slot.pop(id(cache), None)
        if slot is None:
            return
        with torch.inference_mode():
            for tensor, buffer in self._pairs(cache):
                buffer.bind(buffer.data[: max(cache.length, 1)].clone(), None)
                tensor[slot].zero_()
        self._owner[slot] = None

    def _evict_all(self) -> None:
        """Over max_bytes: every cache gets its own buffers back, whole slots copied (a pass in
        progress may have written past `length`), and the pool takes no cache until all of
        those are released."""
        with torch.inference_mode():
            for cache in self._owner:
                if cache is not None:
                    for _, buffer in self._pairs(cache):
                        buffer.bind(buffer.data.clone(), None)
        self._evicted = {id(c): c for c in self._owner if c is not None}
        self._slot.clear()
        self._owner = [None] * self.slots
        self._allocate(self._initial)

    def slot_of(self, cache) -> int | None:
        return self._slot.get(id(cache))

    def __len__(self) -> int:
        return len(self._slot)

    # --- growth ---------------------------------------------------------------------------

    def reserve(self, end: int) -> bool:
        """Room for `end` rows in every slot; False when that would pass max_bytes (then every
        cache has been given its own buffers back)."""
        return end <= self.capacity or self._grow(end)

    def grow_for(self, buffer: _Buffer, end: int) -> None:
        """A bound buffer needs `end` rows: grow every slot, or (over max_bytes) hand every
        cache its own storage (the caller, `_Buffer.reserve`, then grows that)."""
        self._grow(end)

    def _grow(self, end: int) -> bool:
        capacity = max(end, 2 * self.capacity)
        if self.bytes_for(capacity) > self.max_bytes:
            self._evict_all()
            return False
        old_rows, old_keys, old = self.rows, self.keys, self.capacity
        self._allocate(capacity)
        with torch.inference_mode():
            for layer, tensor in enumerate(old_rows):
                self.rows[layer][:, :old] = tensor
            for layer, tensor in old_keys.items():
                self.keys[layer][:, :old] = tensor
        for slot, cache in enumerate(self._owner):
            if cache is not None:
                for tensor, buffer in self._pairs(cache):
                    buffer.bind(tensor[slot], self)
        return True

    def bytes_for(self, capacity: int) -> int:
        width = self.layout.num_layers * self.layout.row_width
        width += len(self.layout.index_layers) * self.layout.index_head_dim
        return self.slots * capacity * width * 4

    def nbytes(self) -> int:
        return self.bytes_for(self.capacity)

    def _allocate(self, capacity: int) -> None:
        layout = self.layout
        with torch.inference_mode():
            self.rows = [
                torch.zeros(self.slots, capacity, layout.row_width, device=layout.device)
                for _ in range(layout.num_layers)
            ]
            self.keys = {
                layer: torch.zeros(self.slots, capacity, layout.index_head_dim, device=layout.device)
                for layer in layout.index_layers
            }
        self.capacity = capacity

    def _pairs(self, cache: LatentCache):
        """(pool tensor, buffer) for every buffer of a cache: its rows per layer, then its DSA
        keys per indexer layer."""
        yield from zip(self.rows, cache._rows, strict=True)
        for layer, buffer in cache._index.items():
            yield self.keys[layer], buffer

    # --- what a batched step reads and writes -----------------------------------------------

    @staticmethod
    def padded(tensor: torch.Tensor, index: torch.Tensor | slice, T: int) -> torch.Tensor:
        """The first T rows of the slots at `index` (a slice: a view) in one layer's tensor:
        [B, T, width]."""
        if isinstance(index, slice):
            return tensor[index, :T]
        return tensor[:, :T].index_select(0, index)

    def flat_index(self, slots: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Row numbers of each sequence's `position` in its slot, in any layer's tensor viewed as
        [slots * capacity, width] (`write`): one index for every layer of a step."""
        return torch.tensor(slots, device=positions.device) * self.capacity + positions

    @staticmethod
    def write(tensor: torch.Tensor, flat: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [B, width] at the rows `flat_index` gave (one op)."""
        tensor.view(-1, tensor.shape[-1]).index_copy_(0, flat, rows)
