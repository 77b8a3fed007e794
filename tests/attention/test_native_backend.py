"""latentkv's CPU decode-attention kernel (native/attention.cpp) and the backend that runs it
(attention/native.py): checked against float64 attention over the rows as their codec decodes
them, and against the torch reference backend, on fresh random rows of odd shapes."""

from __future__ import annotations

import pytest
import torch

from latentkv import native
from latentkv.attention import CPU, REFERENCE, backend_for
from latentkv.attention.native import row_format
from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import CacheLayout, PackedRows, resolve_tier
from latentkv.kv.codecs import get_codec

SERVED = ("bf16", "q8_0", "q8s", "q4_0", "q4s")

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or kernels.isa < 1,
    reason="latentkv's CPU kernels are not built here, or this process runs plain C++ (the backend then refuses)",
)
# the kernel's vector paths this process can run: its own, and AVX2 (1) below AVX-512's
PATHS = sorted({kernels.isa, 1} if kernels is not None and kernels.isa >= 1 else set(), reverse=True)


def packed(name: str, n_c: int, n_r: int, T: int, gen: torch.Generator, scale: float = 1.0) -> PackedRows:
    """T random rows [c | r] stored by `name`'s codecs (blocks of 32, or of 8 for an 8-wide rope key)."""
    codec_c = get_codec(name, n_c)
    codec_r = get_codec(name, n_r)
    rows = torch.randn(T, n_c + n_r, generator=gen) * scale
    rows[:, 3] += 4.0  # an outlier channel, as latent rows have
    return PackedRows(codec_c.encode(rows[:, :n_c]), codec_r.encode(rows[:, n_c:]), codec_c, codec_r)


def float64_attention(
    query: torch.Tensor, reader: PackedRows, index: torch.Tensor | None = None
) -> torch.Tensor:
    """query [H, W] over the rows as decoded (those at index) -> [H, n_c], in float64."""
    rows = reader.decoded().double()
    if index is not None:
        rows = rows[index]
    weights = torch.softmax(query.double() @ rows.T, dim=-1)
    return weights @ rows[:, : reader.codec_c.width]


def run(query: torch.Tensor, reader: PackedRows, index: torch.Tensor | None = None, isa: int | None = None):
    path = kernels if isa is None else native.with_isa(isa)
    return path.mla_decode(
        query,
        reader.c.codes,
        reader.r.codes,
        index,
        row_format(reader.codec_c),
        row_format(reader.codec_r),
        reader.codec_r.width,
    )


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize(
    "H,n_c,n_r,T",
    [(1, 64, 16, 1), (5, 96, 32, 7), (17, 128, 32, 300), (64, 512, 64, 1030), (4, 32, 8, 13)],
)
def test_kernel_matches_float64_attention_over_the_decoded_rows(name, H, n_c, n_r, T, isa):
    gen = torch.Generator().manual_seed(hash((name, H, n_c, T)) % 2**31)
    reader = packed(name, n_c, n_r, T, gen)
    query = torch.randn(H, n_c + n_r, generator=gen) * 0.3  # scores of a few units: a peaked softmax
    want = float64_attention(query, reader)
    got = run(query, reader, isa=isa)
    assert got.shape == (H, n_c) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", ("bf16", "q4s"))
def test_kernel_reads_only_the_selected_rows(name, isa):
    gen = torch.Generator().manual_seed(7)
    reader = packed(name, 128, 32, 500, gen)
    query = torch.randn(6, 160, generator=gen) * 0.3
    index = torch.randperm(500, generator=gen)[:77]
    want = float64_attention(query, reader, index)
    got = run(query, reader, index, isa=isa)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())
    assert (got - run(query, reader)).abs().max() > 1e-3  # the selection changes the answer


