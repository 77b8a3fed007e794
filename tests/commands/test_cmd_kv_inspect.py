"""`latentkv kv inspect FILE`: what a KV file holds and whether it loads here, on a good file, a
truncated one and random bytes: exit codes, JSON fields, never a traceback. Also `bench resume`."""

from __future__ import annotations

import json
import os

import pytest

from latentkv.cli import main


@pytest.fixture
def session_file(tmp_path, capsys):
    """A tq4 session of builtin:tiny: 8 prompt tokens + 4 generated (11 rows saved)."""
    argv = [
        "generate",
        "builtin:tiny",
        "--prompt-ids",
        "5,6,7,8,9,10,11,12",
        "--max-tokens",
        "4",
        "--ignore-eos",
    ]
    assert main([*argv, "--kv-cache-dtype", "tq4", "--session", "i", "--kv-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    return tmp_path / "i.kv"


def _inspect(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["kv", "inspect", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_a_good_file(session_file, capsys):
    code, out, _ = _inspect(
        capsys, str(session_file), "--json", "--model", "builtin:tiny", "--kv-cache-dtype", "tq4"
    )
    assert code == 0
    info = json.loads(out)
    assert info["format_version"] == "1.0" and info["tier"] == "tq4" and info["verifies"] is True
    assert info["tokens"] == info["committed_tokens"] == 11
    assert info["bytes"] == info["expected_bytes"] == info["header_bytes"] + 11 * info["record_bytes"]
    assert info["model"]["model_type"] == "glm_moe_dsa" and len(info["model"]["checkpoint"]) == 64
    assert info["codec"]["c"]["bits"] == 4 and info["resume_flags"] == "--kv-cache-dtype tq4"
    assert info["loads_here"]["action"] == "same" and info["loads_here"]["scope"] == "model+codec"

    code, out, _ = _inspect(capsys, str(session_file), "--json")  # default flags: f32, tier only
    loads = json.loads(out)["loads_here"]
    assert loads["action"] == "refuse" and loads["scope"] == "codec"
    assert "pass --kv-cache-dtype tq4 to resume it" in loads["message"]

    code, out, _ = _inspect(capsys, str(session_file), "--model", "builtin:tiny", "--kv-cache-dtype", "tq4")
    assert code == 0
    assert "tokens      11 verified of 11 committed" in out and "loads here  yes:" in out
    assert "verifies    yes" in out and "resume with --kv-cache-dtype tq4" in out


def test_another_model_is_named_as_the_difference(session_file, capsys, checkpoint):
    other = checkpoint("glm5-tiny-dsa")
    code, out, _ = _inspect(
        capsys, str(session_file), "--json", "--model", str(other), "--kv-cache-dtype", "tq4"
    )
    loads = json.loads(out)["loads_here"]
    assert code == 0 and loads["action"] == "refuse" and "different model" in loads["message"]


def test_a_truncated_file(session_file, capsys):
    size = session_file.stat().st_size
    os.truncate(session_file, size - 100)  # into the last record
    code, out, _ = _inspect(capsys, str(session_file), "--json")
    info = json.loads(out)
    assert code == 1 and info["verifies"] is False
    assert info["tokens"] == 10 and info["committed_tokens"] == 11 and info["notes"]
    code, out, _ = _inspect(capsys, str(session_file))
    assert code == 1 and "verifies    NO" in out and "note" in out

    os.truncate(session_file, 30)  # into the header
    code, out, _ = _inspect(capsys, str(session_file), "--json")
    info = json.loads(out)
    assert code == 1 and info["verifies"] is False and "header" in info["error"]


def test_random_bytes_and_a_missing_file(tmp_path, capsys):
    garbage = tmp_path / "garbage.kv"
    garbage.write_bytes(os.urandom(20000))
    code, out, _ = _inspect(capsys, str(garbage), "--json")
    info = json.loads(out)
    assert code == 1 and info["verifies"] is False and "not a latentkv KV file" in info["error"]
    code, out, _ = _inspect(capsys, str(garbage), "--model", "builtin:tiny")
    assert code == 1 and "cannot be read: not a latentkv KV file" in out
    code, _, err = _inspect(capsys, str(tmp_path / "absent.kv"))
    assert code == 2 and "no such file" in err


def test_bench_resume_on_tiny(tmp_path, capsys):
    out_file = tmp_path / "resume.json"
    argv = ["bench", "resume", "builtin:tiny", "--tokens", "24", "--kv-cache-dtype", "f32,tq4", "--json"]
    assert main([*argv, "--out", str(out_file)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload == json.loads(out_file.read_text())
    assert [r["kv_cache_dtype"] for r in payload["rows"]] == ["f32", "tq4"]
    for row in payload["rows"]:
        assert row["tokens"] == 24 and row["file_bytes_match"] and row["rows_identical"]
        assert row["next_logits_identical"] and row["prefill_seconds"] > 0 and row["resume_seconds"] > 0
    assert main(["bench", "resume", "builtin:tiny", "--tokens", "8", "--kv-cache-dtype", "fp8"]) == 0
    assert "| builtin:tiny | fp8 | 8 |" in capsys.readouterr().out
