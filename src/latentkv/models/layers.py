"""Small building blocks: RMSNorm, RoPE (interleaved and half-split, YaRN), SwiGLU MLP.

Every matmul goes through a weight object (`latentkv.weights.Linear`), never a raw tensor."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from latentkv.config import RopeConfig
from latentkv.experts.base import Expert


class RMSNorm:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32.

    Computed as a LayerNorm of [x, -x] (whose mean is exactly 0 and whose variance is
    mean(x^2)), keeping the first half: one fused kernel plus a concat, where the spelled-out
    form is seven dispatched ops. On small models decode is bound by per-op overhead, so this
    matters; the result agrees with the textbook formula to float32 rounding (tested).
    One row (decode) makes [x, -x] in one op, x [1, D] times [1, -1] as [2, 1, D]: the same
    2D values in the same order, so the same bits as the concat.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight  # [D]
        self.eps = eps
        self._doubled = torch.cat([weight, weight])  # [2D], the LayerNorm's scale
        d = weight.shape[0]
        self._pair = (2, 1, d)  # one row's [x, -x] as the LayerNorm sees it
        self._pair_scale = self._doubled.view(self._pair)
        self._signs = torch.tensor([1.0, -1.0], device=weight.device).view(2, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(x.shape) == 2 and x.shape[0] == 1:  # [1, D] * [2, 1, 1] -> [2, 1, D]: x, -x
            return F.layer_norm(x * self._signs, self._pair, self._pair_scale, None, self.eps)[0]
        d = x.shape[-1]
        both = torch.cat([x, x.neg()], dim=-1)  # [..., 2D]
        return F.layer_norm(both, (2 * d,), self._doubled, None, self.eps)[..., :d]


# A dense MLP is one always-on expert: down(silu(gate(x)) * up(x)), gate and up fused into one
# [2I, D] Linear (see `latentkv.experts.base.Expert`).
SwiGLU = Expert


# --- RoPE ---------------------------------------------------------------------------------


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for a `dim`-wide rotary slice and the cos/sin scale (YaRN's mscale)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta**exponents
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """1/sqrt(d), times YaRN's mscale^2 when the config asks for it (DeepSeek's convention)."""
    scale = qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class Rope:
    """cos/sin tables for one rotary width, grown on demand; positions index rows."""

    def __init__(self, rope: RopeConfig, dim: int, device: torch.device):
        inv_freq, self.attention_scaling = rope_inv_freq(rope, dim)
        self.inv_freq = inv_freq.to(device)
        self.dim = dim
        self._cos = torch.empty(0, dim // 2, device=device)
        self._sin = torch.empty(0, dim // 2, device=device)
        self._fixed: int | None = None  # the length `fix` set

    def _grow(self, n: int) -> None:
        self._tables(max(n, 2 * self._cos.shape[0], 256))

    def _tables(self, n: int) -> None:
        freqs = (
            torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)[:, None]
            * self.inv_freq[None, :]
        )  # [n, dim/2]
        self._cos = freqs.cos() * self.attention_scaling
        self._sin = freqs.sin() * self.attention_scaling

    def fix(self, n: int) -> None:
        """Tables for exactly positions 0..n-1 from now on (values as grown ones: each position's
        row depends on the position only), not marked dynamic: a compiled step's constants.
        A later `reserve` past n (an MTP draft past the model's last position) fixes them longer."""
        if self._fixed != n:
            self._tables(n)
            self._fixed = n

    def reserve(self, end: int) -> None:
        """Have the tables cover positions up to `end` (exclusive)."""
        if end > self._cos.shape[0]:
            if self._fixed is not None:
                self.fix(max(end, 2 * self._fixed))
                return
            self._grow(end)
            torch._dynamo.maybe_mark_dynamic(self._cos, 0)  # a compiled step reads any length
            torch._dynamo.maybe_mark_dynamic(self._sin, 0)

    def tables(self, start: int, n: int) -> RotaryTables:
        """The rotation for positions start..start+n-1, shared by every layer of one pass."""
        self.reserve(start + n)
        return RotaryTables(self._cos[start : start + n], self._sin[start : start + n])

    def at(self, positions: torch.Tensor) -> RotaryTables:
        """The rotation for any positions [S] (int64): a batch's tokens, each at its own place."""
        self.reserve(int(positions.max()) + 1)
        return RotaryTables(self._cos.index_select(0, positions), self._sin.index_select(0, positions))


# Up to this many positions a pass rotates with one small matmul per tensor (few ops, which
# is what decode is bound by); longer passes use the elementwise form (no [S, d, d] tables).
MATMUL_ROPE_MAX_POSITIONS = 16


class RotaryTables:
    """RoPE for the S positions of one forward pass: `rotate` applies it to [S, ..., width] tensors.

    Both layouts return the pair-split order [x_even' | x_odd'] (interleaved) or [x_lo' | x_hi']
    (half-split), exactly as transformers does, so cached rope keys match its layout.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [S, d/2]
        self.S, self.half = cos.shape
        self._mats: dict[tuple[bool, int, int], torch.Tensor] = {}
        self._values: torch.Tensor | None = None

    def rotate(self, x: torch.Tensor, interleaved: bool, offset: int = 0) -> torch.Tensor:
        """Rotate d = 2 * half values of x's last axis starting at `offset`; the values before
        and after them pass through (offset > 0 only for passes of at most
        MATMUL_ROPE_MAX_POSITIONS positions, e.g. decode's [c-part | rope-part] queries)."""
        width = x.shape[-1]
        if self.S <= MATMUL_ROPE_MAX_POSITIONS:
            m = self.matrix(interleaved, width, offset)  # [S, width, width]
            if len(x.shape) == 3 and x.shape[0] == self.S:  # [S, n, width]: no views needed
                return torch.matmul(x, m)
            if self.S == 1 and len(x.shape) == 2:  # [1, width] x [1, width, width]: matmul expands x
                return torch.matmul(x, m).view(x.shape)
            shape = x.shape
            return torch.matmul(x.reshape(self.S, -1, width), m).view(shape)
        if offset:
            raise ValueError(f"an offset rotation needs at most {MATMUL_ROPE_MAX_POSITIONS} positions")
        d = 2 * self.half
        cos = self.cos.view(self.S, *([1] * (x.dim() - 2)), self.half)
        sin = self.sin.view(self.S, *([1] * (x.dim() - 2)), self.half)
        rot = x[..., :d] if width > d else x
        x1, x2 = (
            (rot[..., 0::2], rot[..., 1::2])
            if interleaved
            else (rot[..., : self.half], rot[..., self.half :])
        )
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([out, x[..., d:]], dim=-1) if width > d else out

    def matrix(self, interleaved: bool, width: int, offset: int = 0) -> torch.Tensor:
        """Per position, the [width, width] matrix M with rotate(x) = x @ M (built once per pass;
        a fused decode weight may multiply it in)."""
        key = (interleaved, width, offset)
        if key not in self._mats:
            if self._values is None:  # out[i] = a c - b s ; out[i + h] = b c + a s
                self._values = torch.cat([self.cos, -self.sin, self.cos, self.sin], dim=1)  # [S, 4 half]
            rotated, base = _rotation_pattern(interleaved, self.half, width, offset, self.cos.device)
            if self.S > 1:
                base = base.expand(self.S, -1)
            # base holds the pass-through ones; out-of-place index_copy: one op per matrix
            m = base.index_copy(1, rotated, self._values)
            self._mats[key] = m.view(self.S, width, width)
        return self._mats[key]


# (interleaved, half, width, offset) -> _rotation_pattern's result. A plain dict rather than
# functools.cache, which torch.compile (`--compile`) traces through with a warning.
_PATTERNS: dict[tuple[bool, int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _rotation_pattern(
    interleaved: bool, half: int, width: int, offset: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat [width * width] indices of a rotation matrix's rotated entries, in the order
    cos | -sin | cos | sin as `RotaryTables.matrix` fills them; the matrix before they are filled,
    [1, width * width]: 1 at the pass-through entries, 0 elsewhere)."""
    key = (interleaved, half, width, offset, device)
    if key not in _PATTERNS:
        rotated, passed = _build_rotation_pattern(*key)
        base = torch.zeros(1, width * width, device=device)
        base[0, passed] = 1.0
        _PATTERNS[key] = rotated, base
    return _PATTERNS[key]


def _build_rotation_pattern(
    interleaved: bool, half: int, width: int, offset: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if offset + 2 * half > width:
        raise ValueError(f"cannot rotate {2 * half} values at offset {offset} of a {width}-wide axis")
    i = torch.arange(half, device=device)
    a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
    src = torch.cat([a, b, b, a]) + offset
    dst = torch.cat([i, i, i + half, i + half]) + offset
    j = torch.cat(
        [torch.arange(offset, device=device), torch.arange(offset + 2 * half, width, device=device)]
    )
    return src * width + dst, j * width + j
