"""Bad flags and inputs on the CLI (issue 13): one line naming the problem, exit 2, no traceback."""

from __future__ import annotations

import pytest

from latentkv.cli import main


def _refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


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
