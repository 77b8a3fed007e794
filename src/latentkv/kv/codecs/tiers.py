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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    """One `--kv-cache-dtype`: the codec names of its two parts."""

    name: str
    c: str  # codec of the latent c (kv_lora_rank values)
    r: str  # codec of the rope key r (qk_rope_head_dim values)


def _same(name: str) -> Tier:
    return Tier(name, name, name)


_R_SUFFIXES = {"r8": "fp8", "r16": "bf16"}
BLOCK_TIERS = (
    *("q8_0", "q5_0", "q4_0", "q4_1"),
    *("hq8_0", "hq5_0", "hq4_0", "hq4_1"),
    "q8s",
    "q5s",
    "q4s",
    "wq4",
)
MIXED_BASES = ("tq4", "tq3", "polar4")

TIERS: dict[str, Tier] = {
    **{
        n: _same(n)
        for n in ("f32", "bf16", "fp8", *(f"tq{b}" for b in range(2, 7)), *(f"polar{b}" for b in range(2, 7)))
    },
    **{
        f"{base}-{suffix}": Tier(f"{base}-{suffix}", base, r)
        for base in MIXED_BASES
        for suffix, r in _R_SUFFIXES.items()
    },
    **{n: _same(n) for n in BLOCK_TIERS},
}
TIER_NAMES: tuple[str, ...] = tuple(TIERS)
