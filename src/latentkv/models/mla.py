"""Multi-head Latent Attention (MLA), absorbed, over a latent cache.

Symbols (as in docs and DESIGN.md):
    H heads, Lkv kv_lora_rank, R qk_rope_head_dim, P qk_nope_head_dim, V v_head_dim, T cached tokens.

    c_t = RMSNorm(W_DKV x_t)[:Lkv]                latent row, cached         # [T, Lkv]
    r_t = RoPE(W_DKV x_t [Lkv:], pos_t)           shared rope key, cached    # [T, R]
    W_UK, W_UV = split(kv_b_proj) per head                                   # [H, P, Lkv], [H, V, Lkv]
    q = W_UQ RMSNorm(W_DQ x)  ->  q_nope [H, P], q_rope = RoPE(..) [H, R]
    q_abs[h] = W_UK[h]^T q_nope[h]                                           # [H, Lkv]
    s[h, t]  = (q_abs[h] . c_t + q_rope[h] . r_t) * scale
    o[h]     = W_UV[h] (sum_t softmax(s[h])_t c_t)                          # [H, V]
    out      = W_O concat_h o[h]

The cache row is [c | r], so the score is one product of [q_abs | q_rope] with the row.
Prefill uses the same absorbed form, tiled along the queries so the score block stays a few
MB however long the prompt. With DSA, a query attends only to the tokens its indexer chose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latentkv.attention import REFERENCE, AttentionBackend
from latentkv.config import ModelConfig
from latentkv.kv.cache import RowReader
from latentkv.models.layers import MATMUL_ROPE_MAX_POSITIONS, RMSNorm, RotaryTables
from latentkv.weights.base import Linear
from latentkv.weights.f32 import F32Linear
from latentkv.weights.heads import HeadLinears

# Budget for one score block [H, S_tile, T] in float32 elements (~32 MB).
SCORE_BLOCK_ELEMENTS = 8 * 1024 * 1024
# Decode (one token) multiplies the per-head products into plain float32 matrices when these stay
# this small: q_b then W_UK becomes one [H*(Lkv+R), q_lora] matrix, W_UV then o_proj one
# [D, H*Lkv]. A small model's decode step is bound by per-op overhead, not weight bytes; a big
# model's fused matrices would be larger than the factors (GLM-5's absorbed query: 268 MB).
FUSED_DECODE_MAX_BYTES = 4 * 1024 * 1024


@dataclass
class MLAWeights:
    q_a_norm: RMSNorm | None  # over q_lora  (None: no q-LoRA, the input projection gives q directly)
    q_b: Linear | None  # [H*(P+R), q_lora], rows pre-multiplied by the softmax scale
    kv_a_norm: RMSNorm  # over Lkv
    w_uk_t: HeadLinears  # [H, Lkv, P]: W_UK per head as a linear layer P -> Lkv
    w_uv: HeadLinears  # [H, V, Lkv]: W_UV per head as a linear layer Lkv -> V
    o: Linear  # [D, H*V] (with o_proj's bias, if any)


class MLA:
    """One layer's attention. `project` makes queries and cache rows; `context` reads the cache;
    `output` projects the context back to the model width.

    The input projections (W_DQ, W_DKV, and the indexer's W_k) are one fused matmul owned by
    the block; `project` receives their outputs. The softmax scale is folded into q_b.
    """

    def __init__(self, cfg: ModelConfig, w: MLAWeights):
        self.w = w
        self.H, self.P, self.R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.V, self.Lkv = cfg.v_head_dim, cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        self._q_fused = _absorbed_query(w, self.H, self.P) if w.q_b is not None else None
        self._o_fused = _fused_output(w) if w.o.bias is None else None

    def project(
        self, q_in: torch.Tensor, kv_in: torch.Tensor, rope: RotaryTables, decode: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(W_DQ x [S, q_lora] or q [S, H*(P+R)], W_DKV x [S, Lkv+R]) ->
        (query [H, S, Lkv+R], cache rows [S, Lkv+R], q_resid [S, q_lora] or None).

        `decode`: the S rows are one new token each of S sequences (batched decode), which takes
        the one-token path (the absorbed-query matrix) as a single token does."""
        w = self.w
        S = q_in.shape[0]
        if w.q_a_norm is not None:
            q_resid = w.q_a_norm(q_in)
            if (S == 1 or decode) and self._q_fused is not None and S <= MATMUL_ROPE_MAX_POSITIONS:
                return self._decode_query(q_resid, rope), self._rows(kv_in, rope), q_resid
            q = w.q_b(q_resid)
        else:
            q_resid, q = None, q_in
        q = q.view(S, self.H, self.P + self.R)
        q_abs = w.w_uk_t(q[..., : self.P].transpose(0, 1))  # [H, S, P] -> [H, S, Lkv]
        q_rope = rope.rotate(q[..., self.P :], self.interleaved)  # [S, H, R]
        query = torch.cat([q_abs, q_rope.transpose(0, 1)], dim=-1)  # [H, S, Lkv+R]
        return query, self._rows(kv_in, rope), q_resid

    def _rows(self, kv_in: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        """W_DKV x [S, Lkv+R] -> cache rows [c | r] [S, Lkv+R]."""
        c, r = kv_in.split((self.Lkv, self.R), dim=-1)
        return torch.cat([self.w.kv_a_norm(c), rope.rotate(r, self.interleaved)], dim=-1)

    def _decode_query(self, q_resid: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        """New tokens' queries through the absorbed matrix: q_resid [S, q_lora] -> [H, S, Lkv+R],
        the rope part rotated in place (one matmul for every head)."""
        S = q_resid.shape[0]
        q = self._q_fused(q_resid).view(S, self.H, self.Lkv + self.R)
        q = rope.rotate(q, self.interleaved, offset=self.Lkv)
        return q.view(self.H, 1, self.Lkv + self.R) if S == 1 else q.transpose(0, 1)

    def context(
        self,
        query: torch.Tensor,
        rows: RowReader,
        start: int,
        selected: torch.Tensor | None = None,
        backend: AttentionBackend = REFERENCE,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of S queries [H, S, Lkv+R] at positions start..start+S-1 over T cached rows
        -> the latent context [H, S, Lkv] (`output` projects it).

        `rows` reads the cache in whatever tier it is stored (see `latentkv.kv.cache`), through
        `backend` (`latentkv.attention`; the torch reference unless told otherwise).
        `selected` (DSA): for decode (S == 1) the [k] token indices to attend to; for S > 1 a
        boolean [S, T] mask of allowed tokens (causality is applied here in both cases).
        `positions`: start..start+S-1 as a tensor, when the caller made it once for every layer."""
        H, S, _ = query.shape
        device = query.device
        if S == 1:  # decode: one tile, no mask (DSA's choice is a row selection)
            if positions is None:
                positions = torch.arange(start, start + 1, device=device)
            if selected is not None:
                return backend.attend_selected(query, rows, selected, positions)
            return backend.attend(query, rows, None, positions)
        T = len(rows)
        tile = max(1, SCORE_BLOCK_ELEMENTS // max(1, H * T))
        parts = []
        for s0 in range(0, S, tile):
            s1 = min(S, s0 + tile)
            allowed = _allowed(start + s0, s1 - s0, T, selected, s0, device)  # [s, T]
            at = (  # a recent window reads these
                torch.arange(start + s0, start + s1, device=device) if positions is None else positions[s0:s1]
            )
            parts.append(backend.attend(query[:, s0:s1], rows, allowed, at))  # [H, s, Lkv]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def output(
        self, ctx: torch.Tensor, residual: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        """Latent context [H, S, Lkv] -> W_UV per head -> o_proj: [S, D] (plus `residual`).
        `decode` as in `project`: one token per sequence takes the fused output matrix."""
        H, S, _ = ctx.shape
        if (S == 1 or decode) and self._o_fused is not None:
            flat = ctx.view(1, H * self.Lkv) if S == 1 else ctx.transpose(0, 1).reshape(S, H * self.Lkv)
            return self._o_fused.add_to(residual, flat)
        heads = self.w.w_uv(ctx)  # [H, S, Lkv] -> [H, S, V]
        out = self.w.o(heads.transpose(0, 1).reshape(S, H * self.V))
        return out if residual is None else residual + out


def _absorbed_query(w: MLAWeights, H: int, P: int) -> Linear | None:
    """[H*(Lkv+R), q_lora] float32: per head, W_UK^T q_b's nope rows, then q_b's rope rows
    (None when larger than FUSED_DECODE_MAX_BYTES). Multiplied in float64 from the weights as
    their format reads them."""
    assert w.q_b is not None
    Lkv, q_lora = w.w_uk_t.heads[0].out_features, w.q_b.in_features
    R = w.q_b.out_features // H - P
    if H * (Lkv + R) * q_lora * 4 > FUSED_DECODE_MAX_BYTES:
        return None
    q_b = w.q_b.dequantize().double().view(H, P + R, q_lora)
    absorbed = torch.matmul(w.w_uk_t.dequantize().double(), q_b[:, :P])  # [H, Lkv, q_lora]
    return F32Linear(torch.cat([absorbed, q_b[:, P:]], dim=1).flatten(0, 1).float())


def _fused_output(w: MLAWeights) -> Linear | None:
    """[D, H*Lkv] float32: o_proj times W_UV per head (None when larger than
    FUSED_DECODE_MAX_BYTES). Multiplied in float64."""
    H = len(w.w_uv)
    V, Lkv = w.w_uv.heads[0].out_features, w.w_uv.heads[0].in_features
    D = w.o.out_features
    if D * H * Lkv * 4 > FUSED_DECODE_MAX_BYTES:
        return None
    o = w.o.dequantize().double().view(D, H, V)
    fused = torch.einsum("dhv,hvl->dhl", o, w.w_uv.dequantize().double()).reshape(D, H * Lkv).float()
    return F32Linear(fused)


def _allowed(
    q_start: int, n: int, T: int, selected: torch.Tensor | None, row0: int, device: torch.device
) -> torch.Tensor:
    """[n, T] mask for queries at positions q_start.. : causal, and DSA-selected if given."""
    positions = torch.arange(q_start, q_start + n, device=device)[:, None]
    mask = torch.arange(T, device=device)[None, :] <= positions
    if selected is not None:
        mask &= selected[row0 : row0 + n]
    return mask
