"""The MLA + MoE decoder shared by GLM-5, DeepSeek-V3(.2), Kimi-K2 and GLM-4.7-Flash.

A forward pass takes the new tokens of one sequence and its cache, appends their latent rows,
and returns logits. Prefill is one pass over the whole prompt; decode is one pass per token
over the same cache. The family differences live in the config (whether a DSA indexer
exists, how it applies RoPE); the model declares its cache with `make_cache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv.cache import CacheLayout, LatentCache, PackedLatentCache, make_cache
from latentkv.kv.slots import SlotPool
from latentkv.models.batch import decode_batch
from latentkv.models.compiled import CompiledDecode, check_compilable
from latentkv.models.indexer import Indexer
from latentkv.models.layers import RMSNorm, Rope, RotaryTables, SwiGLU, linear
from latentkv.models.mla import MLA
from latentkv.models.moe import MoE
from latentkv.models.mtp import MTPLayer
from latentkv.models.prefill import prefill_batch


@dataclass
class Block:
    attn_norm: RMSNorm
    w_in: torch.Tensor  # [W_DQ (or W_Q); W_DKV; indexer W_k] fused: one matmul for all of x's projections
    b_in: torch.Tensor | None
    split: tuple[int, ...]  # widths of the fused projection's parts
    attn: MLA
    indexer: Indexer | None  # present on DSA "full" layers
    mlp_norm: RMSNorm
    mlp: SwiGLU | MoE

    def __call__(
        self,
        x: torch.Tensor,
        cache: LatentCache | PackedLatentCache,
        layer: int,
        rope: RotaryTables,
        selected: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder layer over the S new tokens x [S, D]; returns x and the DSA selection."""
        h = self.attn_norm(x)
        parts = linear(h, self.w_in, self.b_in).split(self.split, dim=-1)
        query, rows, q_resid = self.attn.project(parts[0], parts[1], rope)
        all_rows = cache.append(layer, rows)
        if self.indexer is not None:
            keys = cache.append_index_keys(layer, self.indexer.keys(parts[2], rope))
            selected = self.indexer.select(h, q_resid, rope, keys, cache.length)
        x = self.attn.attend(query, all_rows, cache.length, selected, residual=x)
        x = self.mlp(self.mlp_norm(x), residual=x)
        return x, selected


