"""The Triton backend: what it serves (CUDA only; every tier but polar*), that the CPU keeps the
torch reference, and its readers-to-kernel mapping (run here under the interpreter on CPU readers
of real caches, against the torch reference given the same readers)."""

from __future__ import annotations

import pytest
import torch

from latentkv.attention import CPU, REFERENCE, TRITON, TritonDecode, backend_for
from latentkv.config import KV_CACHE_DTYPES, CacheConfig
from latentkv.kv.cache import CacheLayout, resolve_tier

pytest.importorskip("triton")

N_C, N_R, H = 64, 16, 5
LAYOUT = CacheLayout(
    num_layers=1,
    row_width=N_C + N_R,
    kv_lora_rank=N_C,
    index_layers=(),
    index_head_dim=0,
    device=torch.device("cpu"),
)
CUDA = torch.device("cuda")  # a device name only: refuse() never touches the CUDA runtime
EXACT = TritonDecode(precision="ieee")  # float32 products, as the reference: a tight comparison


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_serves_cuda_for_every_tier_but_polar(name):
    tier = resolve_tier(LAYOUT, CacheConfig(name))
    reason = TRITON.refuse(tier, CUDA)
    if "polar" in name:
        assert "polar" in reason and "no Triton decode kernel" in reason
        assert backend_for(tier, CUDA) is REFERENCE
    else:
        assert reason is None
        assert backend_for(tier, CUDA) is TRITON


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_the_cpu_is_not_triton_s(name):
    tier = resolve_tier(LAYOUT, CacheConfig(name))
    assert TRITON.refuse(tier, torch.device("cpu")) == "needs a CUDA device (not cpu)"
    served = CPU.refuse(tier, torch.device("cpu")) is None  # latentkv's CPU kernel (test_native_backend.py)
    assert backend_for(tier, torch.device("cpu")) is (CPU if served else REFERENCE)


def readers(tier: str, lengths, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv = resolve_tier(LAYOUT, CacheConfig(kv_cache_dtype=tier))
    out = []
    for T in lengths:
        cache = kv.make_cache()
        out.append(cache.append(0, torch.randn(T, N_C + N_R, generator=gen)))
        cache.commit(T)
    return out


def query(B: int, seed: int) -> torch.Tensor:
    return 0.3 * torch.randn(H, B, N_C + N_R, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= 2e-5 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("tier", ["f32", "fp8", "q4s", "tq4-r8"])
def test_batch_of_ragged_caches_with_a_mask(tier):
    rs = readers(tier, (30, 9, 17), seed=1)
    q = query(3, seed=2)
    T = 30
    ends = torch.tensor([30, 9, 17])
    padding = torch.arange(T)[None, :] >= ends[:, None]  # [B, T]: what batched decode passes
    close(EXACT.attend_batch(q, rs, padding), REFERENCE.attend_batch(q, rs, padding))
    dsa = padding | (torch.rand(3, T, generator=torch.Generator().manual_seed(3)) < 0.5)  # a top-k choice
    dsa[:, 0] = False
    close(EXACT.attend_batch(q, rs, dsa), REFERENCE.attend_batch(q, rs, dsa))
    same = readers(tier, (12, 12), seed=4)
    close(EXACT.attend_batch(query(2, 5), same, None), REFERENCE.attend_batch(query(2, 5), same, None))


def test_one_sequence_decode_runs_the_kernel_and_prefill_the_reference():
    (r,) = readers("q8s", (21,), seed=6)
    q = query(1, seed=7)
    close(EXACT.attend(q, r, None, torch.tensor([20])), REFERENCE.attend(q, r, None, torch.tensor([20])))
    many = query(3, seed=8)  # three queries of a prefill: the reference, exactly
    allowed = torch.ones(3, 21, dtype=torch.bool)
    assert torch.equal(EXACT.attend(many, r, allowed, None), REFERENCE.attend(many, r, allowed, None))


def test_padded_rows_of_a_slot_pool():
    gen = torch.Generator().manual_seed(9)
    rows = torch.randn(2, 14, N_C + N_R, generator=gen)
    rows[1, 10:] = 0  # past the second sequence's end
    blocked = torch.zeros(2, 14, dtype=torch.bool)
    blocked[1, 10:] = True
    q = query(2, seed=10)
    close(EXACT.attend_padded(q, rows, blocked, N_C), REFERENCE.attend_padded(q, rows, blocked, N_C))
    close(EXACT.attend_padded(q, rows, None, N_C), REFERENCE.attend_padded(q, rows, None, N_C))


def test_a_recent_window_goes_to_the_reference():
    kv = resolve_tier(LAYOUT, CacheConfig(kv_cache_dtype="fp8", recent_window=4))
    cache = kv.make_cache()
    r = cache.append(0, torch.randn(10, N_C + N_R))
    q = query(1, seed=11)
    pos = torch.tensor([9])
    assert torch.equal(EXACT.attend(q, r, None, pos), REFERENCE.attend(q, r, None, pos))


def test_refuses_resolved_tiers_by_their_codecs_and_window():
    assert EXACT.refuse(resolve_tier(LAYOUT, CacheConfig(kv_cache_dtype="q4s")), CUDA) is None
    polar = EXACT.refuse(resolve_tier(LAYOUT, CacheConfig(kv_cache_dtype="polar4-r8")), CUDA)
    assert "polar4" in polar and "no Triton decode kernel" in polar
    windowed = resolve_tier(LAYOUT, CacheConfig(kv_cache_dtype="fp8", recent_window=8))
    assert "recent window" in EXACT.refuse(windowed, CUDA)
