"""The multi-token-prediction (MTP) layer: the model's own draft head for speculative decoding.

DeepSeek-V3 and GLM-5 checkpoints ship it as layer `num_hidden_layers` (DeepSeek-V3's layout;
tools/train_fixture.py trains builtin:fixture's the same way). At position i it reads the main
model's hidden state h_i (the input of the lm_head: after the final norm, as the fixture was
trained) and the embedding of the token at i+1, and predicts the token at i+2:

    m_i    = eh_proj([enorm(embed(x_{i+1})) | hnorm(h_i)])       # [S, 2D] -> [S, D]
    m'_i   = Block(m_i)      one decoder layer, its own latent rows at positions i (RoPE at i)
    h'_i   = shared_head.norm(m'_i)
    logits = lm_head(h'_i)   the main model's (shared) head and embedding

Chained drafting feeds h'_i back as the next position's hidden state (the MTP layer's own
estimate of what the main model will say there).

The layer's cache is one more single-layer cache in the sequence's tier (`make_cache`), so
every KV tier works; its rows may start at any position (a resumed conversation starts the
MTP cache where drafting starts): `forward` takes the position explicitly for RoPE, and
attention is causal within the rows the cache holds.

With experts streamed from disk (`--ram-gb`) the layer's routed experts live in the same expert
store as the main layers', keyed by its checkpoint index `num_hidden_layers` (`routed_layer`), and
compete for the same cache.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import torch

from latentkv.config import ModelConfig
from latentkv.kv.cache import CacheLayout, KVTier, SequenceCache
from latentkv.models import batch as batches
from latentkv.models.layers import RMSNorm, Rope
from latentkv.weights.base import Linear


def checkpoint_prefix(cfg: ModelConfig) -> str:
    """The (first) MTP layer's tensor names start here: layer `num_hidden_layers`."""
    return f"model.layers.{cfg.num_layers}."


def routed_layer(cfg: ModelConfig, names: Container[str]) -> int | None:
    """The layer index the MTP layer's routed experts go by (its checkpoint index, which the
    expert store keys them by) when the config declares an MTP layer and the checkpoint (`names`)
    holds it with a MoE MLP; else None."""
    p = checkpoint_prefix(cfg)
    if cfg.num_mtp_layers >= 1 and p + "eh_proj.weight" in names and p + "mlp.gate.weight" in names:
        return cfg.num_layers
    return None


@dataclass
class MTPLayer:
    cfg: ModelConfig  # the main config restricted to this one layer (its MLP and indexer kind)
    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Linear  # [D, 2D]: [embedding | hidden] -> D
    block: object  # latentkv.models.model.Block (not imported: model.py imports this module)
    head_norm: RMSNorm  # shared_head.norm
    _tiers: dict[KVTier, KVTier] = field(default_factory=dict, init=False, repr=False)  # main -> draft

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout.for_model(self.cfg, self.enorm.weight.device)

    def make_cache(self, tier: KVTier) -> SequenceCache:
        """The draft layer's own latent rows (and DSA indexer keys), stored as the main model's
        caches of `tier` are (the same codecs and recent window)."""
        if tier not in self._tiers:  # one draft tier per main tier, made once
            self._tiers[tier] = tier.for_layout(self.layout)
        return self._tiers[tier].make_cache()

    def cache_like(self, cache: SequenceCache) -> SequenceCache:
        """An empty draft cache stored as `cache` is."""
        return self.make_cache(cache.tier)

    @torch.inference_mode()
    def forward(
        self,
        embed: torch.Tensor,
        lm_head: Linear,
        rope: Rope,
        next_tokens: torch.Tensor,
        hidden: torch.Tensor,
        cache: SequenceCache,
        position: int,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """S positions from `position` on: next_tokens [S] (the token after each position),
        hidden [S, D] (the main model's h there) -> (logits [S, vocab] for the token after next,
        h' [S, D] to chain from; with `last_only` the last position's, [1, vocab] and [1, D]:
        drafting reads no other, and the lm_head is a large part of this one-layer pass). The
        cache gains S rows."""
        e = embed.index_select(0, next_tokens).float()  # [S, D]
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.float())], dim=-1))
        batch = batches.one_sequence(rope, next_tokens, cache, position, speculative=True)
        x, _ = self.block(x, batch, 0, None)
        batch.commit()
        h = self.head_norm(x[-1:] if last_only else x)
        return lm_head(h), h

    @torch.inference_mode()
    def forward_batch(
        self,
        embed: torch.Tensor,
        lm_head: Linear,
        rope: Rope,
        next_tokens: list[torch.Tensor],
        hidden: list[torch.Tensor],
        caches: list[SequenceCache],
        positions: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for B sequences in one pass (segment b: next_tokens[b] [S_b], hidden[b]
        [S_b, D] from positions[b] on) -> (logits [B, vocab], h' [B, D]) of each segment's last
        position. Cache b gains S_b rows."""
        e = embed.index_select(0, torch.cat(next_tokens)).float()  # [N, D]
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(torch.cat(hidden).float())], dim=-1))
        batch = batches.prefill(rope, next_tokens, caches, positions, speculative=True)
        x, _ = self.block(x, batch, 0, None)
        batch.commit()
        h = self.head_norm(x.index_select(0, batch.last_rows))
        return lm_head(h), h
