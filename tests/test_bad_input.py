"""Bad flags and inputs on the CLI (issue 13): one line naming the problem, exit 2, no traceback."""

from __future__ import annotations

import pytest

from latentkv.cli import main


def _refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("latentkv ") and "error: " in lines[-1], err
    assert sum("error" in line for line in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--temperature", "-1e-300"),
        ("--top-p", "nan"),
        ("--top-p", "0"),
        ("--top-p", "inf"),
        ("--top-k", "-1"),
        ("--seed", "-1"),
        ("--seed", str(2**70)),
    ],
)
def test_sampling_flags_out_of_range_are_one_line(capsys, flag, value):
    err = _refused(
        capsys, "generate", "builtin:tiny", "--prompt-ids", "5,6", "--max-tokens", "2", f"{flag}={value}"
    )
    assert flag in err


@pytest.mark.parametrize("value", ["1e-300", "1e-39", "5e-324"])
def test_tiny_temperatures_generate(capsys, value):
    code = main(
        ["generate", "builtin:tiny", "--prompt-ids", "5,6", "--max-tokens", "3", "--temperature", value]
    )
    assert code == 0, capsys.readouterr().err


# --- text that is not valid Unicode -----------------------------------------------------------


@pytest.mark.parametrize("prompt", ["caf\udce9", "lone \ud800"])
def test_a_prompt_that_is_not_utf8_is_one_line(capsys, prompt):
    """`--prompt $'caf\\xe9'` reaches Python as "caf\\udce9" (surrogateescape)."""
    err = _refused(capsys, "generate", "builtin:tiny", "--prompt", prompt, "--max-tokens", "1")
    assert "--prompt is not valid UTF-8" in err


def test_a_prompt_of_raw_bytes_through_the_console_script(tmp_path):
    """The real argv path: the bytes go through the OS, not a Python str."""
    import os
    import subprocess
    import sys

    code = "import sys; from latentkv.cli import main; sys.exit(main())"
    proc = subprocess.run(
        [
            sys.executable.encode(),
            b"-c",
            code.encode(),
            b"generate",
            b"builtin:tiny",
            b"--prompt",
            b"caf\xe9",
        ],
        capture_output=True,
        timeout=120,
        env={**os.environ, "LATENTKV_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.decode("utf-8", "replace")
    assert "byte 0xe9 at character 3 is not valid UTF-8" in err and "Traceback" not in err


def test_chat_refuses_a_stdin_line_that_is_not_utf8_and_goes_on(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("KV8", "KV_TQ", "KV_TQ_POLAR")}
    env.update(LATENTKV_THREADS="1", LATENTKV_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "latentkv.cli", "chat", "builtin:tiny", "--max-tokens", "2"],
        input=b"caf\xe9\nhello\n",
        capture_output=True,
        env=env,
        timeout=120,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "error: the line is not valid UTF-8 text (byte 0xe9 at character 3" in err
    assert "nothing was sent" in err
    assert err.count("[reused ") == 1  # the valid line was answered, the other one was not sent


# --- broken model folders and flags -----------------------------------------------------------


@pytest.fixture
def tiny_copy(tmp_path):
    """builtin:tiny's folder, to damage (the safetensors linked, not copied)."""
    import shutil

    from latentkv.models.registry import resolve

    source = resolve("builtin:tiny")
    folder = tmp_path / "tiny"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    (folder / "model.safetensors").symlink_to(source / "model.safetensors")
    return folder


def _generate(capsys, folder, *extra: str) -> str:
    return _refused(capsys, "generate", str(folder), "--prompt-ids", "5,6", "--max-tokens", "1", *extra)


def _edit_config(folder, **changes) -> None:
    import json

    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda f: (f / "config.json").write_text("[1, 2]"), "must hold a JSON object, not a list"),
        (lambda f: (f / "config.json").write_bytes(b'{"model_type": "caf\xe9"}'), "is not UTF-8 text"),
        (lambda f: ((f / "config.json").unlink(), (f / "config.json").mkdir()), "is a directory"),
        (lambda f: (f / "config.json").write_text("{" * 100000), "config.json"),
        (lambda f: (f / "tokenizer.json").write_text('{"model": 5}'), "tokenizer.json is not a usable"),
        (lambda f: (f / "tokenizer.json").write_bytes(b"\x00\xff garbage"), "tokenizer.json is not a usable"),
        (lambda f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").mkdir()), "not a regular file"),
        (lambda f: (f / "tokenizer_config.json").write_text('"x"'), "tokenizer_config.json must hold"),
    ],
)
def test_broken_model_files_are_one_line_naming_the_file(capsys, tiny_copy, damage, expected):
    damage(tiny_copy)
    assert expected in _generate(capsys, tiny_copy)


