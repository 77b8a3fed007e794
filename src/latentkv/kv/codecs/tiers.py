"""KV tiers: which codec stores the latent `c` and which the rope key `r`.

A tier is what `--kv-cache-dtype` names. Most tiers use one codec for both parts (`tq4` is tq4
for c and for r, each with its own scale); the mixed tiers keep the small RoPE'd key at a
higher precision while the latent is rotated and 4- or 3-bit:

    tier        c       r      GLM-5 (512 + 64) bytes/token/layer
    tq4         tq4     tq4    260 + 36  = 296
    tq4-r8      tq4     fp8    260 + 68  = 328
    tq4-r16     tq4     bf16   260 + 128 = 388
    tq3-r8      tq3     fp8    196 + 68  = 264
    tq3-r16     tq3     bf16   196 + 128 = 324
    polar4-r8   polar4  fp8    228 + 68  = 296
    polar4-r16  polar4  bf16   228 + 128 = 356

r is 64 of GLM-5's 576 values, so keeping it at 8 or 16 bits costs 32 to 92 bytes a row;
whether that buys quality is measured in docs/kv-tiers.md. The block tiers (llama.cpp's q8_0,
q5_0, q4_0, q4_1 and the rotated hq* variants, `blocks.py`) store c and r in the same format. The suffix names r's storage:
`-r8` fp8 e4m3 (per-row scale), `-r16` bf16. The KV file records the tier name and both
codecs' params, so a file written under one tier is refused under any other.

The names themselves are listed once, in `latentkv.config.KV_CACHE_DTYPES` (the flags' module,
which imports nothing else of the package); this table derives each name's two codec names
from it, and is nothing more. The one runtime tier object, a name resolved for one model's
rows (codecs with their parameters, bytes per row, the caches it makes), is
`latentkv.kv.cache.KVTier`.
"""

from __future__ import annotations

from typing import NamedTuple

from latentkv.config import KV_CACHE_DTYPES


class TierCodecs(NamedTuple):
    """The codec names of a tier's two parts."""

    c: str  # codec of the latent c (kv_lora_rank values)
    r: str  # codec of the rope key r (qk_rope_head_dim values)


_R_SUFFIXES = {"r8": "fp8", "r16": "bf16"}


def _codecs(name: str) -> TierCodecs:
    """`tq4-r8` -> ("tq4", "fp8"); a plain codec name stores both parts."""
    base, _, suffix = name.partition("-")
    return TierCodecs(base, _R_SUFFIXES[suffix]) if suffix else TierCodecs(name, name)


TIERS: dict[str, TierCodecs] = {name: _codecs(name) for name in KV_CACHE_DTYPES}
TIER_NAMES: tuple[str, ...] = tuple(TIERS)
