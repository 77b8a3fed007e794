"""The MLA + MoE decoder shared by GLM-5, DeepSeek-V3(.2), Kimi-K2 and GLM-4.7-Flash.

One forward implementation: `Model._run` takes a `Batch` (`latentkv.models.batch`: B ragged
segments, each sequence's new tokens continuing its cache), runs every `Block` over it, and
returns logits. The entry points only build the batch: `forward` (one sequence: a prompt's
prefill or one decode token), `decode_batch` (one token of each of B sequences) and
`prefill_batch` (B prompts); the compiled step (`latentkv.models.compiled`) traces `forward`'s
own code. The family differences live in the config (whether a DSA indexer exists, how it
applies RoPE); the model declares its cache with `make_cache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv.cache import CacheLayout, KVTier, SequenceCache, resolve_tier
from latentkv.kv.slots import SlotPool
from latentkv.models import batch as batches
from latentkv.models.batch import Batch, check_batch
from latentkv.models.compiled import DecodeStep, check_compilable, warm_step
from latentkv.models.indexer import Indexer
from latentkv.models.layers import RMSNorm, Rope, SwiGLU
from latentkv.models.mla import MLA
from latentkv.models.moe import MoE
from latentkv.models.mtp import MTPLayer
from latentkv.weights.base import Linear

Cache = SequenceCache


@dataclass
class Block:
    attn_norm: RMSNorm
    w_in: Linear  # [W_DQ (or W_Q); W_DKV; indexer W_k] fused: one matmul for all of x's projections
    split: tuple[int, ...]  # widths of the fused projection's parts
    attn: MLA
    indexer: Indexer | None  # present on DSA "full" layers
    mlp_norm: RMSNorm
    mlp: SwiGLU | MoE

    def __call__(self, x: torch.Tensor, batch: Batch, layer: int, selected):
        """One decoder layer over the batch's N new tokens x [N, D]; returns x and the DSA
        choice (in the batch's reads' own form), which the next layers without an indexer reuse."""
        h = self.attn_norm(x)
        parts = self.w_in(h).split(self.split, dim=-1)
        query, rows, q_resid = self.attn.project(parts[0], parts[1], batch.rope, decode=batch.fused)
        k_in = parts[2] if self.indexer is not None else None
        context, selected = batch.reads.attend(
            layer, self.attn, self.indexer, h, k_in, query, rows, q_resid, batch.rope, selected
        )
        x = self.attn.output(context, residual=x, decode=batch.fused)
        x = self.mlp(self.mlp_norm(x), residual=x, decode=batch.decode_rows)
        return x, selected


class Model:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        blocks: list[Block],
        norm: RMSNorm,
        lm_head: Linear,
        mtp: MTPLayer | None = None,
    ):
        self.cfg = cfg
        self.embed = embed  # [vocab, D]
        self.blocks = blocks
        self.norm = norm
        self.lm_head = lm_head  # [vocab, D]
        self.mtp = mtp  # the multi-token-prediction draft layer, when the checkpoint ships one
        self.device = embed.device  # where every weight lives (chosen by the loader)
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim, self.device)
        self.layout = CacheLayout.for_model(cfg, self.device)
        self.f32 = resolve_tier(self.layout)  # the default tier, the reference
        self.compiled: DecodeStep | None = None

    def tier(self, cache: CacheConfig | str | None = None) -> KVTier:
        """`--kv-cache-dtype` (a CacheConfig with its knobs, a bare tier name, or None for f32)
        resolved for this model's rows: resolve once at the boundary, pass the tier down.
        ValueError if the tier cannot store these rows."""
        if isinstance(cache, str):
            cache = CacheConfig(cache)
        if cache is None or cache.kv_cache_dtype == "f32":
            return self.f32
        return resolve_tier(self.layout, cache)

    def compile_decode(self, tier: KVTier | None = None, progress: bool = True) -> float:
        """Decode one token per step through a compiled step from now on (a small model's built
        ahead of time, else torch.compile's: `latentkv.models.compiled`); builds and warms it up
        now, for caches of `tier` (f32 when None; call again for each other tier in use).
        Returns the seconds building took."""
        tier = tier or self.f32
        if self.compiled is not None:
            check_compilable(tier.name, tier.recent_window)
        self.compiled, seconds = warm_step(self, tier, self.compiled, progress)
        return seconds

    def make_cache(self, tier: KVTier | None = None) -> Cache:
        """The cache one sequence needs: latent rows per layer (in `tier`, from `self.tier`;
        f32 when None), plus indexer keys for DSA models."""
        tier = tier or self.f32
        if tier.layout != self.layout:
            raise ValueError(f"a tier resolved for {tier.layout} does not suit this model ({self.layout})")
        return tier.make_cache()

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, cache: Cache, all_logits: bool = False, hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [S] (int64) continuing `cache` -> logits [S, vocab] (or [1, vocab] for the last).

        The cache gains S rows per layer. Positions continue from `cache.length`. With `hidden`,
        returns (logits, h) where h [S, D] is every position's lm_head input (after the final
        norm): what the MTP draft layer reads (`latentkv.models.mtp`).
        """
        # a one-token prompt (cache.length 0) is a prefill: eager, as every prompt; the compiled
        # step's graphs start at length 1 (at 0 torch.compile would trace another)
        if self.compiled is not None and tokens.shape[0] == 1 and cache.length and not hidden:
            return self.compiled(tokens, cache, all_logits)
        return self._forward(tokens, cache, all_logits, hidden)

    def check_context(self, length: int) -> None:
        """ValueError unless a context of `length` tokens fits the model's positions."""
        if length > self.cfg.max_position_embeddings:
            raise ValueError(
                f"context of {length} tokens exceeds the model's maximum of {self.cfg.max_position_embeddings}"
            )

    def _forward(
        self,
        tokens: torch.Tensor,
        cache: Cache,
        all_logits: bool = False,
        hidden: bool = False,
        speculative: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` without the compiled step (what the compiled step traces)."""
        S = tokens.shape[0]
        self.check_context(cache.length + S)
        batch = batches.one_sequence(self.rope, tokens, cache, speculative=speculative)
        return self._run(batch, last_only=not all_logits and S > 1, hidden=hidden)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding's verify step for one sequence: tokens [S] (the pending token and
        its drafts) -> (logits [S, vocab], h [S, D]) of every position; the cache gains S rows.
        `forward(all_logits=True, hidden=True)` up to float32 rounding: a few tokens take the
        fused decode products a one-token step takes (`latentkv.models.batch.few`)."""
        return self._forward(tokens, cache, all_logits=True, hidden=True, speculative=True)

    def _run(
        self, batch: Batch, last_only: bool = True, hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The one forward pass: every block over the batch's tokens, then each segment's last
        row (every row when `last_only` is False) through the final norm and lm_head. With
        `hidden`, also every row's lm_head input h [N, D] (the final norm's output)."""
        x = self.embed.index_select(0, batch.tokens)  # [N, D]; activations stay float32
        if x.dtype != torch.float32:
            x = x.float()
        selected = None
        for i, block in enumerate(self.blocks):
            x, selected = block(x, batch, i, selected)
        batch.commit()
        if hidden:
            h = self.norm(x)  # [N, D]
            if last_only and len(batch.sizes) == 1:
                return self.lm_head(h[-1:]), h
            if last_only and not batch.decode:
                return self.lm_head(h.index_select(0, batch.last_rows)), h
            return self.lm_head(h), h
        if last_only and len(batch.sizes) == 1:
            x = x[-1:]
        elif last_only and not batch.decode:
            x = x.index_select(0, batch.last_rows)
        return self.lm_head(self.norm(x))

    @torch.inference_mode()
    def draft(
        self,
        next_tokens: torch.Tensor,
        hidden: torch.Tensor,
        cache: Cache,
        position: int,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer at positions position.. (see `MTPLayer.forward`): -> (logits [S, vocab]
        for the token after next, h' [S, D]; with `last_only`, both of the last position only,
        [1, vocab] and [1, D]). `cache` is `make_draft_cache`'s."""
        if self.mtp is None:
            raise ValueError("this model has no MTP (multi-token prediction) layer")
        return self.mtp.forward(
            self.embed, self.lm_head, self.rope, next_tokens, hidden, cache, position, last_only
        )

    @torch.inference_mode()
    def draft_batch(
        self,
        next_tokens: list[torch.Tensor],
        hidden: list[torch.Tensor],
        caches: list[Cache],
        positions: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` for B sequences in one pass (see `MTPLayer.forward_batch`): -> (logits
        [B, vocab], h' [B, D]) of each sequence's last position."""
        if self.mtp is None:
            raise ValueError("this model has no MTP (multi-token prediction) layer")
        return self.mtp.forward_batch(
            self.embed, self.lm_head, self.rope, next_tokens, hidden, caches, positions
        )

    def make_draft_cache(self, tier: KVTier | None = None) -> Cache:
        """The MTP layer's own cache, in the main cache's tier (`tier`, f32 when None)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP (multi-token prediction) layer")
        return self.mtp.make_cache(tier or self.f32)

    @torch.inference_mode()
    def decode_batch(
        self, tokens: torch.Tensor, caches: Sequence[Cache], pool: SlotPool | None = None
    ) -> torch.Tensor:
        """One decode step of B independent sequences: tokens [B] (int64), one cache each (ragged
        lengths, any tier) -> logits [B, vocab]; every cache gains one row.

        Dense work runs batched over the B rows; attention reads each sequence's own cache. A
        sequence's logits equal `forward(token[None], cache)`'s up to float32 rounding (not bit
        for bit: see `latentkv.models.batch` for what is and is not guaranteed). With `pool`,
        the float32 caches placed in it are written and read there in one op per layer.
        """
        if tokens.dim() != 1 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be int64 [B], got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.shape[0] != len(caches):
            raise ValueError(
                f"{tokens.shape[0]} tokens for {len(caches)} caches (need one each, at least one)"
            )
        lengths = self._check(tokens, caches, [1] * len(caches))
        if len(caches) == 1:  # one sequence: the single-sequence pass itself (fewer ops, bit for bit)
            return self.forward(tokens, caches[0])
        slots = batches.pool_slots(self.layout, pool, caches, max(lengths) + 1)
        if slots is not None and slots != sorted(
            slots
        ):  # run in slot order: the pool is then read by a slice
            order = sorted(range(len(caches)), key=slots.__getitem__)
            logits = self.decode_batch(tokens[order], [caches[b] for b in order], pool)
            return logits[torch.tensor(order, device=logits.device).argsort()]
        return self._run(batches.decode(self.rope, tokens, caches, pool, slots))

    @torch.inference_mode()
    def verify_batch(
        self, segments: Sequence[torch.Tensor], caches: Sequence[Cache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding's verify step for B sequences in one pass: one int64 segment
        [S_b] per cache (the pending token and its drafts) -> (logits [N, vocab], h [N, D]) of
        every position, segments in order (N = sum S_b); cache b gains S_b rows."""
        self._check_segments(segments, caches)
        if len(caches) == 1:
            return self.verify(segments[0], caches[0])
        batch = batches.prefill(self.rope, segments, caches, speculative=True)
        return self._run(batch, last_only=False, hidden=True)

    def _check_segments(
        self, segments: Sequence[torch.Tensor], caches: Sequence[Cache], what: str = "segment"
    ) -> None:
        """One non-empty int64 [S_b] per cache, and `_check`'s rules for the whole batch."""
        if len(segments) != len(caches):
            raise ValueError(
                f"{len(segments)} {what}s for {len(caches)} caches (need one each, at least one)"
            )
        for seg in segments:
            if seg.dim() != 1 or seg.dtype != torch.long or seg.shape[0] == 0:
                raise ValueError(
                    f"each {what} must be a non-empty int64 [S], got {seg.dtype} {tuple(seg.shape)}"
                )
        tokens = torch.cat(list(segments)) if segments else torch.zeros(0, dtype=torch.long)
        self._check(tokens, caches, [seg.shape[0] for seg in segments])

    @torch.inference_mode()
    def prefill_batch(
        self, prompts: Sequence[torch.Tensor], caches: Sequence[Cache], hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Prefill B sequences in one pass: one int64 prompt [S_b] per cache (any tier, any
        length so far) -> logits [B, vocab] of each prompt's last token; cache b gains S_b rows.
        Nothing is committed if a pass fails. On a small model a short prefill is bound by
        per-op overhead, so B prompts in one pass cost much less than B passes (builtin:tiny, 8
        prompts of 32 tokens: 2.3x faster; `benchmarks/prefill_batch.py`). With `hidden`, also
        every prompt token's lm_head input h [sum S_b, D] (what the MTP draft layer reads)."""
        self._check_segments(prompts, caches, "prompt")
        if len(caches) == 1:
            return self.forward(prompts[0], caches[0], hidden=hidden)
        return self._run(batches.prefill(self.rope, prompts, caches), hidden=hidden)

    def _check(self, tokens: torch.Tensor, caches: Sequence[Cache], sizes: Sequence[int]) -> list[int]:
        return check_batch(
            self.cfg.vocab_size, self.cfg.max_position_embeddings, self.layout, tokens, caches, sizes
        )

    def num_parameters(self) -> int:
        """Weights held by the model, whatever their storage format (the RoPE tables are derived,
        not counted). A dense tensor seen through several views (a tied lm_head, per-head or
        per-expert views of a stacked tensor) is counted once: the byte spans of each storage are
        merged. A packed matrix (int8, int4) counts its logical [out, in] (and bias), not its
        bytes; a tied lm_head packed apart from the embedding is the embedding's weights."""
        tied_apart = self.cfg.tie_word_embeddings and self.lm_head.dense is None
        return self._weights(
            lambda lin: lin.out_features * lin.in_features + _numel(lin.bias), not tied_apart
        )

    def weight_bytes(self) -> int:
        """Bytes the weights take in their formats: each packed matrix's `nbytes`, each dense
        tensor's bytes once (views merged); what resident memory is compared with."""
        return self._weights(lambda lin: lin.nbytes, True, in_bytes=True)

    def weight_tensors(self):
        """Every tensor the weights are stored in (a packed matrix's too; views of one storage may
        repeat)."""
        for t in _tensors([self.embed, self.blocks, self.norm, self.mtp, self.lm_head]):
            if isinstance(t, Linear):
                yield from (v for v in vars(t).values() if isinstance(v, torch.Tensor))
            else:
                yield t

    def _weights(self, packed_size, with_head: bool, in_bytes: bool = False) -> int:
        spans: dict[int, list[tuple[int, int, int]]] = {}
        packed: dict[int, int] = {}
        parts = [self.embed, self.blocks, self.norm, self.mtp] + ([self.lm_head] if with_head else [])
        for t in _tensors(parts):
            if isinstance(t, Linear):
                packed[id(t)] = packed_size(t)
            elif t.numel():
                size = t.element_size()
                start = t.untyped_storage().data_ptr() + t.storage_offset() * size
                spans.setdefault(t.untyped_storage().data_ptr(), []).append(
                    (start, start + t.numel() * size, 1 if in_bytes else size)
                )
        total = sum(packed.values())
        for views in spans.values():
            end = 0
            for start, stop, unit in sorted(views):
                if stop > end:
                    total += (stop - max(start, end)) // unit
                    end = stop
        return total


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


def _tensors(obj, depth: int = 0):
    """Every tensor (or packed Linear) reachable from the model's plain-object tree (for counting
    parameters); private attributes hold derived tensors (e.g. RMSNorm's doubled scale) and are
    skipped."""
    if depth > 12:
        return
    if isinstance(obj, torch.Tensor) or (isinstance(obj, Linear) and obj.dense is None):
        yield obj  # a packed Linear is counted by its shape, not its storage
    elif isinstance(obj, (list, tuple, dict)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(item, depth + 1)
    elif hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if not name.startswith("_"):
                yield from _tensors(value, depth + 1)
