"""int4 weights (`--weight-dtype int4`): group-wise asymmetric, scales and zero points per group.

For each output row o and group g of `group_size` consecutive input columns (32, 64, 128 or 256):

    scale[g, o] = (max - min) / 15              over the group's weights
    q[o, i]     = round((W[o, i] - min) / scale) in [0, 15]
    zero[g, o]  = min + 8 * scale
    W~[o, i]    = (q[o, i] - 8) * scale + zero  = q * scale + min: the matrix computed with

which is the convention of torch's CPU int4 op `_weight_int4pack_mm_for_cpu` (`qScaleAndZeros`
[in / G, out, 2]). Scale and zero are bfloat16 (the scale rounded up, so the range still spans
the group): the op takes them in the activations' dtype and its bfloat16 path is its fast one.

Decode and short prompts (up to `KERNEL_MAX_ROWS` rows) runs latentkv's own kernel (`latentkv/native`) where it
builds: it reads the matrix packed in `KERNEL_LAYOUT` (blocks of 64 output rows, column by
column; the layout torch's op uses on AVX-512 for whole blocks), with float32 activations (int16
on AVX-512 VNNI) and the residual add folded in. Elsewhere decode runs torch's op on bfloat16 x,
on the matrix packed in the op's own layout, which depends on the CPU's vector width
(`op_layout`). Either way the packed form is made at load and a file holds the portable nibbles
(`pack_nibbles`: byte j of a row holds columns 2j in its low and 2j+1 in its high nibble), or
the packed bytes with their layout named (an expert store). Prefill runs dequantized tiles.

Shapes: out is padded with zero rows to a multiple of 64 (the kernel's block; 16 for the op) and
in with zero columns to a multiple of group_size (x is padded to match where the op needs it).

float32 scales: a state whose scale and zero are float32 (GGUF's Q4_0, Q4_1 and Q4_K blocks map
onto groups of 32 this way: their scales are f16 numbers, or f16 times 6-bit integers, which
bfloat16 cannot hold) keeps the zero as float32 and the scale as two bfloat16 parts, scale =
hi + lo (hi its bfloat16 rounding, lo the bfloat16 rounding of the rest): 16 significant bits,
so every f16 scale is held exactly and a wider one to 2^-17 of itself. The product runs once per
part with zero 0 on the same packed codes, and the zeros come in through one small float32
product, sum_g zero[o, g] * (sum of x over group g): [M, in / G] x [in / G, out], 1/G of the
work. So such a weight costs about twice the product's time. `dequantize` and `nibbles` return
what the products compute with: scale hi + lo and the float32 zero.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from latentkv import native
from latentkv.weights.base import Linear, register
from latentkv.weights.int4_cuda import matmul_cuda, pack_cuda, portable_cuda
from latentkv.weights.int8 import _fits, _rows, bf16_at_least
from latentkv.weights.kernels import matmul_dtype

GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 64
OUT_MULTIPLE = 16  # the packing op's requirement on the output dimension
# Prefill: with more rows than this, the product runs on dequantized bfloat16 tiles (AMX /
# AVX512-BF16 matmul) instead of the op. Unpacking costs about as much as the op's product of
# ~100 rows (GLM-5's 6144 x 2048: even near 96 rows, tiles 1.2x at 128, 3.3x at 512; measured
# with `benchmarks/vs_llamacpp.py --kernels`, docs/weights.md).
PREFILL_MIN_ROWS = 96
# With latentkv's kernel: up to this many rows run it, more run tiles (unpacking a tile costs
# what the kernel spends on ~250 rows of GLM-5's 6144 x 2048: `vs_llamacpp.py --kernels`).
KERNEL_MAX_ROWS = 256
# Output rows dequantized at a time on the tile path: bounds the temporary to TILE_ROWS x in
# bfloat16 (a multiple of the op's row block).
TILE_ROWS = 1024


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w float [out, in] (in % group_size == 0) -> (q uint8 [out, in] in 0..15,
    scale bfloat16 [out, in / G], zero bfloat16 [out, in / G]) with W~ = (q - 8) * scale + zero."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group_size, group_size)  # [out, groups, G]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, groups]
    scale = bf16_at_least(torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo)))
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((wg - zero.float()[..., None]) / scale.float()[..., None]) + 8
    return q.clamp_(0, 15).to(torch.uint8).reshape(out_f, in_f), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q [out, in], scale/zero [out, in / G]) -> float32 [out, in]: the reference formula."""
    out_f, in_f = q.shape
    groups = scale.shape[1]
    qg = q.float().reshape(out_f, groups, in_f // groups)
    return ((qg - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(out_f, in_f)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [out, in] (0..15, in even) -> uint8 [out, in / 2], the portable file layout."""
    pairs = q.reshape(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] -> uint8 [out, in] (0..15)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


Rows = slice | torch.Tensor
Layout = tuple[int, Rows, Rows]  # (block, low rows, high rows): see `op_layout`


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@register
class Int4Linear(Linear):
    format = "int4"
    table_dtype = torch.bfloat16  # a gather reads one row per token: 16 bits suffice there
    compile_needs_native = True
    pieces = ("nibbles", "scale", "zero")  # the portable state a file stores (`quantize_state`, `from_state`)
    scale_pieces = ("scale", "zero")  # the pieces a factor multiplies: W~ * c (`scaled_state`)
    scale_zeros_lo: torch.Tensor | None = None  # float32 scales: the rest of the scale, as scale_zeros
    zero_t: torch.Tensor | None = None  # float32 scales: the zeros, float32 [groups, out]

    def __init__(
        self,
        nibbles: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
    ):
        """nibbles uint8 [out, in_padded / 2] (`pack_nibbles`), scale/zero bfloat16
        [out, in_padded / G]: a weight as a file stores it; packed here for this CPU."""
        out_f, half = nibbles.shape
        groups = scale.shape[1]
        if nibbles.dtype != torch.uint8 or scale.shape != zero.shape or scale.shape[0] != out_f:
            raise ValueError(
                f"int4 weight needs uint8 nibbles [out, in/2] and scale/zero [out, groups]; got "
                f"{nibbles.dtype} {tuple(nibbles.shape)}, {tuple(scale.shape)}, {tuple(zero.shape)}"
            )
        pad_rows = _padded(out_f, row_multiple()) - out_f
        wide = scale.dtype == torch.float32 and zero.dtype == torch.float32
        zero_in_op = torch.zeros_like(zero) if wide else zero  # float32 zeros come in apart
        sz = torch.stack([scale, zero_in_op], dim=-1).to(torch.bfloat16)  # [out, groups, 2]
        if pad_rows:
            nibbles = F.pad(nibbles, (0, 0, 0, pad_rows), value=0x88)  # (8 - 8) * 1 + 0 = 0
            sz = torch.cat([sz, torch.tensor([1.0, 0.0], dtype=torch.bfloat16).expand(pad_rows, groups, 2)])
        # this process's layout (on a CUDA device, the CUDA op's); scale_zeros [groups, out_padded, 2]
        packed = pack_cuda(nibbles) if nibbles.is_cuda else pack(nibbles, layout())
        shape = (nibbles.shape[0], 2 * half)
        self._adopt(packed, sz.transpose(0, 1).contiguous(), in_features, out_f, bias, shape)
        if wide:
            rest = (scale - scale.to(torch.bfloat16).float()).to(torch.bfloat16)
            lo = torch.stack([rest, torch.zeros_like(rest)], dim=-1)  # [out, groups, 2]
            self.scale_zeros_lo = F.pad(lo, (0, 0, 0, 0, 0, pad_rows)).transpose(0, 1).contiguous()
            self.zero_t = zero.t().contiguous()  # [groups, out]

    def _adopt(
        self,
        packed: torch.Tensor,
        scale_zeros: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        shape: tuple[int, int] | None = None,
    ) -> None:
        """Take a weight in the op's layout as this Linear's state (no copy). `shape`: (out_padded,
        in_padded) of a layout that does not show it (the CUDA op's int32 tiles)."""
        out_padded, in_padded = shape or (packed.shape[0], 2 * packed.shape[1])
        half, groups = in_padded // 2, scale_zeros.shape[0]
        self.group_size = 2 * half // groups
        if self.group_size not in GROUP_SIZES or groups * self.group_size != 2 * half:
            raise ValueError(f"int4 group size {2 * half}/{groups} is not one of {GROUP_SIZES}")
        self.out_features, self.in_features = out_features, in_features
        self._in_padded, self._out_padded = in_padded, out_padded
        self.packed, self.scale_zeros = packed, scale_zeros
        self._bias = None if bias is None else bias.float().contiguous()
        cuda = packed.is_cuda  # torch's CUDA op, on its own layout (weights/int4_cuda.py)
        self._kernel = None if cuda else native.kernels()  # None: torch's op, on its own layout
        self.layout = None if cuda else layout()  # how `packed` holds the codes (None: the op's)

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        scale_zeros: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """A weight already in this process's layout (`layout()`; `packed` [out_padded,
        in_padded / 2] uint8, `scale_zeros` [groups, out_padded, 2] bfloat16: this object's own
        `packed` and `scale_zeros`), used as given: no copy. An expert store keeps experts this
        way, so a read expert needs no packing."""
        out_padded, half = packed.shape
        if (
            packed.dtype != torch.uint8
            or scale_zeros.dtype != torch.bfloat16
            or tuple(scale_zeros.shape[1:]) != (out_padded, 2)
            or out_padded != _padded(out_features, row_multiple())
            or not 0 < in_features <= 2 * half
        ):
            raise ValueError(
                f"int4 packed weight {packed.dtype} {tuple(packed.shape)} with scales "
                f"{scale_zeros.dtype} {tuple(scale_zeros.shape)} does not fit {out_features} x {in_features}"
            )
        self = cls.__new__(cls)
        self._adopt(packed, scale_zeros, in_features, out_features, bias)
        return self

    @classmethod
    def converted_on_cuda(
        cls,
        packed: torch.Tensor,
        stored: Layout,
        scale_zeros: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """A weight whose bytes were copied as the host holds them (`packed` uint8 [out_padded,
        in_padded / 2] in the CPU layout `stored`; `scale_zeros`, which both ops read alike) onto
        a CUDA device: the codes are rewritten there, in place, in the CUDA op's layout
        (`to_cuda_layout`), so the device holds one copy. The bytes are no longer `stored`'s."""
        out_padded, half = packed.shape
        if out_padded != _padded(out_features, row_multiple()) or out_padded % stored[0]:
            raise ValueError(f"int4 packed weight {tuple(packed.shape)} does not fit {out_features} rows")
        self = cls.__new__(cls)
        codes = to_cuda_layout(packed, stored)
        self._adopt(codes, scale_zeros, in_features, out_features, bias, shape=(out_padded, 2 * half))
        return self

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **params) -> Int4Linear:
        return cls.from_state(cls.quantize_state(w, **params), w.shape[1], bias)

    @staticmethod
    def quantize_state(
        w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, **params
    ) -> dict[str, torch.Tensor]:
        """The portable tensors of w float [out, in] in this format (what a file stores): nibbles
        [out, in_padded / 2], scale and zero [out, groups]; output rows first in every piece, so
        matrices fused by rows concatenate piece by piece."""
        if params:
            raise ValueError(f"weight format int4 takes only group_size, got {sorted(params)}")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
        if w.dim() != 2:
            raise ValueError(f"int4 needs a matrix [out, in], got shape {tuple(w.shape)}")
        q, scale, zero = quantize_int4(pad_columns(w, group_size), group_size)
        return {"nibbles": pack_nibbles(q), "scale": scale, "zero": zero}

    @classmethod
    def from_state(
        cls, state: dict[str, torch.Tensor], in_features: int, bias: torch.Tensor | None = None
    ) -> Int4Linear:
        return cls(state["nibbles"], state["scale"], state["zero"], in_features, bias)

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = len(x.shape) == 2  # [M, in] already: no reshape around the product
        x2 = x if flat else x.reshape(-1, self.in_features)  # [M, in]
        y = self._product(x2, self.scale_zeros)
        if self.scale_zeros_lo is not None and self.zero_t is not None:  # float32 scales
            y = y + self._product(x2, self.scale_zeros_lo) + self._zeros(x2)
        if self._bias is not None:
            y = y + self._bias
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> float32 [M, out] with the codes and one set of scales and zeros."""
        if self._kernel is not None and x.shape[0] <= KERNEL_MAX_ROWS:
            return self._kernel.int4_mm(
                _rows(x), self.packed, scale_zeros, self.group_size, self.out_features
            )
        return self._prefill(x, scale_zeros)

    def _zeros(self, x: torch.Tensor) -> torch.Tensor:
        """float32 scales: sum_g zero[o, g] * (x summed over group g), [M, out] in float32."""
        xf = x.float()
        if self._in_padded != self.in_features:
            xf = F.pad(xf, (0, self._in_padded - self.in_features))
        return xf.view(xf.shape[0], -1, self.group_size).sum(-1) @ self.zero_t  # [M, groups] x [groups, out]

    def add_to(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        fused = self._kernel is not None and self._bias is None and residual is not None
        fused = fused and self.scale_zeros_lo is None
        if fused and x.shape[0] <= KERNEL_MAX_ROWS and _fits(residual, x.shape[0], self.out_features):
            sz = self.scale_zeros
            return self._kernel.int4_mm(
                _rows(x), self.packed, sz, self.group_size, self.out_features, residual
            )
        return super().add_to(residual, x)

    def _prefill(self, x: torch.Tensor, scale_zeros: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] -> float32 [M, out]: dequantized tiles, or torch's op (see the module);
        `scale_zeros` default: this weight's."""
        sz = self.scale_zeros if scale_zeros is None else scale_zeros
        dtype = torch.bfloat16 if self._kernel is None else matmul_dtype()
        xd = x.to(dtype)
        if self._in_padded != self.in_features:
            xd = F.pad(xd, (0, self._in_padded - self.in_features))
        xd = xd.contiguous()
        tiled = not xd.is_cuda and (
            self._kernel is not None or (x.shape[0] > PREFILL_MIN_ROWS and prefill_tiles())
        )
        y = self._tiled(xd, sz) if tiled else self._op(xd, self.packed, sz)
        return y[:, : self.out_features] if self._out_padded != self.out_features else y

    def _op(self, x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
        """x bfloat16 [M, in_padded] -> float32 [M, rows of packed] through torch's int4 op."""
        if packed.is_cuda:
            return matmul_cuda(x, packed, self.group_size, scale_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, self.group_size, scale_zeros).float()

    def _tiled(self, x: torch.Tensor, scale_zeros: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in_padded] (bfloat16, or the matmul dtype with the kernel) -> float32 [M,
        out_padded]: TILE_ROWS output rows at a time dequantized to x's dtype from the packed
        layout and multiplied by torch's matmul; rows past the last full block of the op's layout
        (a partial block, packed apart) go through the op."""
        scale_zeros = self.scale_zeros if scale_zeros is None else scale_zeros
        block = self.layout[0]
        full = self._out_padded // block * block
        out = torch.empty(x.shape[0], self._out_padded)
        for r0 in range(0, full, TILE_ROWS):
            r1 = min(r0 + TILE_ROWS, full)
            out[:, r0:r1] = x @ self._dequantized_tile(r0, r1, x.dtype, scale_zeros)
        if full < self._out_padded:
            tail = self.packed.view(-1)[full * self._in_padded // 2 :].view(self._out_padded - full, -1)
            out[:, full:] = self._op(x, tail, scale_zeros[:, full:].contiguous())
        return out

    def _dequantized_tile(
        self, r0: int, r1: int, dtype: torch.dtype = torch.bfloat16, scale_zeros: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W~^T [in_padded, r1 - r0] in `dtype` for output rows r0..r1 (whole blocks of the
        layout): q - 8 unpacked as signed nibbles, then scale * (q - 8) + zero per group."""
        block, low, high = self.layout
        k, n = self._in_padded, r1 - r0
        raw = self.packed.view(-1)[r0 * k // 2 : r1 * k // 2].view(n // block, k, block // 2)
        flipped = raw ^ 0x88  # each nibble q ^ 8: q - 8 as a signed 4-bit number
        tile = torch.empty(k, n // block, block, dtype=dtype)
        rows = tile.permute(1, 0, 2)  # [blocks, in, block]: the layout's order
        _put(rows, low, (flipped << 4).view(torch.int8) >> 4)  # low nibbles, sign-extended
        _put(rows, high, flipped.view(torch.int8) >> 4)
        tile = tile.view(k // self.group_size, self.group_size, n)
        sz = (self.scale_zeros if scale_zeros is None else scale_zeros)[:, r0:r1]  # [groups, n, 2]
        torch.addcmul(sz[:, None, :, 1].to(dtype), tile, sz[:, None, :, 0].to(dtype), out=tile)
        return tile.view(k, n)

    def nibbles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(nibbles [out, in_padded / 2], scale, zero [out, groups]): the portable form a file
        stores, read back from the op's layout (on the CPU for a weight on a CUDA device)."""
        if self.packed.is_cuda:
            nibbles = portable_cuda(self.packed, self._out_padded, self._in_padded)[: self.out_features]
            sz = self.scale_zeros[:, : self.out_features].transpose(0, 1).cpu()  # [out, groups, 2]
            return nibbles, sz[..., 0].contiguous(), sz[..., 1].contiguous()
        nib, scale, zero = portable(self.packed, self.scale_zeros, self.out_features, self.layout)
        if self.scale_zeros_lo is not None and self.zero_t is not None:  # float32 scales: hi + lo
            rest = self.scale_zeros_lo[:, : self.out_features, 0].t().float()  # [out, groups]
            scale, zero = scale.float() + rest, self.zero_t.t().contiguous()
        return nib, scale, zero

    def dequantize(self) -> torch.Tensor:
        nib, scale, zero = self.nibbles()
        w = dequantize_int4(unpack_nibbles(nib), scale, zero)[:, : self.in_features]
        return w.to(self.packed.device)

    @property
    def kernel(self) -> str:
        """What runs decode: latentkv's kernel and its vector path, or torch's op."""
        if self.packed.is_cuda:
            return "_weight_int4pack_mm (CUDA)"
        return f"latentkv {self._kernel.name}" if self._kernel is not None else "_weight_int4pack_mm_for_cpu"

    @property
    def nbytes(self) -> int:
        n = self.packed.numel() * self.packed.element_size() + self.scale_zeros.numel() * 2
        if self.scale_zeros_lo is not None and self.zero_t is not None:
            n += self.scale_zeros_lo.numel() * 2 + self.zero_t.numel() * 4
        return n if self._bias is None else n + self._bias.numel() * 4


def pad_columns(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [out, in] with zero columns appended up to a multiple of group_size."""
    extra = _padded(w.shape[1], group_size) - w.shape[1]
    return F.pad(w, (0, extra)) if extra else w


def unpack_op_layout(packed: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor:
    """The op's packed layout -> q uint8 [out, in], whatever layout this CPU's build uses (see
    `_op_positions`)."""
    q = torch.empty(out_f * in_f, dtype=torch.uint8)
    q[_op_positions(out_f, in_f)] = _nibbles_flat(packed)
    return q.view(out_f, in_f)


@functools.lru_cache(maxsize=16)
def _op_positions(out_f: int, in_f: int) -> torch.Tensor:
    """For each nibble of the op's packed layout, the flat index (o * in + i) of the weight it
    holds: found by packing probes whose values are the hex digits of each element's index.
    Cached per shape (a model has a handful); the packed data itself is never re-probed."""
    n = out_f * in_f
    where = torch.zeros(n, dtype=torch.int64)
    index = torch.arange(n, dtype=torch.int64)
    for digit in range(max(1, -(-(n - 1).bit_length() // 4))):
        probe = ((index >> (4 * digit)) & 15).to(torch.int32).view(out_f, in_f)
        landed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        where |= _nibbles_flat(landed).to(torch.int64) << (4 * digit)
    return where


def pack(nibbles: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """Portable nibbles uint8 [N, K / 2] (`pack_nibbles`: value 2m low, 2m + 1 high) -> packed in
    `layout`, moved there with whole-tensor byte ops, never unpacked; `layout` None (or rows not
    in whole blocks of it): the bytes the op's own `_convert_weight_to_int4pack_for_cpu` makes.
    (The op's conversion, through int32 codes, took ~170 ms for a 4096 x 6144 matrix; this ~35.)"""
    if layout is None or nibbles.shape[0] % layout[0]:
        codes = unpack_nibbles(nibbles).to(torch.int32)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return pack_with(nibbles, layout)


def pack_for_op(nibbles: torch.Tensor) -> torch.Tensor:
    """Portable nibbles -> the op's packed layout on this CPU (`op_layout`)."""
    return pack(nibbles, op_layout())


def pack_with(nibbles: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Portable nibbles [N, K / 2] -> the packed layout `layout` (see `op_layout`) describes;
    N a multiple of its block."""
    block, low, high = layout
    n, half_k = nibbles.shape
    rows = nibbles.view(n // block, block, half_k)
    a, b = rows[:, low, :], rows[:, high, :]  # [blocks, block / 2, K / 2]: the low / high rows
    even = (a & 0x0F) | (b << 4)  # value 2m of each: a's in the low nibble, b's in the high one
    odd = (a >> 4) | (b & 0xF0)  # value 2m + 1
    pairs = torch.stack([even, odd], dim=-1).view(n // block, block // 2, 2 * half_k)
    return pairs.transpose(1, 2).contiguous().view(n, half_k)


def unpack_with(packed: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The inverse of `pack_with`: a packed layout -> portable nibbles [N, K / 2]."""
    block, low, high = layout
    n, half_k = packed.shape
    pairs = packed.reshape(n // block, 2 * half_k, block // 2).transpose(1, 2)
    pairs = pairs.reshape(n // block, block // 2, half_k, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rows = torch.empty(n // block, block, half_k, dtype=torch.uint8, device=packed.device)
    rows[:, low, :] = (even & 0x0F) | (odd << 4)
    rows[:, high, :] = (even >> 4) | (odd & 0xF0)
    return rows.view(n, half_k)


def to_cuda_layout(packed: torch.Tensor, stored: Layout, convert=pack_cuda) -> torch.Tensor:
    """Codes packed in a CPU layout (`stored`; uint8 [N, K / 2], on the device) rewritten in
    place in the layout `convert` makes of portable nibbles (the CUDA op's: int32, N K / 8 of
    them, the same bytes); -> that int32 view of `packed`'s memory. The portable nibbles and the
    converted codes are temporaries on the device, one weight each."""
    converted = convert(unpack_with(packed, stored))
    if converted.numel() * converted.element_size() != packed.numel():
        raise ValueError(
            f"int4 codes {tuple(packed.shape)} convert to {tuple(converted.shape)}: not in place"
        )
    target = packed.view(-1).view(converted.dtype).view(converted.shape)
    target.copy_(converted)
    return target


def portable(
    packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, layout: Layout | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight in a packed layout (`packed` [out_padded, in_padded / 2], `scale_zeros` [groups,
    out_padded, 2]) -> its portable (nibbles [out, in_padded / 2], scale, zero [out, groups]).
    `layout` None (or rows not in whole blocks of it): this CPU's op layout, found by probing."""
    n, half_k = packed.shape
    if layout is not None and n % layout[0] == 0:
        nibbles = unpack_with(packed, layout)[:out_features]
    else:
        nibbles = pack_nibbles(unpack_op_layout(packed, n, 2 * half_k)[:out_features])
    sz = scale_zeros[:, :out_features].transpose(0, 1)  # [out, groups, 2]
    return nibbles, sz[..., 0].contiguous(), sz[..., 1].contiguous()


def layout_spec(layout: Layout) -> dict:
    """A packed layout as JSON (what an expert store records beside the bytes it packed)."""
    block, low, high = layout
    return {"block": block, "low": _row_list(low, block), "high": _row_list(high, block)}


def layout_from_spec(spec: dict) -> Layout:
    """`layout_spec`'s inverse; ValueError for a spec that does not describe a layout."""
    try:
        block, low, high = int(spec["block"]), list(spec["low"]), list(spec["high"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"not an int4 packed layout: {spec!r}") from None
    if block <= 0 or block % 2 or sorted(low + high) != list(range(block)) or len(low) != len(high):
        raise ValueError(f"not an int4 packed layout: {spec!r}")
    return block, _as_slice(torch.tensor(low)), _as_slice(torch.tensor(high))


def same_layout(a: Layout | None, b: Layout | None) -> bool:
    if a is None or b is None:
        return a is b
    return layout_spec(a) == layout_spec(b)


def _row_list(rows: Rows, block: int) -> list[int]:
    return list(range(block))[rows] if isinstance(rows, slice) else [int(r) for r in rows]


def _nibbles_flat(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten()


def prefill_tiles() -> bool:
    """Whether int4 prefill runs dequantized tiles on this CPU: always with latentkv's kernel
    (in the matmul dtype); on the op's layout where bfloat16 matmuls are native (elsewhere
    unmeasured: the op stays) and the layout is understood."""
    if native.kernels() is not None:
        return True
    return matmul_dtype() == torch.bfloat16 and op_layout() is not None


# The layout latentkv's kernel reads (native/decode.cpp): blocks of 64 output rows, row
# j of a block in the low nibbles and row 32 + j in the high ones.
KERNEL_LAYOUT: Layout = (64, slice(0, 32), slice(32, 64))


def layout() -> Layout | None:
    """The packed layout int4 matrices take in this process: the kernel's where latentkv's
    kernels are loaded, else the op's (None: the op's, where it is not understood)."""
    return KERNEL_LAYOUT if native.kernels() is not None else op_layout()


def row_multiple() -> int:
    """Output rows are padded to a multiple of this: the kernel's block, else the op's 16."""
    return KERNEL_LAYOUT[0] if native.kernels() is not None else OUT_MULTIPLE


@functools.cache
def op_layout() -> Layout | None:
    """How this CPU's op layout holds a full block of output rows, for the tile path: (block,
    low, high) such that, for a block starting at row b, the bytes of its K columns viewed
    [K, block / 2] hold at [k, j] W[b + low[j], k] in the low nibble and W[b + high[j], k] in the
    high one (low, high: a slice of 0..block when consecutive, else an index tensor). Found by
    packing probes (`_op_positions`) and checked on two shapes; None where the layout is not of
    that form (int4 prefill then stays on the op)."""
    found = None
    for in_f in (64, 128):
        layout = _probe_layout(256, in_f)
        if layout is None or (found is not None and not same_layout(layout, found)):
            return None
        found = layout
    return found


def _probe_layout(out_f: int, in_f: int) -> Layout | None:
    where = _op_positions(out_f, in_f)
    rows, cols = where // in_f, where % in_f
    block = int((cols != 0).nonzero()[0]) if bool((cols != 0).any()) else out_f
    if block % 2 or out_f % block or TILE_ROWS % block:
        return None
    perm = rows[:block]
    j = torch.arange(where.numel())
    within = j % (block * in_f)
    blocked = torch.equal(cols, within // block)
    if not (blocked and torch.equal(rows, j // (block * in_f) * block + perm[within % block])):
        return None
    return block, _as_slice(perm[0::2]), _as_slice(perm[1::2])


def _put(rows: torch.Tensor, where: Rows, values: torch.Tensor) -> None:
    """rows[..., where] = values (an index tensor needs values in rows' dtype)."""
    rows[..., where] = values if isinstance(where, slice) else values.to(rows.dtype)


def _as_slice(rows: torch.Tensor) -> Rows:
    """rows as a slice when they are consecutive ascending (a fast strided copy), else as is."""
    start = int(rows[0])
    consecutive = torch.equal(rows, torch.arange(start, start + rows.numel()))
    return slice(start, start + rows.numel()) if consecutive else rows
