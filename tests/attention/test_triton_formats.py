"""Which codecs the Triton decode kernel reads, and what it is told about their bytes (no triton needed)."""

from __future__ import annotations

import pytest

from latentkv.attention.triton.formats import BLOCK, FP8, TQ, part_format, refusal
from latentkv.kv.codecs import TIERS, get_codec


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_every_tier_but_polar_has_a_kernel_format(tier):
    for name, width in ((TIERS[tier].c, 512), (TIERS[tier].r, 64)):
        codec = get_codec(name, width)
        if name.startswith("polar"):
            assert "no Triton decode kernel" in refusal(codec)
            with pytest.raises(ValueError, match="no Triton decode kernel"):
                part_format(codec)
        else:
            assert refusal(codec) is None
            fmt = part_format(codec)
            assert fmt.width == width and fmt.code_bytes == codec.code_bytes
            assert fmt.scales == codec.scale_count


def test_formats_restate_the_codecs_bytes():
    """Hand-computed from docs/kv-tiers.md's byte tables at GLM-5's 512-wide latent."""
    q4s = part_format(get_codec("q4s", 512))
    assert (q4s.kind, q4s.bits, q4s.block, q4s.block_bytes, q4s.header, q4s.offset) == (
        BLOCK,
        4,
        32,
        18,
        2,
        8,
    )
    q5_0 = part_format(get_codec("q5_0", 512))
    assert (q5_0.block_bytes, q5_0.high, q5_0.offset) == (22, 4, 16)
    q4_1 = part_format(get_codec("q4_1", 512))
    assert (q4_1.header, q4_1.affine, q4_1.offset) == (4, True, 0)
    q8s = part_format(get_codec("q8s", 512))
    assert (q8s.bits, q8s.block_bytes, q8s.offset, q8s.table) == (8, 34, 0, None)
    assert len(part_format(get_codec("wq4", 512)).table) == 16
    fp8 = part_format(get_codec("fp8", 512, group_size=64))
    assert (fp8.kind, fp8.scales, fp8.group) == (FP8, 8, 64)
    tq4 = part_format(get_codec("tq4", 512))
    assert (tq4.kind, tq4.bits, tq4.code_bytes, len(tq4.table), tq4.gain) == (TQ, 4, 256, 16, 512**-0.5)
    assert tq4.rotation is not None and q4s.rotation is None
    assert part_format(get_codec("hq4_0", 512)).rotation is not None
    # the rope key of a tiny model: 8 values, one block of 8, padded to a 16-wide tile of 2 blocks
    narrow = part_format(get_codec("q8_0", 8))
    assert (narrow.block, narrow.padded, narrow.constants()[5]) == (8, 16, 2)