@pytest.mark.parametrize("isa", PATHS)
def test_kernel_is_deterministic_across_thread_counts(isa):
    gen = torch.Generator().manual_seed(3)
    reader = packed("bf16", 512, 64, 700, gen)
    query = torch.randn(64, 576, generator=gen) * 0.1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(query, reader, isa=isa)
        torch.set_num_threads(max(2, threads))
        many = run(query, reader, isa=isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_kernel_refuses_bad_input_with_a_clear_error():
    gen = torch.Generator().manual_seed(5)
    reader = packed("q8s", 64, 16, 10, gen)
    query = torch.randn(2, 80, generator=gen)
    fmt_c, fmt_r = row_format(reader.codec_c), row_format(reader.codec_r)
    with pytest.raises(RuntimeError, match="index 10 outside the 10 rows"):
        run(query, reader, torch.tensor([0, 10]))
    with pytest.raises(RuntimeError, match="stores 64 values in 68"):
        kernels.mla_decode(query, reader.c.codes[:, :-2], reader.r.codes, None, fmt_c, fmt_r, 16)
    with pytest.raises(RuntimeError, match="isa 0"):
        torch.ops.latentkv.mla_decode(query, reader.c.codes, reader.r.codes, None, *fmt_c, 16, *fmt_r, 0)
    with pytest.raises(RuntimeError, match="no rows"):
        run(query, reader, torch.zeros(0, dtype=torch.int64))


LAYOUT = CacheLayout(1, 576, 512, (), 0, torch.device("cpu"))


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_the_backend_serves_the_tiers_it_has_a_kernel_for(name):
    tier = resolve_tier(LAYOUT, CacheConfig(name))
    reason = CPU.refuse(tier, torch.device("cpu"))
    if name in SERVED:
        assert reason is None and backend_for(tier, torch.device("cpu")) is CPU
    else:
        assert reason is not None and backend_for(tier, torch.device("cpu")) is not CPU
    assert CPU.refuse(tier, torch.device("meta")) == "runs on the CPU (not meta)"


def test_the_backend_refuses_a_recent_window_and_a_plain_cpu(monkeypatch):
    windowed = resolve_tier(LAYOUT, CacheConfig("q4s", recent_window=64))
    assert "recent window" in CPU.refuse(windowed, torch.device("cpu"))
    monkeypatch.setattr(native, "kernels", lambda: native.Kernels(0, 0))  # ATEN_CPU_CAPABILITY=default
    tier = resolve_tier(LAYOUT, CacheConfig("bf16"))
    assert (
        CPU.refuse(tier, torch.device("cpu"))
        == "needs AVX2 or AVX-512 (this process runs the plain C++ path)"
    )


@pytest.mark.parametrize("name", SERVED)
def test_the_backend_matches_the_torch_reference(name):
    gen = torch.Generator().manual_seed(11)
    reader = packed(name, 512, 64, 333, gen)
    query = torch.randn(8, 1, 576, generator=gen) * 0.2  # [H, S=1, W]
    want = REFERENCE.attend(query, reader, None, None)
    got = CPU.attend(query, reader, None, None)
    assert got.shape == want.shape == (8, 1, 512)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())
    # a prefill's queries and a masked read go to the reference, unchanged
    queries = torch.randn(8, 3, 576, generator=gen) * 0.2
    allowed = torch.rand(3, 333, generator=gen) > 0.3
    assert torch.equal(
        CPU.attend(queries, reader, allowed, None), REFERENCE.attend(queries, reader, allowed, None)
    )


def test_a_batch_reads_each_sequence_as_alone():
    gen = torch.Generator().manual_seed(13)
    readers = [packed("q8s", 128, 32, T, gen) for T in (40, 17, 33)]
    query = torch.randn(4, 3, 160, generator=gen) * 0.3  # [H, B, W]
    blocked = torch.zeros(3, 40, dtype=torch.bool)
    blocked[0, 5:9] = True  # a masked-out span of the first sequence
    blocked[1, 17:] = True  # past the second one's end
    blocked[2, 33:] = True
    got = CPU.attend_batch(query, readers, blocked)
    index = (~blocked[0]).nonzero().squeeze(1)
    assert torch.equal(got[:, 0], run(query[:, 0].contiguous(), readers[0], index))
    assert torch.equal(got[:, 1:2], CPU.attend(query[:, 1:2], readers[1], None, None))
    want = REFERENCE.attend_batch(query, readers, blocked)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())


def test_a_call_past_the_score_bound_goes_to_the_reference(monkeypatch):
    from latentkv.attention import native as backend

    gen = torch.Generator().manual_seed(17)
    reader = packed("q4s", 64, 16, 50, gen)
    query = torch.randn(4, 1, 80, generator=gen) * 0.3
    calls = []
    real = backend.CpuDecode._decode
    monkeypatch.setattr(backend.CpuDecode, "_decode", lambda self, *a: calls.append(1) or real(self, *a))
    CPU.attend(query, reader, None, None)
    assert calls == [1]
    monkeypatch.setattr(backend, "MAX_SCORES", 4 * 50 - 1)  # 50 rows x 4 heads: one value too many
    assert torch.equal(CPU.attend(query, reader, None, None), REFERENCE.attend(query, reader, None, None))
    assert calls == [1]
