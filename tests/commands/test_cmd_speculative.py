"""`--speculative mtp [--draft-tokens N]` on generate (and the refusals shared by chat, serve and
bench decode): the same tokens as without it, the stats in --json, a session file holding what
plain decoding saves, one clear line and exit 2 for a model without an MTP layer."""

from __future__ import annotations

import json

import pytest

from latentkv.cli import main

PROMPT = "import os\nimport sys\n\n\ndef main("


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _generate(capsys, *extra: str) -> dict:
    code, out, err = _run(
        capsys, "generate", "builtin:fixture", "--prompt", PROMPT, "--max-tokens", "24", "--json", *extra
    )
    assert code == 0, err
    return json.loads(out)


def test_generate_speculative_same_tokens_and_stats(capsys):
    plain = _generate(capsys)
    spec = _generate(capsys, "--speculative", "mtp", "--draft-tokens", "2")
    assert spec["tokens"] == plain["tokens"]
    stats = spec["stats"]["speculative"]
    assert stats["draft_tokens"] == 2 and len(stats["acceptance_per_position"]) == 2
    assert stats["verify_steps"] + stats["plain_steps"] >= 1
    assert plain["stats"]["speculative"] is None


def test_generate_speculative_session_saves_what_plain_decoding_saves(capsys, tmp_path):
    plain = _generate(capsys, "--session", "a", "--kv-dir", str(tmp_path))
    spec = _generate(capsys, "--session", "b", "--kv-dir", str(tmp_path), "--speculative", "mtp")
    assert spec["tokens"] == plain["tokens"]
    assert spec["session"]["saved_tokens"] == plain["session"]["saved_tokens"]


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_model_without_mtp_is_refused_in_one_line(capsys, command):
    argv = [command, "builtin:tiny", "--speculative", "mtp"]
    if command == "generate":
        argv += ["--prompt-ids", "5,6"]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "MTP" in lines[0] and "num_nextn_predict_layers" in lines[0]


def test_bench_decode_refuses_a_model_without_mtp(capsys):
    code, _, err = _run(capsys, "bench", "decode", "builtin:tiny", "--context", "8", "--speculative", "mtp")
    assert code == 2 and "MTP" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--draft-tokens", "2"], "needs --speculative mtp"),
        (["--speculative", "mtp", "--draft-tokens", "0"], "1..8"),
    ],
)
def test_bad_flags_exit_2(capsys, flags, message):
    code, _, err = _run(capsys, "generate", "builtin:fixture", "--prompt-ids", "5,6", *flags)
    assert code == 2 and message in err


def test_bench_speculative_table(capsys, tmp_path, monkeypatch):
    """random:tiny (built into the cache directory) at 1 and 2 sequences: a plain and a drafting
    row each, the drafting rows' tokens identical to the plain ones, acceptance per position."""
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    code, out, err = _run(
        capsys,
        "bench",
        "speculative",
        "--model",
        "random:tiny",
        "--draft-tokens",
        "2",
        "--concurrency",
        "1,2",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "6",
        "--json",
    )
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [(r["concurrency"], r["draft_tokens"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(r["same_tokens"] for r in rows)
    assert all(
        len(r["acceptance_per_position"]) == 2 and r["verify_steps"] > 0 for r in rows if r["draft_tokens"]
    )
    assert (tmp_path / "bench" / "random-tiny" / "config.json").exists()
