"""Native consumers == decode-then-attend (float64), for every codec, in bounded tiles."""

from __future__ import annotations

import pytest
import torch

from latentkv.attention import consumers as attention
from latentkv.kv.codecs import CODEC_NAMES, Codec, EncodedRows, get_codec

TILE = 64  # small tiles so that short caches already span several, with a ragged last one
# float32 consumers against float64 on fresh random rows of varied scale (exp(randn) up to ~20x):
# scores reach tens, and their float32 rounding moves the softmax by up to ~1.5e-5 (seen in CI
# at 209 tokens, tq4, g16); a wrong mask, scale or merge is off by 1e-2 or more.
TOL = 5e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def cache(codec: Codec, tokens: int) -> EncodedRows:
    rows = torch.randn(tokens, codec.width) * torch.exp(torch.randn(tokens, 1))  # rows of varied scale
    return codec.encode(rows)


CODEC_CASES = [*CODEC_NAMES, "fp8-g16", "tq4-g16", "tq3-g8", "polar4-g16", "polar3-g8"]


def make(case: str, width: int) -> Codec:
    """A codec by case name: a registry name, or NAME-gG for NAME with grouped scales of G values."""
    name, _, group = case.partition("-g")
    return get_codec(name, width, group_size=int(group) if group else None)


def rope_width(case: str) -> int:
    """The r width of the fused tests: 8, or the group size where the case groups more values."""
    _, _, group = case.partition("-g")
    return max(8, int(group or 0))


@pytest.mark.parametrize("case", CODEC_CASES)
@pytest.mark.parametrize(("width", "tokens"), [(64, 1), (64, 3 * TILE + 17), (512, TILE + 1)])
def test_scores_match_decode_then_dot(case, width, tokens):
    codec = make(case, width)
    enc = cache(codec, tokens)
    q = torch.randn(4, 3, width)  # [H, S, n]
    ours = attention.scores(codec, q, enc, tile=TILE)
    assert ours.shape == (4, 3, tokens) and ours.dtype == torch.float32
    reference = q.double() @ codec.decode(enc).double().T  # [H, S, T]
    assert rel(ours, reference) < TOL


@pytest.mark.parametrize("case", CODEC_CASES)
@pytest.mark.parametrize(("width", "tokens"), [(64, 1), (64, 3 * TILE + 17), (512, TILE + 1)])
def test_context_matches_decode_then_weighted_sum(case, width, tokens):
    codec = make(case, width)
    enc = cache(codec, tokens)
    w = torch.softmax(torch.randn(4, 3, tokens), dim=-1)  # [H, S, T]
    ours = attention.context(codec, w, enc, tile=TILE)
    assert ours.shape == (4, 3, width) and ours.dtype == torch.float32
    reference = w.double() @ codec.decode(enc).double()  # [H, S, n]
    assert rel(ours, reference) < TOL


@pytest.mark.parametrize("case", ["fp8", "tq4", "polar4"])
def test_default_tile_and_one_query(case):
    codec = make(case, 512)
    enc = cache(codec, attention.DEFAULT_TILE + 3)
    q = torch.randn(1, 512)
    reference = q.double() @ codec.decode(enc).double().T
    assert rel(attention.scores(codec, q, enc), reference) < TOL


@pytest.mark.parametrize("case", ["bf16", "fp8", "fp8-g16", "tq3", "polar4", "tq4-g16", "polar4-g16"])
def test_reads_stay_within_one_tile(case, monkeypatch):
    """The packed rows are read tile by tile, never the whole cache at once."""
    codec = make(case, 64)
    enc = cache(codec, 5 * TILE + 9)
    consumer = attention.consumer_for(codec)
    seen: list[int] = []

    def spy(codec_: Codec, rows: EncodedRows):
        seen.append(len(rows))
        return consumer.read(codec_, rows)

    monkeypatch.setitem(attention.CONSUMERS, type(codec), attention.Consumer(spy, consumer.rotated))
    attention.scores(codec, torch.randn(2, 64), enc, tile=TILE)
    attention.context(codec, torch.rand(2, len(enc)), enc, tile=TILE)
    assert seen == [TILE] * 5 + [9] + [TILE] * 5 + [9]


def test_f32_scores_are_exactly_the_matmul():
    codec = get_codec("f32", 64)
    rows = torch.randn(300, 64)
    q = torch.randn(5, 64)
    assert torch.equal(attention.scores(codec, q, codec.encode(rows)), q @ rows.T)
    w = torch.rand(5, 300)
    assert torch.equal(attention.context(codec, w, codec.encode(rows)), w @ rows)


