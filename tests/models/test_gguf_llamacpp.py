"""GGUFs made by llama.cpp's own converter and quantizer from our test checkpoints (slow).

`benchmarks/llamacpp.py` holds the one llama.cpp the benchmarks use (`--build` once); without it
these tests skip, naming what is missing. Each GGUF is loaded by latentkv (MODEL = the .gguf) and
compared with the safetensors checkpoint it was made from, and with the float32 values it
dequantizes to (the `gguf` package's reading): the float files bit for bit, the quantized ones
within their own quantization error, matrix for matrix exactly where a format holds the type.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from latentkv.models.registry import builtin_path, resolve
from latentkv.models.weights import load_model

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import llamacpp  # noqa: E402

IDS = torch.tensor([5, 17, 300, 42, 1000, 7, 9, 11, 400, 3000, 12, 77, 1, 2, 3, 4])
QUANTIZED = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_XS"]


def _need(what: str) -> None:
    where = llamacpp.where()
    if "(not" in where[what]:
        pytest.skip(f"llama.cpp's {what} is not here ({where[what]}): run benchmarks/llamacpp.py --build")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> GGUF of builtin:fixture: the converter's F32 and BF16, llama-quantize's types."""
    _need("converter")
    tmp = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for outtype in ("f32", "bf16"):
        out[outtype.upper()] = llamacpp.convert_to_gguf(
            builtin_path("fixture"), tmp / f"fixture-{outtype}.gguf", outtype
        )
    return tmp, out


def logits(model) -> torch.Tensor:
    return model.forward(IDS, model.make_cache(model.tier()), all_logits=True)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = F.log_softmax(p.double(), -1), F.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).max())


def test_the_converters_float_ggufs_are_the_checkpoint(made, monkeypatch, tmp_path):
    _, files = made
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    reference = load_model(builtin_path("fixture"), device="cpu")
    assert torch.equal(logits(load_model(resolve(str(files["F32"])), device="cpu")), logits(reference))
    bf16 = load_model(resolve(str(files["BF16"])), "bf16", device="cpu")
    assert torch.equal(logits(bf16), logits(load_model(builtin_path("fixture"), "bf16", device="cpu")))


@pytest.mark.parametrize("kind", QUANTIZED)
def test_llama_quantize_files_load_within_their_error(made, kind, monkeypatch, tmp_path):
    _need("llama-quantize")
    folder, files = made
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    path = folder / f"fixture-{kind}.gguf"
    if not path.exists():
        cmd = [str(llamacpp.binary("llama-quantize")), str(files["F32"]), str(path), kind]
        subprocess.run(cmd, check=True, capture_output=True)
    view = resolve(str(path))
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_files import dequantized_checkpoint

    own = load_model(dequantized_checkpoint(path, builtin_path("fixture"), tmp_path / "own"), device="cpu")
    ours = logits(load_model(view, device="cpu"))
    original = logits(load_model(builtin_path("fixture"), device="cpu"))
    # against the values the file holds: only our formats' compute rounding (and any re-quantized
    # type, reported at load); against the original: the quantization llama-quantize made
    assert kl(ours, logits(own)) < 1e-3
    assert kl(ours, original) < 0.05
    assert (ours.argmax(-1) == original.argmax(-1)).float().mean() >= 0.75
