"""`generate --session`: a conversation that survives a real restart, keeps the common prefix of a
diverging prompt, moves a file of another tier aside, and refuses names that are paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from latentkv.cli import main
from latentkv.engine.generate import generate
from latentkv.kv.store import KVFile

FIRST = [5, 6, 7, 8, 9, 10, 11, 12]


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KV8", "KV_TQ", "KV_TQ_POLAR")}
    env.update(LATENTKV_THREADS="1", LATENTKV_CACHE=str(tmp_path / "cache"))
    return env


def _subprocess_generate(tmp_path: Path, prompt: list[int], *extra: str) -> dict:
    """One `latentkv generate --json` in a fresh interpreter: nothing shared but the files."""
    argv = ["generate", "builtin:tiny", "--prompt-ids", _ids(prompt), "--ignore-eos", "--json", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "latentkv.cli", *argv],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _generate(capsys, prompt: list[int], *extra: str) -> tuple[int, dict | None, str]:
    argv = ["generate", "builtin:tiny", "--prompt-ids", _ids(prompt), "--ignore-eos", "--json", *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.mark.parametrize("tier", ["f32", "fp8", "tq4"])
def test_a_restarted_generate_resumes_and_continues_token_identically(tmp_path, ours, tier):
    flags = ["--session", "s", "--kv-dir", str(tmp_path), "--kv-cache-dtype", tier, "--max-tokens", "6"]
    one = _subprocess_generate(tmp_path, FIRST, *flags)
    assert one["stats"]["resumed_tokens"] == 0
    history = one["prompt_ids"] + one["tokens"]
    # the turn saved the rows that exist: the prompt and every generated token but the last
    assert one["session"]["saved_tokens"] == len(history) - 1

    prompt = history + [40, 41, 42]
    two = _subprocess_generate(tmp_path, prompt, *flags)
    assert two["stats"]["resumed_tokens"] == len(history) - 1 > 0
    assert two["stats"]["prompt_tokens"] == 4  # the last answer token + the 3 new ones
    assert two["stats"]["resume_seconds"] >= 0 and two["session"]["notes"] == []

    model = ours("glm5-tiny")
    uninterrupted = generate(model, prompt, 6, cache=model.make_cache(model.tier(tier)), stop_ids=())
    assert two["tokens"] == uninterrupted.tokens
    with KVFile.open(tmp_path / "s.kv") as f:
        assert f.load().tokens == (prompt + two["tokens"])[:-1]


def test_a_diverging_prompt_keeps_the_common_prefix(tmp_path, ours, capsys):
    flags = ["--session", "d", "--kv-dir", str(tmp_path), "--max-tokens", "4"]
    code, one, _ = _generate(capsys, FIRST, *flags)
    assert code == 0 and one["session"]["saved_tokens"] == len(FIRST) + 3
    prompt = FIRST[:5] + [99, 98, 97]
    code, two, err = _generate(capsys, prompt, *flags)
    assert code == 0, err
    assert two["stats"]["resumed_tokens"] == 5 and two["stats"]["prompt_tokens"] == 3
    assert two["session"]["loaded_tokens"] == len(FIRST) + 3
    model = ours("glm5-tiny")
    assert two["tokens"] == generate(model, prompt, 4, stop_ids=()).tokens
    with KVFile.open(tmp_path / "d.kv") as f:
        assert f.load().tokens == (prompt + two["tokens"])[:-1]


def test_the_same_prompt_again_reuses_all_but_its_last_token(tmp_path, capsys):
    flags = ["--session", "same", "--kv-dir", str(tmp_path), "--max-tokens", "1"]
    code, one, _ = _generate(capsys, FIRST, *flags)
    assert code == 0 and one["session"]["saved_tokens"] == len(FIRST)
    code, two, _ = _generate(capsys, FIRST, *flags)
    assert two["stats"]["resumed_tokens"] == len(FIRST) - 1 and two["stats"]["prompt_tokens"] == 1
    assert two["tokens"] == one["tokens"]


def test_a_tier_mismatch_moves_the_file_aside_and_names_the_flag(tmp_path, capsys):
    flags = ["--session", "m", "--kv-dir", str(tmp_path), "--max-tokens", "3"]
    code, one, _ = _generate(capsys, FIRST, *flags, "--kv-cache-dtype", "tq4")
    assert code == 0
    history = one["prompt_ids"] + one["tokens"]
    code, two, err = _generate(capsys, [*history, 50], *flags, "--kv-cache-dtype", "fp8")
    assert code == 0
    moved = two["session"]["moved_aside"]
    assert moved and Path(moved).exists() and Path(moved).name.startswith("m.kv.refused-")
    assert two["stats"]["resumed_tokens"] == 0 and two["stats"]["prompt_tokens"] == len(history) + 1
    (note,) = two["session"]["notes"]
    assert "file is tq4" in note and "pass --kv-cache-dtype tq4 to resume it" in note and moved in note
    assert note in err  # notes go to stderr too
    with KVFile.open(moved) as f:  # kept whole, never rewritten
        assert f.header.codec.tier == "tq4" and len(f.load().tokens) == len(history) - 1
    with KVFile.open(tmp_path / "m.kv") as f:
        assert f.header.codec.tier == "fp8"


def test_an_f32_session_is_reencoded_under_a_quantized_tier(tmp_path, capsys):
    flags = ["--session", "r", "--kv-dir", str(tmp_path), "--max-tokens", "3"]
    code, one, _ = _generate(capsys, FIRST, *flags)
    history = one["prompt_ids"] + one["tokens"]
    code, two, err = _generate(capsys, [*history, 50], *flags, "--kv-cache-dtype", "tq4")
    assert code == 0 and two["stats"]["resumed_tokens"] == len(history) - 1
    assert "re-encoding it to tq4" in err and two["session"]["moved_aside"] is None
    with KVFile.open(tmp_path / "r.kv") as f:  # rewritten in the current tier at the save
        assert f.header.codec.tier == "tq4" and len(f.load().tokens) == len(history) + 3


def test_the_default_folder_is_under_the_cache_root(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "root"))
    code, one, _ = _generate(capsys, FIRST, "--session", "home", "--max-tokens", "2")
    assert code == 0
    assert Path(one["session"]["path"]) == tmp_path / "root" / "sessions" / "home.kv"
    assert (tmp_path / "root" / "sessions" / "home.kv").exists()


def test_session_files_are_private_to_the_user(tmp_path, capsys, monkeypatch):
    """The folder is 0700 and each file 0600 (a session holds a conversation), also a file
    rewritten for another tier."""
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "root"))
    folder = tmp_path / "root" / "sessions"
    assert _generate(capsys, FIRST, "--session", "mine", "--max-tokens", "2")[0] == 0
    assert (folder.stat().st_mode & 0o777, (folder / "mine.kv").stat().st_mode & 0o777) == (0o700, 0o600)
    assert (
        _generate(capsys, FIRST, "--session", "mine", "--max-tokens", "2", "--kv-cache-dtype", "fp8")[0] == 0
    )
    assert sorted(p.stat().st_mode & 0o777 for p in folder.iterdir()) == [0o600] * len(list(folder.iterdir()))
    assert len(list(folder.iterdir())) >= 1


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x" * 200, "..", "a b", "/abs", "c:\\d"])
def test_invalid_session_names_are_refused(tmp_path, capsys, name):
    code, _, err = _generate(capsys, FIRST, "--session", name, "--kv-dir", str(tmp_path / "k"))
    assert code == 2
    assert "invalid session name" in err and "Traceback" not in err
    assert not (tmp_path / "k").exists()


def test_a_session_open_in_another_process_is_refused_and_left_alone(tmp_path, capsys):
    flags = ["--session", "busy", "--kv-dir", str(tmp_path), "--max-tokens", "2"]
    assert _generate(capsys, FIRST, *flags)[0] == 0
    with KVFile.open(tmp_path / "busy.kv", writable=True):  # holds the writer's lock
        code, _, err = _generate(capsys, FIRST, *flags)
    assert code == 2 and "in use by another latentkv process" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy.kv"]


def test_the_stats_line_reports_the_resume(tmp_path, capsys):
    flags = ["generate", "builtin:tiny", "--prompt-ids", _ids(FIRST), "--max-tokens", "2", "--ignore-eos"]
    flags += ["--session", "line", "--kv-dir", str(tmp_path)]
    assert main(flags) == 0
    capsys.readouterr()
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert f"resumed: {len(FIRST) - 1} tokens in" in err and "saved: 9 tokens to" in err