def test_a_broken_generation_config_is_named(tiny_copy):
    """Read by chat and serve for the stop ids: a ConfigError naming it (one line via cli.main)."""
    from latentkv.commands.chat import stop_ids
    from latentkv.config import ConfigError, ModelConfig

    (tiny_copy / "generation_config.json").write_text("[]")
    with pytest.raises(ConfigError, match="generation_config.json must hold a JSON object, not a list"):
        stop_ids(ModelConfig.from_hf(tiny_copy), tiny_copy)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": -1}, "hidden_size"),
        ({"hidden_size": "128"}, "hidden_size"),
        ({"hidden_size": 10**9}, "hidden_size"),
        ({"kv_lora_rank": 1.5}, "kv_lora_rank"),
        ({"num_attention_heads": True}, "num_attention_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"n_group": 3}, "n_group"),
        ({"vocab_size": 10**12}, "vocab_size"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": "big"}}, "factor"),
        ({"eos_token_id": 10**9}, "eos_token_id"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"index_n_heads": 0}, "index_n_heads"),
        ({"mlp_layer_types": "dense"}, "mlp_layer_types"),
        ({"rope_scaling": [1]}, "rope_scaling"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ],
)
def test_nonsense_config_values_are_one_line_naming_file_and_field(capsys, tiny_copy, changes, field):
    _edit_config(tiny_copy, **changes)
    err = _generate(capsys, tiny_copy)
    assert "config.json" in err and field in err, err


@pytest.mark.parametrize("threads", ["100000", "0", "-3"])
def test_threads_out_of_range_are_one_line(capsys, threads):
    err = _refused(
        capsys, "generate", "builtin:tiny", "--prompt-ids", "5", "--max-tokens", "1", f"--threads={threads}"
    )
    assert "--threads" in err


def test_threads_from_the_environment_are_checked_alike(capsys, monkeypatch):
    monkeypatch.setenv("LATENTKV_THREADS", "lots")
    assert "LATENTKV_THREADS" in _refused(
        capsys, "generate", "builtin:tiny", "--prompt-ids", "5", "--max-tokens", "1"
    )


# --- kv inspect: regular files only -------------------------------------------------------------


def test_kv_inspect_of_a_fifo_is_one_line_and_never_blocks(tmp_path):
    """A FIFO with no writer would block a plain open for reading: it must not even be opened."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "pipe.kv"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [sys.executable, "-m", "latentkv.cli", "kv", "inspect", str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,  # a hang fails here
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"latentkv kv: error: {fifo} is a FIFO, not a KV file (regular files only)"
    ]


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda p: p.mkdir(), "a directory"),
        (lambda p: p.symlink_to("/dev/null"), "a character device"),
    ],
)
def test_kv_inspect_of_a_directory_or_device_is_one_line(capsys, tmp_path, make, kind):
    path = tmp_path / "x.kv"
    make(path)
    err = _refused(capsys, "kv", "inspect", str(path))
    assert f"is {kind}, not a KV file" in err


def test_kv_inspect_without_permission_is_one_line(capsys, tmp_path):
    """(The tests may run as root, which reads anything: the refusal comes through fs's seam.)"""
    import errno

    from latentkv import fs

    path = tmp_path / "secret.kv"
    path.write_bytes(b"x" * 100)
    with fs.inject("open", path, errno.EACCES):
        err = _refused(capsys, "kv", "inspect", str(path))
    assert f"{path}: permission denied while opening the KV file: check its permissions" in err


# --- the refusal note names the flags that resume the file ----------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "flags"),
    [
        (
            ["--kv-cache-dtype", "tq4"],
            ["--kv-cache-dtype", "tq4", "--kv-seed", "7"],
            "--kv-cache-dtype tq4 --kv-seed 0x9e3779b9",
        ),
        (
            ["--kv-cache-dtype", "fp8"],
            ["--kv-cache-dtype", "fp8", "--kv-group-size", "8"],
            "--kv-cache-dtype fp8 (without --kv-group-size)",
        ),
        (
            ["--kv-cache-dtype", "fp8", "--kv-group-size", "8"],
            ["--kv-cache-dtype", "fp8", "--kv-group-size", "16"],
            "--kv-cache-dtype fp8 --kv-group-size 8",
        ),
    ],
)
def test_the_refusal_note_names_the_flags_that_resume_it_then_they_do(capsys, tmp_path, first, second, flags):
    import json
    import shutil

    base = ["generate", "builtin:tiny", "--prompt-ids", "5,6,7", "--max-tokens", "2", "--json"]
    base += ["--session", "s", "--kv-dir", str(tmp_path)]
    assert main([*base, *first]) == 0
    capsys.readouterr()
    assert main([*base, *second]) == 0
    out = json.loads(capsys.readouterr().out)
    (note,) = out["session"]["notes"]
    assert f"pass {flags} to resume it" in note, note
    shutil.move(out["session"]["moved_aside"], tmp_path / "s.kv")  # put it back, resume as told
    again = [*base, *flags.replace("(without --kv-group-size)", "").split()]
    assert main(again) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["session"]["notes"] == [] and resumed["stats"]["resumed_tokens"] > 0
