"""Small building blocks: RMSNorm, RoPE (interleaved and half-split, YaRN), SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from latentkv.config import RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T in the weight's dtype; the result comes back in x's dtype."""
    if x.dtype != weight.dtype:
        return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    return F.linear(x, weight, bias)


class SwiGLU:
    """down(silu(gate(x)) * up(x)), with gate and up fused into one [2I, D] matrix."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up = gate_up  # [2I, D]
        self.down = down  # [D, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down)


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

    def __init__(self, rope: RopeConfig, dim: int):
        self.inv_freq, self.attention_scaling = rope_inv_freq(rope, dim)
        self.dim = dim
        self._cos = torch.empty(0, dim // 2)
        self._sin = torch.empty(0, dim // 2)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [n, dim/2]
        self._cos = freqs.cos() * self.attention_scaling
        self._sin = freqs.sin() * self.attention_scaling

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [S, dim/2] each."""
        top = int(positions.max()) + 1
        if top > self._cos.shape[0]:
            self._grow(top)
        return self._cos[positions], self._sin[positions]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x0, x1), (x2, x3), ...; the result is laid out as [evens | odds].

    The output order differs from the input's, identically for queries and keys, so every
    q . k is the interleaved rotary product (this is also what transformers computes).
    cos/sin: [S, dim/2], broadcast over any head axes between S and the last.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i+d/2}) pairs: the GPT-NeoX / Llama layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def broadcast_heads(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[S, d] -> [S, 1, ..., d] so it broadcasts against x = [S, ..., d]."""
    return table.view(table.shape[0], *([1] * (x.dim() - 2)), table.shape[1])
