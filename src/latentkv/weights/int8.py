"""int8 weights (`--weight-dtype int8`): symmetric, per output channel or per group of columns.

    scale[o] = max_i |W[o, i]| / 127            float32 [out]
    q[o, i]  = round(W[o, i] / scale[o])         int8 in [-127, 127]
    W~[o, i] = q[o, i] * scale[o]                the matrix this format computes with

The scale is stored in bfloat16 (rounded up, so no weight clips): torch's op takes the scale
in the activations' dtype, and its bfloat16 path is the fast one (docs/weights.md).

Decode (a few rows) is bandwidth-bound, so a quarter of the bytes is the point. It runs latentkv's
own kernel (`latentkv/native`: float32 activations, or int16 ones on AVX-512 VNNI, streaming q
once, the residual add folded in) where it builds, else torch's `_weight_int8pack_mm` on bfloat16
activations (x @ q^T * scale). Codes on a CUDA device decode through a Triton dequantizing kernel
(`weights/int8_triton.py`: torch's op has no CUDA kernel) and prefill through the tiles below.
Prefill (many rows) is compute-bound, and there the op is several times slower than a
dequantized tile: the scale is per output row so it factors out, `x @ W~^T = (x @ q^T) * scale`,
and q is exact in bfloat16, so a tile of q cast to the CPU's matmul dtype feeds one `F.linear`
and the scale multiplies the product.

Grouped (`group_size` G in 16, 32, 64, 128, 256: one scale per G consecutive input columns of a
row, what GGUF's Q8_0 (G = 32) and Q6_K (G = 16, 6-bit codes) store):

    scale[o, g] = max_{i in g} |W[o, i]| / 127   float32 [out, in / G]
    W~[o, i]    = q[o, i] * scale[o, i // G]

The scales stay float32 so a GGUF block's scale (an f16, or an f16 times a 6- or 8-bit integer)
is held exactly. torch has no grouped int8 kernel: every product runs on float32 tiles of
TILE_ROWS output rows dequantized on the fly (exact: q * scale has at most 25 significant bits
for GGUF's scales, one rounding, as GGUF's own dequantization) and `F.linear`; that reads the
int8 once but costs a dequantization per product (docs/weights.md has the measured cost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latentkv import native
from latentkv.weights.base import Linear, register
from latentkv.weights.kernels import matmul_dtype

QMAX = 127
GROUP_SIZES = (16, 32, 64, 128, 256)
# torch 2.13's bfloat16 `_weight_int8pack_mm` reads past the end of x when in % 16 != 0 and
# there is more than one row (a segfault): such matrices get zero columns up to a multiple of 16.
IN_MULTIPLE = 16
# Products with more rows than this take the dequantized-tile path (docs/weights.md): with torch's
# op, and with latentkv's kernel (which stays ahead of the tiles up to ~32-48 rows of GLM-5's
# 6144 x 2048: `benchmarks/vs_llamacpp.py --kernels 6144 2048`).
PREFILL_MIN_ROWS = 16
KERNEL_MAX_ROWS = 32
# Output rows dequantized at a time on the tile path: bounds the temporary to TILE_ROWS x in.
TILE_ROWS = 1024


def bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x (positive float32) rounded to bfloat16, upwards: the smallest bfloat16 >= x."""
    b = x.to(torch.bfloat16)
    return torch.where(b.float() < x, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [out, in] -> (q int8 [out, in], scale bfloat16 [out]). An all-zero row gets
    scale 1 (its q is 0 either way)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = bf16_at_least(torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)))
    q = torch.round(w / scale.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_int8_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [out, in] (in % group_size == 0) -> (q int8 [out, in], scale float32 [out, in / G]).
    An all-zero group gets scale 1."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group_size, group_size)
    amax = wg.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wg / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(out_f, in_f), scale


@register
class Int8Linear(Linear):
    format = "int8"
    table_dtype = torch.bfloat16  # a gather reads one row per token: 16 bits suffice there
    compile_needs_native = True
    pieces = ("q", "scale")  # the portable state a file stores (`quantize_state`, `from_state`)
    scale_pieces = ("scale",)  # the pieces a factor multiplies: W~ * c (`scaled_state`)

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *, keep: bool = False
    ):
        """q int8 [out, in_padded]; scale bfloat16 [out] (per channel) or float32
        [out, in_padded / G] (grouped). `keep`: a contiguous q with nothing to pad is used as
        given, not copied (an expert over a buffer it shares: a read extent, a device slot)."""
        if q.dim() != 2 or q.dtype != torch.int8:
            raise ValueError(f"int8 weight must be int8 [out, in], got {q.dtype} {tuple(q.shape)}")
        grouped = scale.dim() == 2
        if grouped:
            groups = scale.shape[1]
            ok = scale.dtype == torch.float32 and scale.shape[0] == q.shape[0] and groups > 0
            if not ok or q.shape[1] % groups or q.shape[1] // groups not in GROUP_SIZES:
                raise ValueError(
                    f"grouped int8 needs float32 scales [out, in / G] with G in {GROUP_SIZES}; got "
                    f"{scale.dtype} {tuple(scale.shape)} for weight {tuple(q.shape)}"
                )
        elif scale.shape != (q.shape[0],) or scale.dtype != torch.bfloat16:
            raise ValueError(
                f"int8 scale must be bfloat16 [{q.shape[0]}], got {scale.dtype} {tuple(scale.shape)}"
            )
        self.group_size = q.shape[1] // scale.shape[1] if grouped else None
        self.out_features, self.in_features = q.shape
        self._pad = 0 if grouped else -self.in_features % IN_MULTIPLE
        # [out, in + pad]: padded columns are 0
        self.q = q if keep and not self._pad and q.is_contiguous() else F.pad(q, (0, self._pad)).contiguous()
        self.scale = scale.contiguous()  # [out] bfloat16 (the op's), or [out, groups] float32
        self._scale_f32 = scale.float()  # for the tile path
        self._bias = None if bias is None else bias.float().contiguous()
        # None: torch's op (grouped: tiles); codes on a CUDA device: the Triton kernel (`int8_triton`)
        self._kernel = None if grouped or q.is_cuda else native.kernels()

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **params) -> Int8Linear:
        return cls.from_state(cls.quantize_state(w, **params), w.shape[1], bias)

    @staticmethod
    def quantize_state(w: torch.Tensor, group_size: int | None = None, **params) -> dict[str, torch.Tensor]:
        """The portable tensors of w float [out, in] in this format (what a file stores); every
        piece has the output rows first, so matrices fused by rows concatenate piece by piece.
        `group_size` None: one scale per output channel; else one per group of columns (the
        matrix padded with zero columns to a multiple of it)."""
        if params:
            raise ValueError(f"weight format int8 takes only group_size, got {sorted(params)}")
        if w.dim() != 2:
            raise ValueError(f"int8 needs a matrix [out, in], got shape {tuple(w.shape)}")
        if group_size is None:
            q, scale = quantize_int8(w)
        elif group_size not in GROUP_SIZES:
            raise ValueError(f"int8 group size must be one of {GROUP_SIZES}, got {group_size}")
        else:
            pad = -w.shape[1] % group_size
            q, scale = quantize_int8_groups(F.pad(w, (0, pad)) if pad else w, group_size)
        return {"q": q, "scale": scale}

    @classmethod
    def from_state(
        cls, state: dict[str, torch.Tensor], in_features: int, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        lin = cls(state["q"], state["scale"], bias)
        lin.in_features = in_features  # grouped: q may carry zero columns up to a multiple of G
        return lin

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = len(x.shape) == 2  # [M, in] already: no reshape and view around the product
        x2 = x if flat else x.reshape(-1, self.in_features)  # [M, in]
        if self.q.is_cuda and x2.shape[0] <= KERNEL_MAX_ROWS:
            from latentkv.weights import int8_triton

            y = int8_triton.int8_mm(x2, self.q, self._scale_f32, self.in_features, self.group_size)
        elif self.group_size is not None:
            y = self._tiled_groups(x2)
        elif self._kernel is not None and x2.shape[0] <= KERNEL_MAX_ROWS:
            y = self._kernel.int8_mm(_rows(x2), self.q, self.scale)
        elif x2.shape[0] > PREFILL_MIN_ROWS:
            y = self._tiled(x2)
        else:
            xb = x2.to(torch.bfloat16)
            xb = F.pad(xb, (0, self._pad)) if self._pad else xb.contiguous()
            y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale).float()
        if self._bias is not None:
            y = y + self._bias
        return y if flat else y.view(*x.shape[:-1], self.out_features)

    def add_to(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        fused = self._kernel is not None and self._bias is None and residual is not None
        if fused and x.shape[0] <= KERNEL_MAX_ROWS and _fits(residual, x.shape[0], self.out_features):
            return self._kernel.int8_mm(_rows(x), self.q, self.scale, residual)
        return super().add_to(residual, x)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] float32 -> [M, out]: (x @ q_tile^T) * scale_tile, tile by tile of output rows."""
        dtype = matmul_dtype()
        xd = x.to(dtype)
        q = self.q[:, : self.in_features] if self._pad else self.q
        out = torch.empty(x.shape[0], self.out_features, device=x.device)
        for r0 in range(0, self.out_features, TILE_ROWS):
            r1 = min(r0 + TILE_ROWS, self.out_features)
            part = F.linear(xd, q[r0:r1].to(dtype))  # [M, r1-r0]
            torch.mul(part, self._scale_f32[r0:r1], out=out[:, r0:r1])
        return out

    def _tiled_groups(self, x: torch.Tensor) -> torch.Tensor:
        """Grouped: x [M, in] float32 -> [M, out] over float32 tiles q * scale, TILE_ROWS rows
        at a time (x padded with zero columns to the stored width)."""
        width = self.q.shape[1]
        xp = F.pad(x.float(), (0, width - self.in_features)) if width != self.in_features else x.float()
        out = torch.empty(x.shape[0], self.out_features, device=x.device)
        for r0 in range(0, self.out_features, TILE_ROWS):
            r1 = min(r0 + TILE_ROWS, self.out_features)
            out[:, r0:r1] = F.linear(xp, self._dequantized(r0, r1))
        return out

    def _dequantized(self, r0: int, r1: int) -> torch.Tensor:
        """Grouped: float32 [r1 - r0, in_stored], q * scale."""
        q = self.q[r0:r1].view(r1 - r0, -1, self.group_size)
        return (q.float() * self._scale_f32[r0:r1, :, None]).view(r1 - r0, -1)

    def dequantize(self) -> torch.Tensor:
        if self.group_size is not None:
            return self._dequantized(0, self.out_features)[:, : self.in_features]
        return self.q[:, : self.in_features].float() * self._scale_f32[:, None]

    @property
    def kernel(self) -> str:
        """What runs decode: latentkv's kernel and its vector path, or torch's op."""
        if self.q.is_cuda:
            return "latentkv triton (int8_triton)"
        if self.group_size is not None:
            return "float32 tiles (grouped)"
        return f"latentkv {self._kernel.name}" if self._kernel is not None else "_weight_int8pack_mm"

    @property
    def nbytes(self) -> int:
        n = self.q.numel() + self.scale.numel() * self.scale.element_size()
        return n if self._bias is None else n + self._bias.numel() * 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the native kernels take it: float32 with unit column stride."""
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _fits(residual: torch.Tensor, rows: int, out_features: int) -> bool:
    """Whether the kernels can add `residual` in place of a separate add: float32 [rows, out]."""
    return (
        residual.dtype == torch.float32
        and tuple(residual.shape) == (rows, out_features)
        and residual.stride(-1) == 1
    )
