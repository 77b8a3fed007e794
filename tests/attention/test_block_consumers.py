"""The block tiers' fast readers against a byte-by-byte reference, on random bytes.

`block_values` (what attention reads) widens whole tensors of codes at once, reads fp16 scales in
place when they are aligned and through a copy when not (q5_0 in blocks of 8 is 7 bytes a block).
Here every block format decodes random code bytes (every nibble and fifth-bit pattern, random
finite fp16 scales) exactly as a plain per-block float64 reference written from the format's
definition, for odd row counts, rows at odd byte offsets and gathered rows; and attention over
them equals dequantize-then-attend in float64.
"""

from __future__ import annotations

import struct

import pytest
import torch

from latentkv.attention import consumers as attention
from latentkv.kv.codecs import EncodedRows, get_codec
from latentkv.kv.codecs.blocks import WQ4_LEVELS

NAMES = ["q8_0", "q5_0", "q4_0", "q4_1", "hq8_0", "hq5_0", "hq4_0", "hq4_1", "q8s", "q5s", "q4s", "wq4"]
# widths and the block each gets: 8 (q5_0 blocks of 7 bytes: unaligned scales), 16, 32; the
# rotated codecs need a power of two (16 for blocks of 16)
CASES = [(name, w) for name in NAMES for w in (8, 16 if name.startswith("h") else 48, 64)]


def ref_block(name: str, raw: bytes, n: int) -> list[float]:
    """One block's values, float64, from its definition (ggml's dequantize_row_*; wq4's table)."""
    fmt = name.removeprefix("h")
    d = struct.unpack("<e", raw[:2])[0]
    if fmt in ("q8_0", "q8s"):
        return [v * d for v in struct.unpack(f"<{n}b", raw[2:])]
    if fmt == "q4_1":
        m, body = struct.unpack("<e", raw[2:4])[0], raw[4:]
        return [q * d + m for q in [b & 15 for b in body] + [b >> 4 for b in body]]
    high_bytes = n // 8 if fmt in ("q5_0", "q5s") else 0
    high = int.from_bytes(raw[2 : 2 + high_bytes], "little")
    body = raw[2 + high_bytes :]
    codes = [b & 15 for b in body] + [b >> 4 for b in body]
    if fmt == "wq4":
        table = [-v for v in reversed(WQ4_LEVELS)] + list(WQ4_LEVELS)
        return [table[c] * d for c in codes]
    offset = 16 if high_bytes else 8
    return [((c | (((high >> j) & 1) << 4)) - offset) * d for j, c in enumerate(codes)]


def ref_values(codec, codes: torch.Tensor) -> torch.Tensor:
    """codes [N, code_bytes] -> float64 [N, width], block by block."""
    step, out = codec.block_bytes, []
    for row in codes.tolist():
        raw = bytes(row)
        out.append(
            [
                v
                for b in range(codec.blocks)
                for v in ref_block(codec.name, raw[b * step : (b + 1) * step], codec.block)
            ]
        )
    return torch.tensor(out, dtype=torch.float64)


def random_codes(codec, rows: int, seed: int) -> torch.Tensor:
    """Random code bytes with random finite fp16 scales (and q4_1 minimums) in every block."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, codec.blocks, codec.block_bytes), dtype=torch.uint8, generator=g)
    scales = 2 if codec.name.endswith("q4_1") else 1
    fp16 = (torch.randn(rows, codec.blocks, scales, generator=g) * 0.1).to(torch.float16)
    codes[..., : 2 * scales] = fp16.view(torch.uint8)
    return codes.view(rows, codec.code_bytes)


@pytest.mark.parametrize(("name", "width"), CASES)
def test_block_values_equal_the_reference_on_random_bytes(name, width):
    codec = get_codec(name, width)
    codes = random_codes(codec, 14, seed=width)
    for part in (codes, codes[1:8], codes[3:4], codes.index_select(0, torch.tensor([5, 0, 13, 5]))):
        ours = codec.block_values(part)  # an odd byte offset where code_bytes is odd (q5_0 at 8)
        assert ours.dtype == torch.float32 and ours.shape == (len(part), width)
        torch.testing.assert_close(ours.double(), ref_values(codec, part), rtol=1e-6, atol=0)
    assert codec.block_values(codes[:0]).shape == (0, width)


@pytest.mark.parametrize("name", NAMES)
def test_decode_is_the_values_in_the_row_basis(name):
    codec = get_codec(name, 64)
    codes = random_codes(codec, 5, seed=1)
    values = ref_values(codec, codes)
    if name.startswith("h"):
        values = codec.rotation.unrotate(values.float()).double()
    decoded = codec.decode(EncodedRows(codes, torch.empty(5, 0)))
    torch.testing.assert_close(decoded.double(), values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens", [1, 37, 3 * 16 + 5])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_equals_dequantize_then_attend(name, tokens, masked):
    codec_c, codec_r = get_codec(name, 64), get_codec(name, 32)
    g = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens + 3, 96, generator=g) * torch.exp(torch.randn(tokens + 3, 1, generator=g))
    c_all, r_all = codec_c.encode(rows[:, :64]), codec_r.encode(rows[:, 64:])
    c, r = c_all.rows(3, tokens + 3), r_all.rows(3, tokens + 3)  # a view at an offset, as a cache's
    query = torch.randn(4, 2, 96, generator=g)  # [H, S, n_c + n_r]
    allowed = torch.rand(2, tokens, generator=g) < 0.7 if masked else None
    if allowed is not None:
        allowed[:, 0] = True
    ours = attention.attend(codec_c, codec_r, query, c, r, allowed, tile=16)
    full = torch.cat((codec_c.decode(c), codec_r.decode(r)), dim=1).double()  # dequantize, then attend
    s = query.double() @ full.T
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    reference = torch.softmax(s, dim=-1) @ full[:, :64]
    assert ((ours.double() - reference).norm() / reference.norm()).item() < 1e-5


@pytest.mark.parametrize("name", ["q8s", "q5s", "q4s", "wq4"])
def test_nearest_level_is_bucketize_over_the_midpoints(name):
    codec = get_codec(name, 64)
    top = float(codec.table.abs().max())
    v = torch.cat(
        (torch.rand(4000) * 2.4 * top - 1.2 * top, codec._mids, codec._mids.nextafter(torch.tensor(-1e9)))
    )
    v = torch.cat((v, codec._mids.nextafter(torch.tensor(1e9)), torch.tensor([0.0, -0.0, 1e30, -1e30])))
    assert torch.equal(codec._level_index(v), torch.bucketize(v, codec._mids))
    assert torch.equal(codec._nearest_level(v), codec.table[torch.bucketize(v, codec._mids)])


@pytest.mark.parametrize("name", ["q8s", "q4s", "wq4"])
def test_searched_rows_in_chunks_encode_as_all_at_once(name, monkeypatch):
    from latentkv.kv.codecs import blocks

    codec = get_codec(name, 64)
    rows = torch.randn(11, 64) * torch.exp(torch.randn(11, 1))
    whole = codec.encode(rows).codes
    monkeypatch.setattr(blocks, "SEARCH_ROWS", 3)
    assert torch.equal(codec.encode(rows).codes, whole)
    assert torch.equal(torch.cat([codec.encode(rows[i : i + 1]).codes for i in range(11)]), whole)
