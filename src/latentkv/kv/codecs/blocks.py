"""llama.cpp's block formats (q8_0, q5_0, q4_0, q4_1) over a KV row, and their rotated variants.

A row of n values is cut into blocks of `block` values (32 as in llama.cpp; 16 or 8 for a row that 32
does not divide, such as a tiny model's 8-wide rope key; `params()` records it); each block is stored
exactly as ggml stores it, so a row's bytes are those blocks back to back (no float32 scales:
the block scales are fp16 inside the code bytes, and `scale_count` is 0):

    format  block bytes (32 values)            quantize (per block; d, m stored as fp16)         value
    q8_0    d | 32 x int8                   34  d = amax / 127,  q = round(x / d)  (half away)  q d
    q5_0    d | qh (4 bytes) | 16 nibbles   22  d = max / -16,   q = min(31, trunc(x / d + 16.5)) (q - 16) d
    q4_0    d | 16 nibbles                  18  d = max / -8,    q = min(15, trunc(x / d + 8.5))  (q - 8) d
    q4_1    d | m | 16 nibbles              20  d = (max - min) / 15, m = min,
                                                q = min(15, trunc((x - m) / d + 0.5))         q d + m

`amax` is the largest |x| of the block and `max` the signed value that has it (the first one on a
tie), so that value lands exactly on the level -8 (-16) and the other side keeps 7 (15) levels.
The division is a multiplication by the float32 reciprocal 1 / d, as in ggml's reference
quantizer; a block of zeros has d = 0 and codes of the zero level. Nibbles: the low nibble of
byte j holds value j, the high nibble value j + block/2; q5_0's fifth bits are a little-endian
bitfield, bit j for value j. A row holding a NaN or an infinity is stored as all zero bytes (it
decodes to zeros, as every codec's inert rows do), and so is a block whose fp16 scale would overflow.

The rotated variants (`hq8_0`, `hq5_0`, `hq4_0`, `hq4_1`) first rotate the row with the seeded
randomized Hadamard transform of the tq tiers (a power-of-two width), then store the rotated row
in the same blocks: the rotation spreads an outlier channel over the whole row, so each block's
scale fits its values better. Attention reads them in the rotated basis (the query is rotated
once), as it reads tq.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from latentkv import native
from latentkv.kv.codecs.base import HOST, Codec, EncodedRows, PerDevice
from latentkv.kv.codecs.rotation import DEFAULT_SEED, Rotation
from latentkv.kv.codecs.turbo import require_power_of_two


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block type: its bits per value, whether it stores a minimum, its level offset."""

    name: str
    bits: int
    affine: bool  # stores m (the block minimum): q d + m; else symmetric (q - offset) d
    offset: int  # the zero level of the symmetric formats (8 for q4_0, 16 for q5_0, 0 for q8_0)


FORMATS = {
    "q8_0": BlockFormat("q8_0", 8, False, 0),
    "q5_0": BlockFormat("q5_0", 5, False, 16),
    "q4_0": BlockFormat("q4_0", 4, False, 8),
    "q4_1": BlockFormat("q4_1", 4, True, 0),
}
BLOCK = 32


def block_for(width: int) -> int:
    """ggml's 32 where it divides the row, else 16 or 8 (tiny models' 8-wide rope keys); 0: none."""
    return next((b for b in (BLOCK, 16, 8) if width % b == 0), 0)


def _fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes [start, start + 2) of each block [N, B, bytes] -> float32 [N, B, 1].

    Read in place when every block's pair of bytes is 2-aligned (an even block size and row
    offset: every format at blocks of 32 or 16); otherwise through a fresh, aligned copy."""
    raw = blocks[..., start : start + 2]
    if raw.storage_offset() % 2 or any(s % 2 for s in raw.stride()[:-1]):
        raw = torch.empty(raw.shape, dtype=torch.uint8, device=raw.device).copy_(raw)
    return raw.view(torch.float16).to(torch.float32)


def _fifth_bit_table() -> torch.Tensor:
    """q5_0's fifth-bit bytes: byte v of the field -> 8 level bytes (bit i of v -> 16 in byte i),
    as one int64 each (little-endian), so a field expands with one gather: int64 [256]."""
    bits = (torch.arange(256, device=HOST)[:, None] >> torch.arange(8, device=HOST)) & 1  # [256, 8]
    return (bits * 16).to(torch.uint8).view(torch.int64)[:, 0]


FIFTH_BITS = PerDevice(_fifth_bit_table())


def _levels(blocks: torch.Tensor, header: int, high: int, bits: int) -> torch.Tensor:
    """The 4- or 5-bit codes of blocks [N, B, bytes] (header bytes, then the fifth-bit field of
    `high` bytes, then the nibbles) -> uint8 [N, B, b], value order (low nibbles, then high)."""
    body = blocks[..., header + high :].contiguous()  # [N, B, b/2]
    levels = torch.cat((body & 15, body >> 4), dim=-1)  # [N, B, b]
    if bits == 5:  # the fifth bits, one gather of 8 level bytes per field byte
        field = blocks[..., header : header + high].reshape(-1).to(torch.int32)
        fifth = FIFTH_BITS.on(blocks.device).index_select(0, field).view(torch.uint8)
        levels |= fifth.view(levels.shape)
    return levels


def _scaled(levels: torch.Tensor, d: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Integer levels [N, B, b] (uint8 or int8) -> (level - offset) * d, float32 [N, B, b]: the
    offset taken in int8 (levels < 32), then one widening and one in-place multiply."""
    if offset:
        levels = levels.view(torch.int8).sub(offset)
    return levels.to(torch.float32).mul_(d)


