"""RoPE (default and YaRN) against transformers' own functions; the rotation and RMSNorm in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from latentkv.config import ModelConfig
from latentkv.models import layers
from latentkv.models.layers import RMSNorm, Rope, RotaryTables, rope_inv_freq, softmax_scale

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    n_routed_experts=4,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=16,
    v_head_dim=8,
    max_position_embeddings=8192,
)

YARN_CASES = {
    "dsv3-tiny": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "deepseek-v3": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "mscale-ratio": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.2,
        "mscale_all_dim": 0.8,
    },
    "no-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 512,
    },
    "attention-factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "attention_factor": 0.9,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "no-truncate": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
}


def _hf_config(rope_parameters: dict):
    return transformers.DeepseekV3Config(**SHAPE, rope_parameters=dict(rope_parameters))


def _ours(hf_config) -> ModelConfig:
    import json

    return ModelConfig.from_hf(json.loads(hf_config.to_json_string()))


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_inv_freq_and_attention_factor_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = _hf_config(YARN_CASES[case])
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    cfg = _ours(hf_config)
    got_freq, got_factor = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    assert got_freq.shape == want_freq.shape == (SHAPE["qk_rope_head_dim"] // 2,)
    torch.testing.assert_close(got_freq.float(), want_freq.float(), rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("case", ["default", *YARN_CASES])
def test_cos_sin_tables_match_transformers_rotary_embedding(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 10000.0} if case == "default" else YARN_CASES[case]
    hf_config = _hf_config(params)
    cfg = _ours(hf_config)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 5000])
    tables = Rope(cfg.rope, cfg.qk_rope_head_dim, torch.device("cpu")).tables(0, 5001)
    cos, sin = tables.cos[positions], tables.sin[positions]
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_config)(torch.zeros(1), positions[None])
    half = cfg.qk_rope_head_dim // 2  # transformers repeats the table: [cos | cos]
    torch.testing.assert_close(cos, hf_cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, hf_sin[0, :, :half], rtol=0, atol=2e-6)


@pytest.mark.parametrize("case", ["default", *YARN_CASES])
def test_softmax_scale_matches_transformers_attention(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    params = {"rope_type": "default", "rope_theta": 10000.0} if case == "default" else YARN_CASES[case]
    hf_config = _hf_config(params)
    cfg = _ours(hf_config)
    want = DeepseekV3Attention(hf_config, layer_idx=0).scaling
    assert softmax_scale(cfg.rope, cfg.qk_head_dim) == pytest.approx(want, rel=1e-12)


def test_rope_tables_grow_without_changing_earlier_rows():
    cfg = _ours(_hf_config(YARN_CASES["deepseek-v3"]))
    rope = Rope(cfg.rope, cfg.qk_rope_head_dim, torch.device("cpu"))
    early = rope.tables(0, 10)
    early_cos, early_sin = early.cos.clone(), early.sin.clone()
    late = rope.tables(3000, 1)
    again = rope.tables(0, 10)
    assert torch.equal(early_cos, again.cos) and torch.equal(early_sin, again.sin)
    assert late.cos.shape == (1, cfg.qk_rope_head_dim // 2)
    assert torch.equal(rope.tables(2995, 8).cos[5], late.cos[0])


def test_fixed_rope_tables_equal_grown_ones_and_are_not_marked_dynamic():
    """`Rope.fix` (the compiled step's tables): exactly n rows, bit for bit the rows grown tables
    hold, no dynamic-size mark (the compiled graph takes their size as a constant); a position
    past them (an MTP draft past the last) fixes longer tables, never marked either."""
    cfg = _ours(_hf_config(YARN_CASES["deepseek-v3"]))
    grown = Rope(cfg.rope, cfg.qk_rope_head_dim, torch.device("cpu"))
    fixed = Rope(cfg.rope, cfg.qk_rope_head_dim, torch.device("cpu"))
    fixed.tables(0, 300)  # grown and marked first, as a prefill before compiling does
    fixed.fix(1000)
    assert fixed._cos.shape[0] == 1000 and not hasattr(fixed._cos, "_dynamo_weak_dynamic_indices")
    want = grown.tables(0, 1000)
    got = fixed.tables(0, 1000)
    assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)
    assert fixed._cos.shape[0] == 1000  # reading within them changes nothing
    late = fixed.tables(1000, 2)
    assert fixed._cos.shape[0] == 2000 and not hasattr(fixed._cos, "_dynamo_weak_dynamic_indices")
    assert torch.equal(late.cos, grown.tables(1000, 2).cos)


def _rotate64(x: torch.Tensor, angle: torch.Tensor, d: int, interleaved: bool) -> torch.Tensor:
    """Float64 reference: rotate each pair of the first d values by its angle; the output is laid
    out pair-split ([first of each pair | second of each pair]) and values past d pass through."""
    x = x.double()
    half = d // 2
    idx = torch.arange(half)
    a_idx, b_idx = (2 * idx, 2 * idx + 1) if interleaved else (idx, idx + half)
    a, b = x[..., a_idx], x[..., b_idx]
    shape = (angle.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = angle.cos().view(shape), angle.sin().view(shape)
    return torch.cat([a * c - b * s, b * c + a * s, x[..., d:]], dim=-1)


# S <= MATMUL_ROPE_MAX_POSITIONS rotates by matmul, longer passes elementwise: both paths.
@pytest.mark.parametrize(
    "S", [1, 5, layers.MATMUL_ROPE_MAX_POSITIONS, layers.MATMUL_ROPE_MAX_POSITIONS + 1, 40]
)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(), (3,)], ids=["no-heads", "heads"])
@pytest.mark.parametrize("width", [16, 24], ids=["rope-only", "with-pass-through"])
def test_rotation_against_float64(S, interleaved, shape, width):
    d = 16
    g = torch.Generator().manual_seed(S)
    x = torch.randn(S, *shape, width, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    start = 1234
    angle = torch.arange(start, start + S).double()[:, None] * inv_freq[None, :]  # [S, d/2]
    tables = RotaryTables(angle.cos().float(), angle.sin().float())
    got = tables.rotate(x, interleaved)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), _rotate64(x, angle, d, interleaved), rtol=0, atol=2e-6)


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("offset", [0, 5, 8])
def test_rotation_at_an_offset_against_float64(S, interleaved, offset):
    """Decode's absorbed query rotates the rope part after the latent part: [pass | rope | pass]."""
    d, width = 8, 20
    g = torch.Generator().manual_seed(offset)
    x = torch.randn(S, 3, width, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    angle = torch.arange(77, 77 + S).double()[:, None] * inv_freq[None, :]
    tables = RotaryTables(angle.cos().float(), angle.sin().float())
    got = tables.rotate(x, interleaved, offset=offset)
    want = torch.cat([x[..., :offset].double(), _rotate64(x[..., offset:], angle, d, interleaved)], dim=-1)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("width, offset", [(8, 0), (20, 0), (20, 5), (20, 12)])
def test_rotation_matrix_is_the_spelled_out_matrix_bit_for_bit(S, interleaved, width, offset):
    """`RotaryTables.matrix` (made in one op per pass from a cached pattern) holds exactly the
    table's cos / -sin / sin values where the rotation puts them, 1 on the pass-through diagonal
    and 0 elsewhere; a [S, n, width] input (no views around the product) and a [S, width] one
    rotate to the bits of the product as it was spelled out before."""
    half = 4
    g = torch.Generator().manual_seed(S * 100 + width + offset)
    cos, sin = torch.randn(S, half, generator=g), torch.randn(S, half, generator=g)
    want = torch.zeros(S, width, width)
    for s in range(S):
        for j in [*range(offset), *range(offset + 2 * half, width)]:
            want[s, j, j] = 1.0
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            a, b, lo, hi = a + offset, b + offset, i + offset, i + half + offset
            want[s, a, lo], want[s, b, lo] = cos[s, i], -sin[s, i]
            want[s, b, hi], want[s, a, hi] = cos[s, i], sin[s, i]
    tables = RotaryTables(cos, sin)
    got = tables.matrix(interleaved, width, offset)
    assert torch.equal(got, want) and not torch.equal(want, torch.zeros_like(want))
    x = torch.randn(S, 3, width, generator=g)
    three = tables.rotate(x, interleaved, offset)
    assert torch.equal(three, torch.matmul(x.reshape(S, -1, width), want).view(x.shape))
    flat = x[:, 0].contiguous()
    assert torch.equal(
        tables.rotate(flat, interleaved, offset),
        torch.matmul(flat.reshape(S, -1, width), want).view(S, width),
    )


def test_rotation_at_an_offset_refuses_what_it_cannot_do():
    angle = torch.zeros(layers.MATMUL_ROPE_MAX_POSITIONS + 1, 4)
    with pytest.raises(ValueError, match="offset"):
        RotaryTables(angle.cos(), angle.sin()).rotate(torch.randn(angle.shape[0], 12), True, offset=2)
    with pytest.raises(ValueError, match="cannot rotate"):
        RotaryTables(angle[:1].cos(), angle[:1].sin()).rotate(torch.randn(1, 12), True, offset=6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_keeps_relative_position_dot_products(interleaved):
    """q.k after rotation depends only on the position difference (what attention relies on)."""
    d = 8
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g)
    rope = Rope(
        _ours(_hf_config({"rope_type": "default", "rope_theta": 10000.0})).rope, d, torch.device("cpu")
    )

    def rot(x, p):
        return rope.tables(p, 1).rotate(x, interleaved)

    base = (rot(q, 5) * rot(k, 2)).sum()
    shifted = (rot(q, 105) * rot(k, 102)).sum()
    assert base.item() == pytest.approx(shifted.item(), abs=1e-5)


@pytest.mark.parametrize("D", [8, 32, 256, 6144])
def test_rms_norm_of_one_row_is_the_concat_form_bit_for_bit(D):
    """Decode's one-row RMSNorm ([x, -x] made by one multiply) gives the bytes of the [x, -x]
    concat that more rows take, over fresh random rows of several scales."""
    g = torch.Generator().manual_seed(D)
    w = torch.randn(D, generator=g)
    norm = RMSNorm(w, 1e-5)
    for _ in range(20):
        x = torch.randn(1, D, generator=g) * 10 ** float(torch.randn(1, generator=g))
        spelled = F.layer_norm(torch.cat([x, -x], dim=-1), (2 * D,), torch.cat([w, w]), None, 1e-5)[:, :D]
        got = norm(x)
        assert got.shape == (1, D) and torch.equal(got, spelled)
        assert torch.equal(norm(torch.cat([x, x]))[1:], spelled)  # two rows: the concat form itself


def test_rms_norm_against_float64():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 24, generator=g) * 3, torch.randn(24, generator=g)
    x64 = x.double()
    want = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(RMSNorm(w, 1e-6)(x).double(), want, rtol=2e-6, atol=2e-6)


def test_yarn_mscale_formula():
    """DeepSeek's mscale: 0.1 * m * ln(factor) + 1, squared into the softmax scale when mscale_all_dim."""
    cfg = _ours(_hf_config(YARN_CASES["deepseek-v3"]))
    m = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert softmax_scale(cfg.rope, 24) == pytest.approx(24**-0.5 * m * m, rel=1e-12)


@pytest.mark.parametrize("width", [8, 24, 512, 6144])
@pytest.mark.parametrize("rows", [1, 7])
def test_rmsnorm_layernorm_form_against_float64(width, rows):
    """The model's RMSNorm (a LayerNorm of [x, -x]) equals the textbook formula in float64."""
    x = torch.randn(rows, width) * torch.exp(torch.randn(rows, 1))  # rows of varied scale
    w = torch.randn(width)
    x64 = x.double()
    want = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5) * w.double()
    got = RMSNorm(w, 1e-5)(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
