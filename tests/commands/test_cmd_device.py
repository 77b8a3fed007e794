"""--device: cpu changes nothing; cuda is refused in one line (exit 2) where torch has no CUDA.

Torch's CUDA probe is patched to "none" so these hold on a GPU machine too; what runs on a GPU
is benchmarks/gpu_check.py's to show (docs/gpu.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from latentkv.cli import main
from latentkv.config import EngineConfig
from latentkv.errors import UserError
from latentkv.runtime import check_device, load, resolve_device

PROMPT = ["--prompt-ids", "5,17,3,99,42", "--max-tokens", "8", "--json"]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "builtin:tiny", *PROMPT],
        ["chat", "builtin:tiny"],
        ["serve", "builtin:tiny", "--port", "0"],
        ["bench", "decode", "builtin:tiny", "--context", "8", "--decode-tokens", "2"],
        ["bench", "speculative", "--model", "random:tiny"],
        ["bench", "batch", "builtin:tiny"],
        ["bench", "resume", "builtin:tiny"],
        ["eval", "ppl", "builtin:tiny"],
    ],
    ids=[
        "generate",
        "chat",
        "serve",
        "bench-decode",
        "bench-speculative",
        "bench-batch",
        "bench-resume",
        "eval-ppl",
    ],
)
def test_cuda_without_cuda_is_one_line_and_exit_2(capsys, monkeypatch, no_cuda, tmp_path, argv):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))  # where bench speculative would write random:tiny
    if argv[0] == "serve":  # past the check the server would start and wait for requests
        import uvicorn

        monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("serve started"))
    code, out, err = _run(capsys, *argv, "--device", "cuda")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--device cuda:" in lines[0] and "use --device cpu" in lines[0], err
    assert "Traceback" not in err and "loaded" not in err  # refused before any weight is read
    assert not (tmp_path / "bench").exists()  # nor a random model written


def test_an_unknown_device_is_argparses_refusal(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "builtin:tiny", *PROMPT, "--device", "tpu"])
    assert exit_.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


def test_device_cpu_and_auto_without_cuda_generate_the_same_tokens(capsys, no_cuda):
    outputs = []
    for flags in ([], ["--device", "cpu"], ["--device", "auto"]):
        code, out, err = _run(capsys, "generate", "builtin:tiny", *PROMPT, *flags)
        assert code == 0, err
        outputs.append(json.loads(out)["tokens"])
    assert len(outputs[0]) == 8 and outputs[0] == outputs[1] == outputs[2]


def test_device_cpu_loads_the_same_model_bit_for_bit():
    """The CPU path is unchanged: every logit equal with and without device="cpu"."""
    ids = torch.tensor([5, 17, 3, 99, 42, 7])
    logits = []
    for engine in (EngineConfig(), EngineConfig(device="cpu")):
        loaded = load("builtin:tiny", engine, quiet=True)
        assert loaded.model.device == torch.device("cpu")
        with torch.inference_mode():
            logits.append(loaded.model.forward(ids, loaded.model.make_cache(), all_logits=True))
    assert torch.equal(logits[0], logits[1])


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda") == resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="--device cuda: .*use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="unknown --device 'gpu'; choose from cpu, cuda, auto"):
        resolve_device("gpu")


def test_cuda_with_streamed_experts_needs_a_vram_plan(monkeypatch):
    """Streamed experts reach a GPU through its VRAM cache, which --vram-gb plans: --ram-gb alone
    with cuda is refused naming --vram-gb; with it the device stands. A cluster stays CPU-only."""
    from latentkv.config import ClusterConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="add --vram-gb V"):
        check_device(EngineConfig(device="cuda", ram_gb=4.0))
    assert check_device(EngineConfig(device="cuda", ram_gb=4.0, vram_gb=8.0)) == torch.device("cuda")
    assert check_device(EngineConfig(device="auto", vram_gb=8.0)) == torch.device("cuda")
    with pytest.raises(UserError, match="a cluster runs on the CPU only"):
        check_device(
            EngineConfig(device="cuda", cluster=ClusterConfig(2, 0, "127.0.0.1", 29500), vram_gb=8.0)
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "builtin:tiny", *PROMPT, "--vram-gb", "4"],
        ["generate", "builtin:tiny", *PROMPT, "--vram-gb", "4", "--device", "auto"],
        ["bench", "decode", "builtin:tiny", "--context", "8", "--vram-gb", "4"],
        ["bench", "speculative", "--model", "builtin:fixture", "--vram-gb", "4"],
        ["bench", "speculative", "--model", "builtin:fixture", "--vram-gb", "4", "--device", "auto"],
    ],
)
def test_vram_gb_without_a_gpu_is_one_line_and_exit_2(capsys, no_cuda, argv):
    code, _out, err = _run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--vram-gb plans a GPU's memory" in lines[0], err


@pytest.mark.parametrize(
    "argv", [["generate", "builtin:tiny", *PROMPT], ["bench", "speculative", "--model", "builtin:fixture"]]
)
def test_vram_gb_must_be_a_positive_budget(capsys, argv):
    code, _out, err = _run(capsys, *argv, "--vram-gb", "-1")
    assert code == 2 and "--vram-gb" in err and "Traceback" not in err


@pytest.mark.parametrize("streamed", [["--ram-gb", "4"], ["--expert-share", "0.5"]])
def test_bench_speculative_streamed_on_cuda_needs_a_vram_plan(capsys, monkeypatch, tmp_path, streamed):
    """bench speculative refuses as generate does: experts from disk on a GPU need --vram-gb (CUDA
    patched in, refused before a model is built)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    code, _out, err = _run(
        capsys, "bench", "speculative", "--model", "random:tiny", "--device", "cuda", *streamed
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "add --vram-gb V" in lines[0], err
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize(
    "command", ["generate builtin:fixture --prompt x", "chat builtin:fixture", "serve builtin:fixture"]
)
def test_weight_default_is_bf16_on_a_gpu_only(monkeypatch, command):
    """An untyped --weight-dtype is f32 on the CPU and bf16 where --device resolves to cuda; a
    typed one is kept either way."""
    from latentkv.cli import build_parser
    from latentkv.commands.common import settle_weight_default

    def parsed(*extra: str):
        args = build_parser().parse_args([*command.split(), *extra])
        settle_weight_default(args)
        return args.weight_dtype

    assert parsed() == "f32"
    assert parsed("--device", "cpu") == "f32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parsed("--device", "cuda") == "bf16"
    assert parsed("--device", "auto") == "bf16"
    assert parsed("--device", "cuda", "--weight-dtype", "f32") == "f32"
    assert parsed("--device", "cuda", "--weight-dtype", "int8") == "int8"
