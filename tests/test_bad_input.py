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