def test_inert_rows_score_zero():
    codec = get_codec("tq4", 64)
    rows = torch.randn(4, 64)
    rows[1] = float("nan")
    s = attention.scores(codec, torch.randn(2, 64), codec.encode(rows))
    assert torch.isfinite(s).all() and not s[:, 1].any()


def test_gathered_rows():
    """DSA-style selection: consumers on `select`ed rows == the same columns of the full scores."""
    codec = get_codec("tq4", 512)
    enc = cache(codec, 200)
    q = torch.randn(3, 512)
    picked = torch.randperm(200)[:37]
    full = attention.scores(codec, q, enc, tile=TILE)
    # a gathered block may be summed in another order: float32 rounding of ~22-sized scores
    assert torch.allclose(
        attention.scores(codec, q, enc.select(picked), tile=TILE), full[:, picked], atol=1e-4
    )


def test_empty_cache():
    codec = get_codec("fp8", 64)
    enc = codec.empty(0, device=torch.device("cpu"))
    assert attention.scores(codec, torch.randn(2, 5, 64), enc).shape == (2, 5, 0)
    assert not attention.context(codec, torch.randn(2, 5, 0), enc).any()


def test_errors():
    codec = get_codec("tq4", 64)
    enc = cache(codec, 4)
    with pytest.raises(ValueError, match="width"):
        attention.scores(codec, torch.randn(2, 32), enc)
    with pytest.raises(ValueError, match="4 rows"):
        attention.context(codec, torch.randn(2, 5), enc)

    class Unregistered(type(codec)):
        pass

    with pytest.raises(ValueError, match="no attention consumer for Unregistered; registered: F32Codec"):
        attention.scores(Unregistered(64, 4), torch.randn(2, 64), enc)


