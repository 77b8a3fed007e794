"""Named sessions as the scheduler and `--session` share them: one name rule, DIR/NAME.kv, resume
keeps the saved rows a prompt starts with, save writes the rows the cache has."""

from __future__ import annotations

import stat

import pytest
import torch

from latentkv.engine.sessions import (
    SessionBusy,
    SessionFiles,
    SessionUnavailable,
    check_session_name,
    resume,
    save,
    session_path,
)


def test_names_are_plain_file_names_and_the_folder_is_private(tmp_path):
    assert check_session_name("agent-1.main_2") == "agent-1.main_2"
    for bad in ("", ".hidden", "a/b", "x" * 129, 5):
        with pytest.raises(ValueError, match="invalid session name.*a name, not a path"):
            check_session_name(bad)
    path = session_path("s", tmp_path / "new")
    assert path == tmp_path / "new" / "s.kv"
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ValueError, match="file exists and is not a directory.*while creating the session folder"
    ):
        session_path("s", tmp_path / "file")


def test_open_resume_save_and_refusals(ours, tiny_dir, tmp_path):
    model = ours("glm5-tiny")
    files = SessionFiles(model, model.tier(), tiny_dir, tmp_path)
    prompt = [5, 6, 7, 8]
    session, cache = files.open("a")
    assert resume(session, cache, prompt) == prompt  # a new session: everything to prefill
    model.forward(torch.tensor(prompt), cache)
    assert save(session, prompt + [9], cache) == 4  # the sampled token has no row yet
    with pytest.raises(SessionBusy, match="in use by another process"):
        files.open("a")  # this process holds it for writing
    session.close()

    session, cache = files.open("a")
    assert session.tokens == prompt and cache.length == 4
    assert resume(session, cache, prompt + [9, 10]) == [9, 10] and cache.length == 4
    assert resume(session, cache, prompt) == [8] and cache.length == 3  # the last token runs again
    assert resume(session, cache, prompt, reuse=False) == prompt and cache.length == 0
    session.close()

    (tmp_path / "d.kv").mkdir()
    with pytest.raises(SessionUnavailable, match="cannot be opened"):
        files.open("d")
    with pytest.raises(ValueError, match="invalid session name"):
        files.open("../x")
