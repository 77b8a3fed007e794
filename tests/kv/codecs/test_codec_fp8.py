"""fp8 e4m3: bit-exact against ml_dtypes under our rules, the decode table, scales, inert rows."""

from __future__ import annotations

import ml_dtypes  # a dev dependency: a missing install must fail, not skip
import numpy as np
import pytest
import torch

from latentkv.kv.codecs import Fp8Codec, get_codec
from latentkv.kv.codecs.fp8 import E4M3_MAX, e4m3_encode, e4m3_table


def reference_encode(v: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' float32 -> e4m3fn bytes after our rules: NaN -> 0, beyond +-448 (inf too) -> +-448."""
    a = v.numpy().astype(np.float32, copy=True)
    a[np.isnan(a)] = 0.0
    a = np.clip(a, -E4M3_MAX, E4M3_MAX)
    return torch.from_numpy(a.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy())


def assert_same_bytes(v: torch.Tensor) -> None:
    ours, ref = e4m3_encode(v), reference_encode(v)
    bad = (ours != ref).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(
            f"{bad.numel()} mismatches; first: {v[i].item()!r} -> ours {int(ours[i]):#04x}, "
            f"ml_dtypes {int(ref[i]):#04x}"
        )


def test_every_bf16_bit_pattern():
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)  # wraps to every 16-bit pattern
    assert_same_bytes(patterns.view(torch.bfloat16).to(torch.float32))


def random_float32(count: int) -> torch.Tensor:
    """A million-ish values that stress every corner of the conversion (fresh each run)."""
    k = count // 6
    raw_bits = torch.randint(-(2**31), 2**31, (k,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    sign = torch.where(torch.rand(k) < 0.5, -1.0, 1.0)
    log_uniform = sign * torch.exp2(torch.empty(k).uniform_(-14, 10))  # e4m3 subnormals .. past 448
    subnormal = sign * torch.rand(k) * 2.0**-6
    # Midpoints between neighbouring e4m3 values and one float32 ulp either side: ties decide RNE.
    table = e4m3_table()[:0x7F].to(torch.float64)
    mids = ((table[1:] + table[:-1]) / 2).to(torch.float32)
    mid = mids[torch.randint(0, mids.numel(), (k,))]
    ties = torch.cat([mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(1e9))])
    ties = ties * torch.where(torch.rand(3 * k) < 0.5, -1.0, 1.0)
    edge = torch.tensor([448.0, 464.0, 480.0, 2.0**-6, 2.0**-9, 2.0**-10, 1e-45, 3.4e38], dtype=torch.float32)
    edges = torch.cat(
        [edge, torch.nextafter(edge, torch.tensor(0.0)), torch.nextafter(edge, torch.tensor(1e39))]
    )
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan")])
    return torch.cat([raw_bits, log_uniform, subnormal, ties, edges, -edges, specials])


def test_a_million_random_float32():
    values = random_float32(1_000_000)
    assert values.numel() >= 1_000_000
    assert_same_bytes(values)


def test_rules_on_special_values():
    v = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -500.0, 448.0, 2.0**-10, -0.0])
    assert e4m3_encode(v).tolist() == [0x00, 0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x00, 0x80]


def test_decode_table_matches_ml_dtypes_with_nan_as_zero():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ref[np.isnan(ref)] = 0.0
    assert torch.equal(e4m3_table(), torch.from_numpy(ref))
    assert e4m3_table()[0x7E] == 448.0 and e4m3_table()[0x01] == 2.0**-9


def test_codec_scales_rows_by_amax():
    x = torch.randn(64, 512) * torch.exp(torch.randn(64, 1) * 3)  # rows of very different scale
    enc = get_codec("fp8", 512).encode(x)
    amax = x.abs().amax(dim=1)
    assert torch.equal(enc.scales[:, 0], amax / 448.0)
    assert torch.equal(enc.codes, reference_encode(x / enc.scales).view(64, 512))
    assert (enc.codes & 0x7F).max() == 0x7E  # the largest value of each row lands on 448


def test_inert_rows_decode_to_zero_with_scale_one():
    codec = get_codec("fp8", 64)
    x = torch.randn(5, 64)
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 1e-36
    enc = codec.encode(x)
    assert enc.scales[:4, 0].tolist() == [1.0] * 4
    assert not enc.codes[:4].any()
    out = codec.decode(enc)
    assert not out[:4].any() and torch.isfinite(out).all()
    assert (out[4] - x[4]).norm() / x[4].norm() < 0.05


def test_grouped_scales():
    codec = get_codec("fp8", 512, group_size=64)
    assert (codec.scale_count, codec.bytes_per_row) == (8, 512 + 32)
    x = torch.randn(32, 512)
    x[:, :64] *= 1e-3  # a quiet group keeps its precision under its own scale
    x[5, 70] = float("nan")  # poisons only its own group
    enc = codec.encode(x)
    assert torch.equal(enc.scales[:, 0], x[:, :64].abs().amax(dim=1) / 448.0)
    out = codec.decode(enc)
    assert enc.scales[5, 1] == 1.0 and not out[5, 64:128].any()
    rel = (out[:, :64] - x[:, :64]).norm() / x[:, :64].norm()
    assert rel < 0.04 and torch.isfinite(out).all()


@pytest.mark.parametrize("group_size", [0, 3, 48, 1024])
def test_group_size_must_divide_width(group_size):
    with pytest.raises(ValueError, match="group size"):
        Fp8Codec(512, group_size=group_size)