@pytest.mark.parametrize("case", CODEC_CASES)
@pytest.mark.parametrize(
    ("tokens", "masked"), [(1, False), (TILE - 3, True), (3 * TILE + 17, False), (2 * TILE + 5, True)]
)
def test_fused_attend_matches_decode_then_softmax(case, tokens, masked):
    """The one-pass online-softmax attention equals scores -> softmax -> context in float64."""
    codec_c, codec_r = make(case, 64), make(case, rope_width(case))
    c, r = cache(codec_c, tokens), cache(codec_r, tokens)
    H, S = 4, 3
    query = torch.randn(H, S, codec_c.width + codec_r.width)
    allowed = None
    if masked:  # a causal-style mask: query s sees a prefix, so early tiles are fully masked for some rows
        allowed = torch.arange(tokens)[None, :] <= torch.tensor([0, tokens // 2, tokens - 1])[:, None]
        late = min(TILE + 3, tokens - 1)
        allowed[0, :late] = False  # row 0 sees nothing in the first tiles...
        allowed[0, late] = True  # ...but one token later on
    ours = attention.attend(codec_c, codec_r, query, c, r, allowed, tile=TILE)
    rows_c, rows_r = codec_c.decode(c).double(), codec_r.decode(r).double()
    q = query.double()
    scores = q[..., : codec_c.width] @ rows_c.T + q[..., codec_c.width :] @ rows_r.T  # [H, S, T]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    reference = torch.softmax(scores, dim=-1) @ rows_c
    assert ours.shape == (H, S, codec_c.width)
    assert rel(ours, reference) < TOL


def _reference(query, rows_c, rows_r, allowed):
    """float64 (context [H, S, n_c], lse [H, S]) of MLA attention over decoded rows."""
    q = query.double()
    n = rows_c.shape[1]
    scores = q[..., :n] @ rows_c.double().T + q[..., n:] @ rows_r.double().T
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ rows_c.double(), torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize(
    ("c_case", "r_case"), [("tq4", "fp8"), ("tq4", "bf16"), ("tq3", "fp8"), ("tq4-g16", "fp8-g16")]
)
@pytest.mark.parametrize("tokens", [5, 2 * TILE + 7])
def test_fused_attend_with_a_mixed_codec_pair(c_case, r_case, tokens):
    """The mixed tiers: c rotated (tq), r in fp8 or bf16 in the plain basis."""
    codec_c, codec_r = make(c_case, 64), make(r_case, 16)
    c, r = cache(codec_c, tokens), cache(codec_r, tokens)
    query = torch.randn(4, 3, 64 + 16)
    allowed = torch.rand(3, tokens) < 0.7
    allowed[:, 0] = True
    ours = attention.attend(codec_c, codec_r, query, c, r, allowed, tile=TILE)
    reference, _ = _reference(query, codec_c.decode(c), codec_r.decode(r), allowed)
    assert rel(ours, reference) < TOL


@pytest.mark.parametrize("tokens", [7, 3 * TILE + 5])
def test_lse_and_merge_of_disjoint_rows_equal_one_softmax(tokens):
    """attend_with_lse's log-sum-exp is the float64 one; merging two halves is attention over all rows,
    also for queries that see nothing in one half (their part has lse -inf)."""
    codec_c, codec_r = make("tq4", 64), make("fp8", 8)
    c, r = cache(codec_c, tokens), cache(codec_r, tokens)
    query = torch.randn(2, 4, 72) * 3
    allowed = torch.rand(4, tokens) < 0.6
    allowed[2:, tokens // 2] = True  # every query sees a row (none: NaN in both; 1 run in 300 at 7 rows)
    allowed[0, : tokens // 2] = False  # query 0 sees nothing in the first half...
    allowed[0, -1] = True
    allowed[1, tokens // 2 :] = False  # ...query 1 nothing in the second
    allowed[1, 0] = True
    out, lse = attention.attend_with_lse(codec_c, codec_r, query, c, r, allowed, tile=TILE)
    ref_out, ref_lse = _reference(query, codec_c.decode(c), codec_r.decode(r), allowed)
    assert rel(out, ref_out) < TOL
    torch.testing.assert_close(lse.double(), ref_lse, rtol=TOL, atol=TOL)
    half = tokens // 2
    parts = [
        attention.attend_with_lse(
            codec_c, codec_r, query, c.rows(a, b), r.rows(a, b), allowed[:, a:b], tile=TILE
        )
        for a, b in ((0, half), (half, tokens))
    ]
    merged = attention.merge(parts)
    assert torch.isfinite(merged).all()
    assert rel(merged, ref_out) < TOL


def test_f32_window_attention_with_lse():
    rows = torch.randn(9, 40)
    query = torch.randn(3, 2, 40)
    allowed = torch.rand(2, 9) < 0.5
    allowed[:, 4] = True
    out, lse = attention.attend_f32_with_lse(query, rows, 32, allowed)
    ref_out, ref_lse = _reference(query, rows[:, :32], rows[:, 32:], allowed)
    assert rel(out, ref_out) < 1e-6
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="width 40 against rows of width 36"):
        attention.attend_f32_with_lse(query, rows[:, :36], 32)


def test_default_tile_holds_a_decode_step_and_bounds_a_prefill(monkeypatch):
    """By default a decode query block reads thousands of rows as one tile; many queries keep
    tiles of DEFAULT_TILE rows, so the scores block stays within TILE_ELEMENTS values."""
    assert attention.tile_rows(64, 576) == attention.TILE_ELEMENTS // 640 > 4 * attention.DEFAULT_TILE
    assert attention.tile_rows(64 * 512, 576) == attention.DEFAULT_TILE
    assert attention.tile_rows(64, 576, tile=7) == 7
    codec_c, codec_r = make("q4_0", 64), make("q4_0", 32)
    tokens = 2 * attention.DEFAULT_TILE + 9
    c, r = cache(codec_c, tokens), cache(codec_r, tokens)
    seen: list[int] = []
    consumer = attention.consumer_for(codec_c)

    def spy(codec_: Codec, rows: EncodedRows):
        seen.append(len(rows))
        return consumer.read(codec_, rows)

    monkeypatch.setitem(attention.CONSUMERS, type(codec_c), attention.Consumer(spy, consumer.rotated))
    decode = torch.randn(8, 1, 96)  # [H, S, n_c + n_r]
    out = attention.attend(codec_c, codec_r, decode, c, r)
    assert seen == [tokens, tokens]  # c and r, each one tile
    full = torch.cat((codec_c.decode(c), codec_r.decode(r)), dim=1).double()
    reference = torch.softmax(decode.double() @ full.T, dim=-1) @ full[:, :64]
    assert rel(out, reference) < TOL
    seen.clear()
    many = attention.TILE_ELEMENTS // attention.DEFAULT_TILE  # queries that force the smallest tile
    attention.attend(codec_c, codec_r, torch.randn(many, 1, 96), c, r)
    assert seen == [attention.DEFAULT_TILE] * 4 + [9] * 2  # c and r of each tile in turn
