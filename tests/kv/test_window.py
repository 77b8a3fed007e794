"""The full-precision recent window: a query at position p reads rows p - W + 1 .. p as exact
float32 and older rows from the tier. Checked against float64 attention over an explicitly
chosen mix of exact and decoded rows, with fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from latentkv.attention import readers
from latentkv.config import CacheConfig, ConfigError
from latentkv.kv.cache import (
    CacheLayout,
    KVTier,
    PackedLatentCache,
    PackedRows,
    WindowedRows,
    codecs_for,
    resolve_tier,
)

LAYOUT = CacheLayout(
    num_layers=2, row_width=40, kv_lora_rank=32, index_layers=(), index_head_dim=0, device=torch.device("cpu")
)
TIERS = [
    ("tq4", None),
    ("tq4-r8", None),
    ("tq3-r16", None),
    ("tq4", 8),
    ("polar4", 8),
    ("fp8", None),
    ("bf16", None),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def codecs(tier: str, group: int | None):
    return codecs_for(LAYOUT, CacheConfig(tier, group_size=group))


def reference(query, exact, decoded, use_exact, allowed):
    """float64 attention: row t of query s is exact[t] where use_exact[s, t], else decoded[t].

    query [H, S, 40], exact / decoded [T, 40], use_exact / allowed bool [S, T] -> [H, S, 32]."""
    q = query.double()
    rows = torch.where(use_exact[:, :, None], exact.double()[None], decoded.double()[None])  # [S, T, 40]
    scores = torch.einsum("hsw,stw->hst", q, rows)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hst,stw->hsw", torch.softmax(scores, dim=-1), rows[..., :32])


def window_rows(tier, group, exact: torch.Tensor, window: int, query_start: int, query_count: int):
    """A WindowedRows over `exact` [T, 40] encoded in the tier, holding the exact rows a cache holds."""
    codec_c, codec_r = codecs(tier, group)
    packed = PackedRows(codec_c.encode(exact[:, :32]), codec_r.encode(exact[:, 32:]), codec_c, codec_r)
    recent_start = max(0, query_start - window)  # the last W committed rows, then this pass's
    return WindowedRows(packed, exact[recent_start:], recent_start, window, query_start, query_count)


def decoded_rows(reader: WindowedRows) -> torch.Tensor:
    return reader.packed.decoded()


def exact_mask(qpos: torch.Tensor, rpos: torch.Tensor, window: int) -> torch.Tensor:
    return rpos[None, :] > qpos[:, None] - window  # [S, T]


def random_rows(n: int) -> torch.Tensor:
    return torch.randn(n, 40) * torch.exp(0.5 * torch.randn(n, 1))


@pytest.mark.parametrize(("tier", "group"), TIERS)
@pytest.mark.parametrize("window", [1, 5, 23, 80])
def test_prefill_block_matches_the_reference(tier, group, window):
    T, S = 50, 20  # queries at positions 30..49 over rows 0..49
    exact = random_rows(T)
    reader = window_rows(tier, group, exact, window, T - S, S)
    qpos = torch.arange(T - S, T)
    allowed = torch.arange(T)[None, :] <= qpos[:, None]  # causal
    allowed &= torch.rand(S, T) < 0.8  # and a DSA-like selection
    allowed[torch.arange(S), qpos] = True
    query = torch.randn(4, S, 40)
    ours = readers.attend(query, reader, allowed)
    use = exact_mask(qpos, torch.arange(T), window)
    expected = reference(query, exact, decoded_rows(reader), use, allowed)
    assert rel(ours, expected) < 1e-5
    if window < T:  # the window matters: reading every row from the tier gives something else
        tier_only = reference(query, exact, decoded_rows(reader), torch.zeros_like(use), allowed)
        assert rel(tier_only, expected) > 1e-4
    # a slice of the pass's queries, with its positions given (how MLA tiles a long prefill)
    part = readers.attend(query[:, 5:12], reader, allowed[5:12], positions=qpos[5:12])
    assert rel(part, expected[:, 5:12]) < 1e-5
    torch.testing.assert_close(
        readers.scores(query, reader),
        torch.einsum(
            "hsw,stw->hst",
            query.double(),
            torch.where(use[:, :, None], exact.double()[None], decoded_rows(reader).double()[None]),
        ).float(),
        rtol=1e-4,
        atol=1e-4,
    )
    w = torch.softmax(torch.randn(4, S, T), dim=-1)
    rows = torch.where(use[:, :, None], exact[None], decoded_rows(reader)[None])  # [S, T, 40]
    torch.testing.assert_close(
        readers.context(w, reader), torch.einsum("hst,stw->hsw", w, rows[..., :32]), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(("tier", "group"), TIERS)
@pytest.mark.parametrize("window", [1, 4, 40])
def test_decode_and_dsa_selection_match_the_reference(tier, group, window):
    T = 33
    exact = random_rows(T)
    reader = window_rows(tier, group, exact, window, T - 1, 1)
    query = torch.randn(4, 1, 40)
    qpos = torch.tensor([T - 1])
    use = exact_mask(qpos, torch.arange(T), window)
    assert (
        rel(readers.attend(query, reader, None), reference(query, exact, decoded_rows(reader), use, None))
        < 1e-5
    )
    index = torch.tensor([T - 1, 3, T - 3, 17, 0, T - 2])  # DSA's top-k, in its own order
    picked = reader.select(index)
    assert len(picked) == len(index)
    use_picked = exact_mask(qpos, index, window)
    expected = reference(query, exact[index], decoded_rows(reader)[index], use_picked, None)
    assert rel(readers.attend(query, picked, None, positions=qpos), expected) < 1e-5


def test_a_slice_of_the_queries_needs_their_positions():
    reader = window_rows("tq4", None, random_rows(20), 4, 10, 10)
    with pytest.raises(ValueError, match="needs the positions of these 3 queries"):
        readers.attend(torch.randn(2, 3, 40), reader, None)
    with pytest.raises(ValueError, match=r"positions \(2,\) for 3 queries"):
        readers.attend(torch.randn(2, 3, 40), reader, None, positions=torch.tensor([11, 12]))


# --- the cache: which exact rows it holds --------------------------------------------------


def step(cache: PackedLatentCache, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Append rows [S, 40] to every layer, attend layer 0 with causal masks, commit; -> [H, S, 32]."""
    start, S = cache.length, rows.shape[0]
    out = None
    for layer in range(LAYOUT.num_layers):
        reader = cache.append(layer, rows)
        allowed = None
        if S > 1:
            allowed = torch.arange(start + S)[None, :] <= torch.arange(start, start + S)[:, None]
        if layer == 0:
            out = readers.attend(query, reader, allowed)
    cache.commit(S)
    return out