class Model:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        blocks: list[Block],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        mtp: MTPLayer | None = None,
    ):
        self.cfg = cfg
        self.embed = embed  # [vocab, D]
        self.blocks = blocks
        self.norm = norm
        self.lm_head = lm_head  # [vocab, D]
        self.mtp = mtp  # the multi-token-prediction draft layer, when the checkpoint ships one
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim)
        self.layout = CacheLayout.for_model(cfg)
        self.compiled: CompiledDecode | None = None

    def compile_decode(self, cache: CacheConfig | None = None, progress: bool = True) -> float:
        """Decode one token per step through torch.compile from now on (see
        `latentkv.models.compiled`); compiles and warms up now, for caches of config `cache`
        (call again for each other tier in use). Returns the seconds compiling took."""
        if self.compiled is None:
            self.compiled = CompiledDecode(self, cache)
        else:
            check_compilable(cache)
        return self.compiled.warm_up(lambda: self.make_cache(cache), progress)

    def make_cache(self, cache: CacheConfig | None = None) -> LatentCache | PackedLatentCache:
        """The cache one sequence needs: latent rows per layer (in the configured tier, f32 by
        default), plus indexer keys for DSA models."""
        return make_cache(self.layout, cache)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: LatentCache | PackedLatentCache,
        all_logits: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [S] (int64) continuing `cache` -> logits [S, vocab] (or [1, vocab] for the last).

        The cache gains S rows per layer. Positions continue from `cache.length`. With `hidden`,
        returns (logits, h) where h [S, D] is every position's lm_head input (after the final
        norm): what the MTP draft layer reads (`latentkv.models.mtp`).
        """
        if self.compiled is not None and tokens.shape[0] == 1 and not hidden:
            return self.compiled(tokens, cache, all_logits)
        return self._forward(tokens, cache, all_logits, hidden)

    def _forward(
        self,
        tokens: torch.Tensor,
        cache: LatentCache | PackedLatentCache,
        all_logits: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        S = tokens.shape[0]
        start = cache.length
        if start + S > self.cfg.max_position_embeddings:
            raise ValueError(
                f"context of {start + S} tokens exceeds the model's maximum of "
                f"{self.cfg.max_position_embeddings}"
            )
        rope = self.rope.tables(start, S)
        x = self.embed.index_select(0, tokens).float()  # [S, D]; activations stay float32
        selected = None
        for i, block in enumerate(self.blocks):
            x, selected = block(x, cache, i, rope, selected)
        cache.commit(S)
        if hidden:
            h = self.norm(x)  # [S, D]
            return linear(h if all_logits or S == 1 else h[-1:], self.lm_head), h
        if not all_logits and S > 1:
            x = x[-1:]
        return linear(self.norm(x), self.lm_head)

    @torch.inference_mode()
    def draft(
        self,
        next_tokens: torch.Tensor,
        hidden: torch.Tensor,
        cache: LatentCache | PackedLatentCache,
        position: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer at positions position.. (see `MTPLayer.forward`): -> (logits [S, vocab]
        for the token after next, h' [S, D]). `cache` is `make_draft_cache`'s."""
        if self.mtp is None:
            raise ValueError("this model has no MTP (multi-token prediction) layer")
        return self.mtp.forward(self.embed, self.lm_head, self.rope, next_tokens, hidden, cache, position)

    def make_draft_cache(self, cache: CacheConfig | None = None) -> LatentCache | PackedLatentCache:
        """The MTP layer's own cache, in the same tier as the main one."""
        if self.mtp is None:
            raise ValueError("this model has no MTP (multi-token prediction) layer")
        return self.mtp.make_cache(cache)

    @torch.inference_mode()
    def decode_batch(
        self,
        tokens: torch.Tensor,
        caches: Sequence[LatentCache | PackedLatentCache],
        pool: SlotPool | None = None,
    ) -> torch.Tensor:
        """One decode step of B independent sequences: tokens [B] (int64), one cache each (ragged
        lengths, any tier) -> logits [B, vocab]; every cache gains one row.

        Dense work runs batched over the B rows; attention reads each sequence's own cache. A
        sequence's logits equal `forward(token[None], cache)`'s up to float32 rounding (not bit
        for bit: see `latentkv.models.batch` for what is and is not guaranteed). With `pool`,
        the float32 caches placed in it are written and read there in one op per layer.
        """
        return decode_batch(self, tokens, caches, pool)

    @torch.inference_mode()
    def prefill_batch(
        self, prompts: Sequence[torch.Tensor], caches: Sequence[LatentCache | PackedLatentCache]
    ) -> torch.Tensor:
        """Prefill B sequences in one pass: one int64 prompt [S_b] per cache (any tier, any
        length so far) -> logits [B, vocab] of each prompt's last token (see
        `latentkv.models.prefill`: `forward`'s logits up to float32 rounding)."""
        return prefill_batch(self, prompts, caches)

    def num_parameters(self) -> int:
        """Weights held by the model (the RoPE tables are derived, not counted)."""
        seen: set[int] = set()
        total = 0
        for t in _tensors([self.embed, self.blocks, self.norm, self.lm_head, self.mtp]):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel()
        return total


def _tensors(obj, depth: int = 0):
    """Every tensor reachable from the model's plain-object tree (for counting parameters);
    private attributes hold derived tensors (e.g. RMSNorm's doubled scale) and are skipped."""
    if depth > 12:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if not name.startswith("_"):
                yield from _tensors(value, depth + 1)