def _half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: round half away from zero."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


class BlockCodec(Codec):
    """Rows as ggml blocks of one format (`RotatedBlockCodec`: rotated first)."""

    rotated = False

    def __init__(self, width: int, fmt: str, *, seed: int = DEFAULT_SEED, block: int | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown block format {fmt!r}; valid: {', '.join(FORMATS)}")
        block = block_for(width) if block is None else block
        if width < 1 or block < 8 or block % 8 or width % block:
            raise ValueError(
                f"{fmt} stores rows in blocks of 32 values (16 or 8 on narrower rows), "
                f"but this row is {width} wide; use fp8, which works at any width"
            )
        self.format = FORMATS[fmt]
        self.name = ("h" if self.rotated else "") + fmt
        if self.rotated:
            require_power_of_two(self.name, width)
        self.width, self.block, self.bits = width, block, self.format.bits
        self.blocks = width // block
        self.header = 4 if self.format.affine else 2  # fp16 d (and m)
        self.high = block // 8 if self.bits == 5 else 0  # q5_0's fifth-bit field
        self.quant = block if self.bits == 8 else block // 2
        self.block_bytes = self.header + self.high + self.quant
        self.code_bytes = self.blocks * self.block_bytes
        self.scale_count = 0
        self.rotation = Rotation(width, seed) if self.rotated else None

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "name": self.name,
            "width": self.width,
            "bits": self.bits,
            "block": self.block,
        }
        if self.rotation is not None:
            params["rotation_seed"] = self.rotation.seed
        return params

    # --- encode ---------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> EncodedRows:
        x = self.check_rows(x)
        if self.rotation is None and (enc := native_encode(self.name, x, self.block)) is not None:
            return enc
        return self.encode_reference(x)

    def encode_reference(self, x: torch.Tensor) -> EncodedRows:
        """`encode` through torch ops (what the native encoder's bytes are tested against)."""
        x = self.check_rows(x)
        n = x.shape[0]
        if self.rotation is not None:
            x = self.rotation.rotate(x)
        blocks = x.reshape(n, self.blocks, self.block)  # [N, B, b]
        q, d, m = self._quantize(blocks)
        d16, m16 = d.to(torch.float16), m.to(torch.float16)
        bad = ~torch.isfinite(d16) | ~torch.isfinite(m16)  # [N, B]
        bad |= ~torch.isfinite(x).all(dim=-1, keepdim=True)  # a NaN or inf anywhere: the whole row is inert
        parts = [d16[..., None].view(torch.uint8)]
        if self.format.affine:
            parts.append(m16[..., None].view(torch.uint8))
        parts.extend(self._pack(q))
        codes = torch.cat(parts, dim=-1)  # [N, B, block_bytes]
        codes = codes.masked_fill(bad[..., None], 0)
        return EncodedRows(
            codes.reshape(n, self.code_bytes), torch.empty(n, 0, dtype=torch.float32, device=x.device)
        )

    def _quantize(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """blocks [N, B, b] float32 -> integer levels [N, B, b] (int32), d [N, B], m [N, B] (float32)."""
        safe = torch.nan_to_num(blocks, nan=0.0, posinf=0.0, neginf=0.0)
        fmt = self.format
        zero = torch.zeros(safe.shape[:-1], device=safe.device)
        if fmt.affine:
            lo, hi = safe.amin(dim=-1), safe.amax(dim=-1)
            d = (hi - lo) / 15.0
            inv = torch.where(d != 0, 1.0 / d, zero)
            q = ((safe - lo[..., None]) * inv[..., None] + 0.5).to(torch.int32).clamp(max=15)
            return q, d, lo
        if fmt.bits == 8:
            d = safe.abs().amax(dim=-1) / 127.0
            inv = torch.where(d != 0, 1.0 / d, zero)
            return _half_away(safe * inv[..., None]).to(torch.int32), d, zero
        top = safe.gather(-1, safe.abs().argmax(dim=-1, keepdim=True))[..., 0]  # signed, first on ties
        d = top / -float(fmt.offset)
        inv = torch.where(d != 0, 1.0 / d, zero)
        q = (safe * inv[..., None] + (fmt.offset + 0.5)).to(torch.int32)  # truncation toward zero
        return q.clamp(max=2 * fmt.offset - 1), d, zero

    def _pack(self, q: torch.Tensor) -> list[torch.Tensor]:
        """Levels [N, B, b] -> the quant bytes of each block (q5_0: the fifth-bit field first)."""
        if self.bits == 8:
            return [q.to(torch.int8).view(torch.uint8)]
        return _pack_nibbles_and_high(q, self.block, self.bits)

    # --- decode ---------------------------------------------------------------------------

    def block_values(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [N, code_bytes] -> the stored row, scales applied, float32 [N, n], in the
        basis the row was quantized in (rotated for the h* codecs): what attention reads."""
        n = codes.shape[0]
        blocks = codes.view(n, self.blocks, self.block_bytes)
        d = _fp16_at(blocks, 0)  # [N, B, 1]
        if self.bits == 8:
            return _scaled(blocks[..., self.header :].view(torch.int8), d).view(n, self.width)
        levels = _levels(blocks, self.header, self.high, self.bits)  # [N, B, b]
        if self.format.affine:
            return _scaled(levels, d).add_(_fp16_at(blocks, 2)).view(n, self.width)
        return _scaled(levels, d, self.format.offset).view(n, self.width)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        values = self.block_values(enc.codes)
        return values if self.rotation is None else self.rotation.unrotate(values)


class RotatedBlockCodec(BlockCodec):
    """hq8_0 .. hq4_1: the row rotated by the seeded Hadamard transform, then stored in ggml blocks."""

    rotated = True


# --- searched block scales: q8s (q8_0's bytes), wq4 (q4_0's shape, non-uniform levels) ---------

# wq4's levels, in units of the block's largest level: the positive half (the negative half
# mirrors it). Lloyd-Max levels of Gaussian values divided by their block's largest magnitude
# (blocks of 32) under the error weight x^2, so they crowd towards the large values.
WQ4_LEVELS = (0.1844, 0.3147, 0.4262, 0.5329, 0.6406, 0.7521, 0.8703, 1.0)
SCALE_GRID = tuple(0.85 + 0.01 * i for i in range(21))  # trial scales, in units of amax / top level
SEARCH_ROWS = 256  # rows searched at once: 256 x 512 values x 42 trials, about 90 MB of temporaries


def native_encode(name: str, x: torch.Tensor, block: int) -> EncodedRows | None:
    """Rows x (float32 [N, n], contiguous) encoded by latentkv's native encoder
    (native/kv_blocks.cpp): the same bytes as the torch ops, without their per-call cost (a decode
    step encodes one row per layer). None where it does not run: a codec it does not write, a
    device other than the CPU, or no native kernels here."""
    if name not in native.ENCODE_KINDS or x.device.type != "cpu" or native.kernels() is None:
        return None
    codes = torch.ops.latentkv.encode_blocks(x, native.ENCODE_KINDS[name], block)
    return EncodedRows(codes, torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device))


def level_table(name: str) -> torch.Tensor:
    """q8s: the 255 integers -127 .. 127 (code byte = int8 level); q4s: q4_0's -8 .. 7 (code =
    level + 8); wq4: its 16 levels; float32, on the host."""
    if name == "q8s":
        return torch.arange(-127, 128, dtype=torch.float32, device=HOST)
    if name in ("q4s", "q5s"):
        top = 8 if name == "q4s" else 16
        return torch.arange(-top, top, dtype=torch.float32, device=HOST)
    half = torch.tensor(WQ4_LEVELS, dtype=torch.float64, device=HOST)
    return torch.cat((-half.flip(0), half)).to(torch.float32)


class SearchedBlockCodec(Codec):
    """ggml-shaped blocks of 32 (fp16 d first) whose scale minimises a weighted block error.

    Each block's d is the best of the trial scales d = g amax / top level (g in SCALE_GRID) and
    the weighted least-squares refit of the best one's codes, d = sum w x q / sum w q^2, where the
    error weighs each value by w = x^2 (as ggml's k-quants do without an importance matrix):
    attention's dot products lean on a block's large values, so their error counts most.

    q8s: q8_0's bytes exactly (fp16 d | 32 x int8), so llama.cpp reads it as q8_0; q5s and q4s:
    q5_0's and q4_0's bytes (levels -16 .. 15, -8 .. 7; both signs of d tried, so either side may
    take the extra level), with the weight x^2 + the block's mean x^2.
    wq4: q4_0's shape (fp16 d | 16 nibbles, low nibble value j, high value j + 16), the codes
    indexing the 16 symmetric levels `level_table("wq4")` (x_hat = level[code] d): 90 bytes a
    token per layer at the fixture's widths, as q4_0.
    """

    def __init__(self, width: int, name: str):
        if name not in ("q8s", "q5s", "q4s", "wq4"):
            raise ValueError(f"unknown searched block codec {name!r}")
        self.name, self.bits = name, {"q8s": 8, "q5s": 5}.get(name, 4)
        block = block_for(width)
        if width < 1 or not block:
            raise ValueError(
                f"{name} stores rows in blocks of 32 values (16 or 8 on narrower rows), "
                f"but this row is {width} wide; use fp8, which works at any width"
            )
        self.width, self.block, self.blocks = width, block, width // block
        self.high = block // 8 if self.bits == 5 else 0  # q5_0's fifth-bit field
        self.block_bytes = 2 + self.high + (block if self.bits == 8 else block // 2)
        self.code_bytes = self.blocks * self.block_bytes
        self.scale_count = 0
        self.table = level_table(name)  # on the host; `_device_table`: on each device it is used on
        # the end levels as Python floats: read from the table per call, they broke a compiled
        # step's graph (a tensor-to-float conversion)
        self._low, self._high = float(self.table[0]), float(self.table[-1])
        self._mids = (self.table[1:] + self.table[:-1]) / 2
        self._top = self.table.abs().max()  # a 0-dim host tensor: a scalar to an op on any device
        signs = (1.0, -1.0) if name in ("q4s", "q5s") else (1.0,)  # either side may take -8 (-16)
        trials = [g * s for g in SCALE_GRID for s in signs]
        grid = torch.tensor(trials, dtype=torch.float32, device=HOST).view(-1, 1, 1, 1)  # [G, 1, 1, 1]
        self._device_table = PerDevice(self.table)
        self._device_mids = PerDevice(self._mids)
        self._device_grid = PerDevice(grid)

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "bits": self.bits, "block": self.block}

    def encode(self, x: torch.Tensor) -> EncodedRows:
        x = self.check_rows(x)
        if (enc := native_encode(self.name, x, self.block)) is not None:
            return enc
        return self.encode_reference(x)

    def encode_reference(self, x: torch.Tensor) -> EncodedRows:
        """`encode` through torch ops (what the native encoder's bytes are tested against)."""
        x = self.check_rows(x)
        n = x.shape[0]
        blocks = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0).view(n, self.blocks, self.block)
        levels, d16 = self._search(blocks)
        idx = self._level_index(levels)  # the code of each level
        bad = ~torch.isfinite(d16[..., 0]) | ~torch.isfinite(x).all(dim=-1, keepdim=True)  # [N, B]
        if self.bits == 8:
            body = [(idx - 127).to(torch.int8).view(torch.uint8)]
        else:
            body = _pack_nibbles_and_high(idx, self.block, self.bits)
        codes = torch.cat([d16.view(torch.uint8), *body], dim=-1).masked_fill(bad[..., None], 0)
        return EncodedRows(
            codes.reshape(n, self.code_bytes), torch.empty(n, 0, dtype=torch.float32, device=x.device)
        )

    def _nearest(
        self, blocks: torch.Tensor, w: torch.Tensor, d: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The nearest level (its value) to each of blocks [N, B, b] under scales d [..., N, B, 1]
        (trial scales lead), and each block's error [..., N, B, 1] weighted by w [N, B, b]."""
        levels = self._nearest_level(blocks / d.masked_fill(d == 0, 1.0))
        return levels, (w * (levels * d - blocks).square()).sum(dim=-1, keepdim=True)

    def _nearest_level(self, v: torch.Tensor) -> torch.Tensor:
        """table[_level_index(v)], float32; integer levels without the table lookup."""
        if self.name == "wq4":
            return self._device_table.on(v.device)[self._level_index(v)]
        below = torch.floor(v)
        return (below + (v > below + 0.5)).clamp_(self._low, self._high)

    def _level_index(self, v: torch.Tensor) -> torch.Tensor:
        """The index of the nearest level to each v (int64), the lower one on a tie: the number
        of midpoints below v. Integer levels (q8s, q5s, q4s): floor(v), plus one where v is above
        the midpoint floor(v) + 1/2 (exact in float32 up to 2^22, beyond which every v is clamped
        to an end level); wq4: a comparison with each of its 15 midpoints."""
        if self.name == "wq4":
            return (v.unsqueeze(-1) > self._device_mids.on(v.device)).sum(dim=-1)
        low, high = self._low, self._high
        below = torch.floor(v)
        return (below + (v > below + 0.5)).clamp_(low, high).sub_(low).to(torch.int64)

    def weight(self, blocks: torch.Tensor) -> torch.Tensor:
        """The error weight of each value: x^2 (q8s, wq4); q4s adds the block's mean x^2, so
        that small values keep some weight at 4 bits."""
        w = blocks.square()
        return w + w.mean(dim=-1, keepdim=True) if self.name in ("q4s", "q5s") else w

    def _best(
        self, blocks: torch.Tensor, w: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Over trial scales [G, N, B, 1], all at once: the levels [N, B, b] and the scale [N, B, 1]
        of least weighted error, the first such trial on a tie (a NaN error never wins, unless it
        is the first trial's: as a running `err < best` comparison over the trials would pick)."""
        levels, err = self._nearest(blocks, w, scales)  # [G, N, B, b], [G, N, B, 1]
        nan = torch.isnan(err)
        pick = torch.where(nan, torch.inf, err).argmin(dim=0, keepdim=True)  # [1, N, B, 1]
        pick = pick.masked_fill(nan[:1], 0)
        return levels.gather(0, pick.expand(1, *levels.shape[1:]))[0], scales.gather(0, pick)[0]

    def _search(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [N, B, b] -> levels [N, B, b] and fp16 scales [N, B, 1], SEARCH_ROWS rows at a
        time (the trial scales multiply the work by len(SCALE_GRID), or twice it)."""
        if blocks.shape[0] <= SEARCH_ROWS:
            return self._search_rows(blocks)
        parts = [self._search_rows(part) for part in blocks.split(SEARCH_ROWS)]
        return torch.cat([i for i, _ in parts]), torch.cat([d for _, d in parts])

    def _search_rows(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def fp16(d: torch.Tensor) -> torch.Tensor:
            return d.to(torch.float16).to(torch.float32)

        unit = blocks.abs().amax(dim=-1, keepdim=True) / self._top  # [N, B, 1]
        w = self.weight(blocks)
        q, d = self._best(blocks, w, fp16(unit * self._device_grid.on(blocks.device)))
        refit = (w * blocks * q).sum(-1, keepdim=True) / (w * q.square()).sum(-1, keepdim=True).clamp_min(
            1e-30
        )
        q, d = self._best(blocks, w, torch.stack((d, fp16(refit))))
        return q, d.to(torch.float16)

    def block_values(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [N, code_bytes] -> level[code] * d, float32 [N, n] (what attention reads)."""
        n = codes.shape[0]
        blocks = codes.view(n, self.blocks, self.block_bytes)
        d = _fp16_at(blocks, 0)  # [N, B, 1]
        if self.bits == 8:
            return _scaled(blocks[..., 2:].view(torch.int8), d).view(n, self.width)
        levels = _levels(blocks, 2, self.high, self.bits)  # [N, B, b] codes
        if self.name in ("q4s", "q5s"):  # q4_0's (q5_0's) levels: code - 8 (- 16)
            return _scaled(levels, d, len(self.table) // 2).view(n, self.width)
        values = self._device_table.on(codes.device).index_select(0, levels.view(-1).to(torch.int32))
        return values.view(levels.shape).mul_(d).view(n, self.width)

    def decode(self, enc: EncodedRows) -> torch.Tensor:
        self.check_encoded(enc)
        return self.block_values(enc.codes)


def _pack_nibbles_and_high(q: torch.Tensor, block: int, bits: int) -> list[torch.Tensor]:
    """Levels [N, B, b] -> [fifth-bit field (5 bits only)], nibbles: q4_0 / q5_0's byte layout."""
    half = block // 2
    parts = [((q[..., :half] & 15) | ((q[..., half:] & 15) << 4)).to(torch.uint8)]
    if bits == 5:
        fifth = ((q >> 4) & 1).view(*q.shape[:-1], block // 8, 8)
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
        parts.insert(0, (fifth * weights).sum(dim=-1).to(torch.uint8))
    return parts
