"""MODEL as a Hugging Face repo id, found offline in a hub cache the test builds (no network)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from latentkv.cli import main
from latentkv.config import hf_hub_cache
from latentkv.models.hub import parse_repo_id
from latentkv.models.registry import ModelNotFound, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def cache_with(hub: Path, repo: str, source: Path, commit: str = COMMIT, refs=("main",)) -> Path:
    """A hub cache entry laid out as `hf download` leaves it: refs/NAME holds the commit, the
    snapshot's files are links into blobs/."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in source.iterdir():
        blob = root / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copy2(f, blob)
        (snapshot / f.name).symlink_to(blob)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def no_network(*args, **kwargs):
        raise AssertionError("resolving a repo id opened a socket")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("zai-org/GLM-5", ("zai-org/GLM-5", None)),
        ("deepseek-ai/DeepSeek-V3@main", ("deepseek-ai/DeepSeek-V3", "main")),
        (f"org/name.v2@{COMMIT}", ("org/name.v2", COMMIT)),
        ("builtin:tiny", None),
        ("/abs/path", None),
        ("./org/name", None),
        ("a/b/c", None),
        ("org/../x", None),
        ("org/name@", None),
        ("~/models", None),
    ],
)
def test_what_reads_as_a_repo_id(text, parsed):
    assert parse_repo_id(text) == parsed


def test_a_cached_repo_resolves_to_its_snapshot_at_main_a_tag_or_a_commit(hub, tiny_dir):
    snapshot = cache_with(hub, "org/tiny", tiny_dir, refs=("main", "v1"))
    cache_with(hub, "org/tiny", tiny_dir, commit=OTHER, refs=())
    assert resolve("org/tiny") == snapshot
    assert resolve("org/tiny@v1") == snapshot
    assert resolve(f"org/tiny@{OTHER}") == snapshot.parent / OTHER


def test_hf_home_is_the_fallback_for_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hf_hub_cache() == tmp_path / "hfhome" / "hub"


@pytest.mark.parametrize(
    "model, command",
    [("org/absent", "hf download org/absent"), ("org/tiny@v9", "hf download org/tiny --revision v9")],
)
def test_a_repo_not_in_the_cache_is_one_line_with_where_and_how(hub, tiny_dir, model, command):
    cache_with(hub, "org/tiny", tiny_dir)
    with pytest.raises(ModelNotFound) as err:
        resolve(model)
    message = str(err.value)
    assert "\n" not in message
    assert str(hub) in message
    assert f"`{command}`" in message


def test_a_local_folder_wins_over_the_cache(hub, tiny_dir, tmp_path, monkeypatch):
    cache_with(hub, "org/tiny", tiny_dir)
    local = tmp_path / "work" / "org" / "tiny"
    shutil.copytree(tiny_dir, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve("org/tiny") == Path("org/tiny")


def test_generate_runs_a_cached_repo_and_a_missing_one_exits_2(hub, tiny_dir, capsys):
    cache_with(hub, "org/tiny", tiny_dir)
    argv = ["generate", "--prompt-ids", "5,6,7", "--max-tokens", "3", "--json"]
    assert main([argv[0], "builtin:tiny", *argv[1:]]) == 0
    expected = json.loads(capsys.readouterr().out)["tokens"]
    assert main([argv[0], "org/tiny", *argv[1:]]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == expected
    assert main([argv[0], "org/absent", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert "hf download org/absent" in err and "Traceback" not in err
