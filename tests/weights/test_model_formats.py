"""--weight-dtype and --expert-dtype through loading and the CLI: dense matrices and routed experts
in their own formats, norms and router float32, the kernel said at start."""

import torch

from latentkv.cli import main
from latentkv.experts.base import Expert
from latentkv.models.weights import load_model
from latentkv.weights.bf16 import Bf16Linear
from latentkv.weights.int4 import Int4Linear
from latentkv.weights.int8 import Int8Linear


def _experts(model) -> list[Expert]:
    return [e for b in model.blocks if hasattr(b.mlp, "experts") for e in b.mlp.experts.experts]


def test_dense_and_experts_take_their_own_formats(tiny_dir):
    model = load_model(tiny_dir, "int8", expert_dtype="int4", device="cpu")
    experts = _experts(model)
    assert experts and all(
        isinstance(e.gate_up, Int4Linear) and isinstance(e.down, Int4Linear) for e in experts
    )
    assert all(isinstance(b.w_in, Int8Linear) for b in model.blocks)
    assert isinstance(model.lm_head, Int8Linear)
    router = next(b.mlp.router for b in model.blocks if hasattr(b.mlp, "router"))
    assert router.w.weight.dense.dtype == torch.float32  # the router stays f32
    assert model.blocks[0].attn_norm.weight.dtype == torch.float32
    mixed = load_model(tiny_dir, "bf16", expert_dtype="int8", device="cpu")
    assert isinstance(mixed.blocks[0].w_in, Bf16Linear)
    assert all(isinstance(e.gate_up, Int8Linear) for e in _experts(mixed))


def test_quantized_weights_stay_close_to_f32(tiny_dir):
    ids = torch.randint(2, 250, (20,), generator=torch.Generator().manual_seed(5))
    ref = load_model(tiny_dir, "f32", device="cpu")
    want = ref.forward(ids, ref.make_cache(), all_logits=True)
    errs = {}
    for fmt in ("int8", "int4"):
        m = load_model(tiny_dir, fmt, device="cpu")
        errs[fmt] = float((m.forward(ids, m.make_cache(), all_logits=True) - want).abs().max())
    assert 0 < errs["int8"] < errs["int4"] < 0.5 * float(want.abs().max()), errs


def test_generate_says_which_kernels(capsys):
    code = main(["generate", "builtin:tiny", "--prompt", "ab", "--max-tokens", "3",
                 "--weight-dtype", "bf16", "--expert-dtype", "int4"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    from latentkv import native

    own = native.kernels()
    kernel = f"latentkv's {own.name} kernel" if own is not None else "_weight_int4pack_mm_for_cpu"
    assert "bf16 (experts int4) weights" in err and "weights: int4" in err and kernel in err


def test_compile_refuses_quantized_weights_without_the_kernels_in_one_line(capsys, torch_ops, monkeypatch):
    from latentkv import native

    monkeypatch.setattr(native, "unavailable", lambda: "OSError: no C++ compiler")
    code = main(["generate", "builtin:tiny", "--prompt", "a", "--weight-dtype", "int8", "--compile"])
    err = capsys.readouterr().err
    assert code == 2 and "--compile runs int8 weights through latentkv's own kernels" in err
    assert "no C++ compiler" in err and "Traceback" not in err
