"""The CLI, in-process through `latentkv.cli.main` (one subprocess checks the console script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from latentkv.cli import COMMANDS, main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, *argv: str) -> dict:
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, _ = _run(capsys)
    assert code == 2
    assert "usage: latentkv" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("latentkv ")


def test_console_script_runs():
    script = Path(sys.executable).parent / "latentkv"
    exe = str(script) if script.exists() else shutil.which("latentkv")
    if exe is None:
        pytest.skip("the latentkv console script is not installed")
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout


def test_generate_text_prompt_json(capsys, tiny_dir):
    from latentkv.tokenizer import Tokenizer

    out = _json(capsys, "generate", "builtin:tiny", "--prompt", "hi", "--max-tokens", "4", "--json")
    assert out["model"] == "builtin:tiny"
    assert out["prompt_ids"] == list(b"hi")
    stats = out["stats"]
    assert 1 <= len(out["tokens"]) == stats["generated_tokens"] <= 4
    assert stats["finish_reason"] in ("length", "stop")
    if stats["finish_reason"] == "length":
        assert len(out["tokens"]) == 4
    eos = json.loads((tiny_dir / "config.json").read_text())["eos_token_id"]
    assert out["text"] == Tokenizer(tiny_dir).decode([t for t in out["tokens"] if t != eos])
    assert stats["prompt_tokens"] == 2
    assert stats["kv_cache_dtype"] == out["kv"]["kv_cache_dtype"] == "f32"
    for key in ("prompt_tps", "decode_tps", "kv_bytes", "index_kv_bytes", "kv_bytes_per_token_layer"):
        assert key in stats


def test_generate_kv_accounting_follows_the_config(capsys, tiny_dir, hf):
    raw = json.loads((tiny_dir / "config.json").read_text())
    prompt, n = [5, 6, 7, 8, 9], 6
    out = _json(
        capsys,
        "generate",
        "builtin:tiny",
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        str(n),
        "--ignore-eos",
        "--json",
    )
    per_layer = 4 * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"])
    layers = raw["num_hidden_layers"]
    full = sum(t == "full" for t in raw["indexer_types"])
    kv, stats = out["kv"], out["stats"]
    assert len(out["tokens"]) == n
    assert kv["bytes_per_token_per_layer"] == per_layer == stats["kv_bytes_per_token_layer"]
    assert kv["bytes_per_token"] == per_layer * layers
    cached = len(prompt) + n - 1  # the last generated token is never fed back
    assert stats["kv_bytes"] == per_layer * layers * cached
    assert kv["index_bytes_per_token"] == 4 * raw["index_head_dim"] * full
    assert stats["index_kv_bytes"] == 4 * raw["index_head_dim"] * full * cached
    expanded = (
        4
        * raw["num_attention_heads"]
        * (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"] + raw["v_head_dim"])
    )
    assert kv["expanded_per_head_kv_bytes_per_token_per_layer"] == expanded
    assert kv["smaller_than_expanded"] == pytest.approx(expanded / per_layer, abs=0.01)
    # The tokens themselves: transformers' greedy chain from the same prompt.
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf("glm5-tiny")(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out["tokens"] == seq[len(prompt) :]


def test_generate_plain_output_streams_the_text_and_a_stats_line(capsys):
    argv = ("generate", "builtin:tiny", "--prompt-ids", "5,6", "--max-tokens", "3", "--ignore-eos")
    expected = _json(capsys, *argv, "--json")["text"]
    code, out, err = _run(capsys, *argv)
    assert code == 0
    assert out == expected + "\n"
    assert "KV:" in err and "B/token/layer" in err


def test_generate_without_a_tokenizer_prints_ids(capsys, tmp_path, tiny_dir):
    model = _model_without(tmp_path, tiny_dir, "config.json", "model.safetensors")
    argv = ("generate", str(model), "--prompt-ids", "5,6", "--max-tokens", "3", "--ignore-eos")
    tokens = _json(capsys, *argv, "--json")["tokens"]
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert [int(t) for t in out.split()] == tokens


def test_generate_zero_tokens(capsys):
    out = _json(capsys, "generate", "builtin:tiny", "--prompt-ids", "5,6", "--max-tokens", "0", "--json")
    assert out["tokens"] == []
    assert out["stats"]["finish_reason"] == "length"


def test_sampled_generation_with_a_seed_is_reproducible(capsys):
    argv = (
        "generate",
        "builtin:tiny",
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    )
    sampled = ("--temperature", "1.0", "--top-k", "50", "--seed", "3")
    a, b = _json(capsys, *argv, *sampled), _json(capsys, *argv, *sampled)
    assert a["tokens"] == b["tokens"]


def _model_without(tmp_path: Path, tiny_dir: Path, *keep: str) -> Path:
    for name in keep:
        shutil.copy(tiny_dir / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/model/dir", "--prompt-ids", "1"], "is not a directory"),
        (
            ["builtin:nope", "--prompt-ids", "1"],
            "unknown builtin model 'nope'; available: builtin:fixture, builtin:tiny",
        ),
        (["builtin:tiny", "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
        (["builtin:tiny", "--prompt-ids", ","], "--prompt-ids is empty"),
        (["builtin:tiny", "--prompt", ""], "the prompt is empty"),
        (["builtin:tiny", "--prompt-ids", "5,999"], "out of range"),
        (
            ["builtin:tiny", "--prompt-ids", "1", "--max-tokens", "-1"],
            "--max-tokens must be an integer from 0 to",
        ),
        (
            ["builtin:tiny", "--prompt-ids", "1", "--kv-cache-dtype", "int3"],
            "unknown --kv-cache-dtype 'int3'; choose from f32",
        ),
        (
            ["builtin:tiny", "--prompt-ids", "1", "--temperature", "-1"],
            "temperature must be a finite number >= 0",
        ),
        (["builtin:tiny", "--prompt-ids", "1", "--top-p", "0"], "top_p"),
        (
            ["builtin:tiny", "--prompt-ids", "1", "--threads", "0"],
            "--threads (or LATENTKV_THREADS) must be in 1..",
        ),
    ],
)
def test_generate_user_errors_exit_2_without_a_traceback(args, message, capsys):
    code, out, err = _run(capsys, "generate", *args)
    assert code == 2
    assert "latentkv generate: error:" in err
    assert message in err
    assert "Traceback" not in err + out


def test_model_directory_problems_are_user_errors(tmp_path, tiny_dir, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "generate", str(empty), "--prompt-ids", "1")
    assert code == 2 and "has no config.json" in err
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    _model_without(no_weights, tiny_dir, "config.json")
    code, _, err = _run(capsys, "generate", str(no_weights), "--prompt-ids", "1")
    assert code == 2 and "no safetensors weights" in err
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    _model_without(no_tokenizer, tiny_dir, "config.json", "model.safetensors")
    code, _, err = _run(capsys, "generate", str(no_tokenizer), "--prompt", "hi")
    assert code == 2 and "no tokenizer.json; use --prompt-ids" in err
    assert "Traceback" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "builtin:tiny", "--prompt-ids", "1", "--weight-dtype", "fp4"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "builtin:tiny"])  # neither --prompt nor --prompt-ids
    assert exit_.value.code == 2


def test_demo_runs_and_reports(capsys):
    code, out, _ = _run(capsys, "demo", "--max-tokens", "6")
    assert code == 0
    assert "generated" in out
    assert "KV cache" in out and "B/token/layer" in out
    assert "DSA keys" in out


def test_demo_shows_a_seeded_sampled_continuation_as_text_then_greedy_tiers(capsys):
    """The first thing printed is the prompt and its continuation, as code, sampled with the
    documented defaults (temperature 0.7, top-p 0.9, seed 0); the tier table stays greedy."""
    from latentkv.commands.demo import DEMO_PROMPT
    from latentkv.engine.generate import generate
    from latentkv.engine.sampling import SamplingParams
    from latentkv.models.registry import builtin_path
    from latentkv.models.weights import load_model
    from latentkv.tokenizer import Tokenizer

    code, out, _ = _run(capsys, "demo", "--max-tokens", "8", "--compare", "f32")
    assert code == 0
    header = (
        "--- prompt, then the model's continuation (sampled: --temperature 0.7 --top-p 0.9 --seed 0) ---\n"
    )
    assert header in out
    block = out.split(header, 1)[1].split("\n---\n", 1)[0]
    directory = builtin_path("fixture")
    model, tok = load_model(directory, device="cpu"), Tokenizer.of_model(directory)
    prompt = tok.encode(DEMO_PROMPT)
    sampled = generate(model, prompt, 8, SamplingParams(0.7, 0.9, seed=0), tok, stop_ids=())
    greedy = generate(model, prompt, 8, SamplingParams(), tok, stop_ids=())
    assert block == DEMO_PROMPT + sampled.text
    assert "  f32  " in out and "8/8" in out
    assert _one_line_of(greedy.text) in out  # the f32 row shows the greedy continuation


def _one_line_of(text: str) -> str:
    return repr(text)[1:-1][:60]


def test_demo_refuses_bad_sampling_flags(capsys):
    code, _, err = _run(capsys, "demo", "--temperature", "-1", "--compare", "none")
    assert code == 2 and "temperature" in err


def test_oracle_command_on_the_bundled_model(capsys):
    rows = _json(capsys, "oracle", "--model", "glm5-tiny", "--json")
    assert [r["name"] for r in rows] == ["glm5-tiny"]
    assert rows[0]["ok"] and rows[0]["tf"] == "32/32" and rows[0]["greedy"] == "20/20"


def test_oracle_command_refuses_an_unknown_model(capsys):
    code, _, err = _run(capsys, "oracle", "--model", "nope")
    assert code == 2 and "unknown oracle model" in err and "glm5-tiny" in err


def test_bench_decode_on_the_bundled_model(capsys, tmp_path, tiny_dir):
    raw = json.loads((tiny_dir / "config.json").read_text())
    out_file = tmp_path / "bench.json"
    argv = ["bench", "decode", "builtin:tiny", "--context", "4,9", "--decode-tokens", "3", "--json"]
    payload = _json(capsys, *argv, "--out", str(out_file))
    assert json.loads(out_file.read_text()) == payload
    rows = payload["rows"]
    assert [r["context"] for r in rows] == [4, 9]
    per_layer = 4 * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"])
    index = 4 * raw["index_head_dim"] * sum(t == "full" for t in raw["indexer_types"])
    for r in rows:
        assert r["engine"] == "latentkv"
        assert r["kv_bytes_per_token_layer"] == per_layer
        assert r["kv_bytes_per_token"] == pytest.approx(per_layer * raw["num_hidden_layers"] + index)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context", "0"], "positive integers"),
        (["--context", "a"], "comma-separated integers"),
        (["--decode-tokens", "1"], "at least 2"),
    ],
)
def test_bench_user_errors(args, message, capsys):
    code, _, err = _run(capsys, "bench", "decode", "builtin:tiny", *args)
    assert code == 2 and message in err
