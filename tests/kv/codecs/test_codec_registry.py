"""Every codec through the registry: sizes, distortion, inert rows, determinism, refusals."""

from __future__ import annotations

import pytest
import torch

from latentkv.kv.codecs import CODEC_NAMES, EncodedRows, get_codec

QUANTIZED = [name for name in CODEC_NAMES if name not in ("f32", "bf16")]

# bytes per token per layer for a GLM-5 / DeepSeek-V3 latent: c (512) + r (64), scales included
BYTES_512_64 = {"f32": 2304, "bf16": 1152, "fp8": 584, "tq4": 296, "tq3": 224, "polar4": 260}

# mean relative L2 error on Gaussian rows of width 512: the ceilings
MAX_REL_L2 = {
    "fp8": 0.03,
    "tq6": 0.03,
    "tq5": 0.055,
    "tq4": 0.10,
    "tq3": 0.19,
    "tq2": 0.35,
    "polar4": 0.16,
}


def rel_l2(codec_name: str, x: torch.Tensor) -> float:
    codec = get_codec(codec_name, x.shape[1])
    out = codec.decode(codec.encode(x))
    return ((out - x).norm(dim=1) / x.norm(dim=1)).mean().item()


def test_names():
    expected = ["f32", "bf16", "fp8"] + [f"tq{b}" for b in range(2, 7)] + [f"polar{b}" for b in range(2, 7)]
    expected += [
        "q8_0",
        "q5_0",
        "q4_0",
        "q4_1",
        "hq8_0",
        "hq5_0",
        "hq4_0",
        "hq4_1",
        "q8s",
        "q5s",
        "q4s",
        "wq4",
    ]
    assert list(CODEC_NAMES) == expected


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="int4.*f32, bf16, fp8, tq2.*polar6"):
        get_codec("int4", 512)


@pytest.mark.parametrize("name", [n for n in CODEC_NAMES if n.startswith(("tq", "polar"))])
@pytest.mark.parametrize("width", [576, 96, 3])
def test_rotated_codecs_refuse_non_power_of_two_widths(name, width):
    with pytest.raises(ValueError, match=f"{name}.*{width}.*fp8"):
        get_codec(name, width)


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_the_identity_codecs_take_no_group_size(name):
    with pytest.raises(ValueError, match=r"group size applies to fp8, tq\* and polar\* only, not to " + name):
        get_codec(name, 64, group_size=16)


@pytest.mark.parametrize("name", [n for n in CODEC_NAMES if n.startswith(("tq", "polar"))])
def test_rotated_codecs_take_a_group_size_that_divides_the_width(name):
    codec = get_codec(name, 64, group_size=16)
    assert codec.params()["group_size"] == 16 and codec.scale_count == 4
    assert "group_size" not in get_codec(name, 64).params()  # per-row params unchanged (old files match)
    with pytest.raises(ValueError, match=f"{name} group size 24 must divide the row width 64"):
        get_codec(name, 64, group_size=24)


@pytest.mark.parametrize("name", list(BYTES_512_64))
def test_bytes_per_token_per_layer(name):
    c, r = get_codec(name, 512), get_codec(name, 64)
    assert c.bytes_per_row + r.bytes_per_row == BYTES_512_64[name]


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("width", [8, 64, 512])
def test_encoded_shapes_match_the_declared_sizes(name, width):
    codec = get_codec(name, width)
    enc = codec.encode(torch.randn(7, width))
    assert enc.codes.shape == (7, codec.code_bytes) and enc.codes.dtype == torch.uint8
    assert enc.scales.shape == (7, codec.scale_count) and enc.scales.dtype == torch.float32
    assert codec.bytes_per_row == codec.code_bytes + 4 * codec.scale_count
    out = codec.decode(enc)
    assert out.shape == (7, width) and out.dtype == torch.float32
    assert (
        codec.decode(codec.empty(3, device=torch.device("cpu"))).abs().sum() == 0
    )  # preallocated rows read as zeros


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_params_name_what_changes_the_bytes(name):
    params = get_codec(name, 64).params()
    assert params["name"] == name and params["width"] == 64
    if name.startswith(("tq", "polar")):
        assert params["rotation_seed"] == 0x9E3779B9 and params["bits"] == int(name[-1])
        other = get_codec(name, 64, seed=7)
        assert other.params()["rotation_seed"] == 7
        x = torch.randn(4, 64)
        assert not torch.equal(other.encode(x).codes, get_codec(name, 64).encode(x).codes)
    if name == "fp8":
        assert params["group_size"] is None
        assert get_codec("fp8", 64, group_size=16).params()["group_size"] == 16


def test_f32_round_trips_every_bit():
    x = torch.randn(9, 64)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -0.0
    out = get_codec("f32", 64).decode(get_codec("f32", 64).encode(x))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


def test_bf16_is_the_torch_cast():
    x = torch.randn(9, 64)
    codec = get_codec("bf16", 64)
    assert torch.equal(codec.decode(codec.encode(x)), x.to(torch.bfloat16).float())


def test_encode_does_not_alias_its_input():
    x = torch.randn(2, 64)
    enc = get_codec("f32", 64).encode(x)
    x.zero_()
    assert get_codec("f32", 64).decode(enc).abs().sum() > 0


@pytest.mark.parametrize("name", QUANTIZED)
def test_deterministic(name):
    x = torch.randn(16, 64)
    codec = get_codec(name, 64)
    a, b = codec.encode(x), get_codec(name, 64).encode(x.clone())
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("width", [64, 512])
def test_inert_rows_decode_to_zeros(name, width):
    codec = get_codec(name, width)
    x = torch.randn(6, width)
    x[0] = 0.0
    x[1] = float("nan")
    x[2, 5] = float("nan")
    x[3] = float("inf")
    x[4, 9] = -float("inf")
    out = codec.decode(codec.encode(x))
    assert torch.isfinite(out).all()
    assert not out[:5].any()
    assert out[5].abs().sum() > 0


def test_mean_relative_l2_on_gaussian_rows():
    x = torch.randn(4096, 512)  # fresh rows every run
    measured = {name: rel_l2(name, x) for name in MAX_REL_L2}
    over = {name: round(err, 4) for name, err in measured.items() if err > MAX_REL_L2[name]}
    assert not over, f"over the ceiling: {over} (all: {measured})"


def test_more_bits_less_error():
    x = torch.randn(512, 512)
    for family in ("tq", "polar"):
        errors = [rel_l2(f"{family}{b}", x) for b in range(2, 7)]
        assert all(a > 1.7 * b for a, b in zip(errors, errors[1:], strict=False)), (family, errors)
    assert rel_l2("bf16", x) < 0.003


def test_encoded_rows_slicing_and_selection():
    codec = get_codec("tq4", 64)
    x = torch.randn(10, 64)
    enc = codec.encode(x)
    assert len(enc) == 10
    assert torch.equal(codec.decode(enc.rows(2, 5)), codec.decode(enc)[2:5])
    index = torch.tensor([7, 1, 1])
    assert torch.equal(codec.decode(enc.select(index)), codec.decode(enc)[index])
    both = EncodedRows.cat([enc.rows(0, 4), enc.rows(4, 10)])
    assert torch.equal(both.codes, enc.codes) and torch.equal(both.scales, enc.scales)


def test_bad_inputs_are_refused():
    codec = get_codec("fp8", 64)
    with pytest.raises(ValueError, match="width 64"):
        codec.encode(torch.randn(3, 32))
    with pytest.raises(ValueError, match="float32"):
        codec.encode(torch.randn(3, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="code bytes"):
        codec.decode(get_codec("fp8", 32).encode(torch.randn(3, 32)))
