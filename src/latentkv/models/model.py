"""The MLA + MoE decoder shared by GLM-5, DeepSeek-V3(.2), Kimi-K2 and GLM-4.7-Flash.

A forward pass takes the new tokens of one sequence and its cache, appends their latent rows,
and returns logits. Prefill is one pass over the whole prompt; decode is one pass per token
over the same cache. The family differences live in the config (whether a DSA indexer
exists, how it applies RoPE); the model declares its cache with `make_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latentkv.config import ModelConfig
from latentkv.kv.cache import CacheLayout, LatentCache
from latentkv.models.indexer import Indexer
from latentkv.models.layers import Rope, SwiGLU, linear, rms_norm, softmax_scale
from latentkv.models.mla import MLA
from latentkv.models.moe import MoE


@dataclass
class Block:
    attn_norm: torch.Tensor
    attn: MLA
    indexer: Indexer | None  # present on DSA "full" layers
    mlp_norm: torch.Tensor
    mlp: SwiGLU | MoE


class Model:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        blocks: list[Block],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        self.cfg = cfg
        self.embed = embed  # [vocab, D]
        self.blocks = blocks
        self.norm = norm
        self.lm_head = lm_head  # [vocab, D]
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim)
        self.scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
        self.layout = CacheLayout.for_model(cfg)

    def make_cache(self) -> LatentCache:
        """The cache one sequence needs: latent rows per layer, plus indexer keys for DSA models."""
        return LatentCache(self.layout)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: LatentCache, all_logits: bool = False) -> torch.Tensor:
        """tokens [S] (int64) continuing `cache` -> logits [S, vocab] (or [1, vocab] for the last).

        The cache gains S rows per layer. Positions continue from `cache.length`.
        """
        S = tokens.shape[0]
        start = cache.length
        if start + S > self.cfg.max_position_embeddings:
            raise ValueError(
                f"context of {start + S} tokens exceeds the model's maximum of "
                f"{self.cfg.max_position_embeddings}"
            )
        positions = torch.arange(start, start + S)
        cos, sin = self.rope.tables(positions)
        x = self.embed.index_select(0, tokens).float()  # [S, D]; activations stay float32
        selected = None
        for i, block in enumerate(self.blocks):
            h = rms_norm(x, block.attn_norm, self.cfg.rms_norm_eps)
            query, rows, q_resid = block.attn.project(h, cos, sin)
            all_rows = cache.append(i, rows.float())
            if block.indexer is not None:
                keys = cache.append_index_keys(i, block.indexer.keys(h, cos, sin))
                selected = block.indexer.select(h, q_resid, cos, sin, keys, start)
            attn = block.attn.attend(query, all_rows, start, selected)
            x = x + attn
            x = x + block.mlp(rms_norm(x, block.mlp_norm, self.cfg.rms_norm_eps))
        cache.commit(S)
        if not all_logits:
            x = x[-1:]
        return linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    def num_parameters(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in _tensors(self):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel()
        return total


def _tensors(obj, depth: int = 0):
    """Every tensor reachable from the model's plain-object tree (for counting parameters)."""
    if depth > 12:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            yield from _tensors(value, depth + 1)