def check_step(cache, exact: list[torch.Tensor], exact_from: int, window: int, n_new: int = 1) -> None:
    """Append n_new fresh rows; the output must equal the reference in which the rows of
    positions < exact_from are only available decoded (what the cache could no longer hold exactly)."""
    rows = random_rows(n_new)
    start = cache.length
    query = torch.randn(3, n_new, 40)
    ours = step(cache, rows, query)
    every = torch.cat([*exact, rows])[: start + n_new]
    codec_c, codec_r = cache.codec_c, cache.codec_r
    decoded = torch.cat(
        [codec_c.decode(codec_c.encode(every[:, :32])), codec_r.decode(codec_r.encode(every[:, 32:]))], 1
    )
    qpos = torch.arange(start, start + n_new)
    rpos = torch.arange(start + n_new)
    use = exact_mask(qpos, rpos, window) & (rpos >= exact_from)[None, :]
    allowed = rpos[None, :] <= qpos[:, None]
    assert rel(ours, reference(query, every, decoded, use, allowed)) < 1e-5
    exact.append(rows)


@pytest.mark.parametrize("tier", ["tq4", "tq4-r8", "fp8"])
def test_the_cache_keeps_the_last_w_rows_exact_across_passes(tier):
    window = 6
    cache = resolve_tier(LAYOUT, CacheConfig(tier, recent_window=window)).make_cache()
    assert isinstance(cache, PackedLatentCache) and cache.recent_window == window
    exact: list[torch.Tensor] = []
    for n_new in (9, 1, 1, 3, 1, 1, 1, 12, 1):
        check_step(cache, exact, exact_from=0, window=window, n_new=n_new)
    assert cache.length == 30
    assert cache.window_nbytes() == LAYOUT.num_layers * window * 40 * 4
    assert cache.nbytes() == cache.allocated_nbytes()  # the tier's rows, the window apart


@pytest.mark.parametrize(("trim_to", "exact_from"), [(30, 0), (29, 0), (25, 22), (20, 30), (3, 30)])
def test_trim_keeps_the_exact_rows_it_still_holds(trim_to, exact_from):
    """30 tokens, W = 8: the cache holds positions 22..29 exactly. After a trim, window rows older
    than 22 can only be refilled from the tier (decoded); rows from 22 on stay exact."""
    window = 8
    cache = resolve_tier(LAYOUT, CacheConfig("tq4", recent_window=window)).make_cache()
    exact: list[torch.Tensor] = []
    check_step(cache, exact, 0, window, n_new=30)
    cache.trim(trim_to)
    kept = [torch.cat(exact)[:trim_to]]
    check_step(cache, kept, exact_from=min(exact_from, trim_to), window=window)
    check_step(cache, kept, exact_from=min(exact_from, trim_to), window=window)


def test_from_state_refills_the_window_from_the_tier():
    window = 5
    cache = resolve_tier(LAYOUT, CacheConfig("tq4-r8", recent_window=window)).make_cache()
    exact: list[torch.Tensor] = []
    check_step(cache, exact, 0, window, n_new=12)
    resumed = cache.tier.from_state(cache.state())
    assert resumed.tier.name == "tq4-r8" and resumed.length == 12
    assert resumed.window_nbytes() == cache.window_nbytes()
    check_step(resumed, exact, exact_from=12, window=window)  # only the rows after the resume are exact
    check_step(resumed, exact, exact_from=12, window=window, n_new=7)


def test_no_window_is_the_plain_packed_reader():
    cache = resolve_tier(LAYOUT, CacheConfig("tq4")).make_cache()
    assert isinstance(cache.append(0, random_rows(3)), PackedRows) and cache.window_nbytes() == 0
    assert (
        resolve_tier(LAYOUT, CacheConfig("f32", recent_window=4)).make_cache().tier.recent_window == 0
    )  # f32 rows are exact


def test_config_refuses_a_negative_window():
    with pytest.raises(ConfigError, match="--kv-recent-window must be an integer from 0"):
        CacheConfig("tq4", recent_window=-1)
    with pytest.raises(ValueError, match="recent_window must be >= 0"):
        PackedLatentCache(KVTier("tq4-r8", *codecs("tq4-r8", None), LAYOUT, recent_window=-1))
