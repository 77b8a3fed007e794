"""Where models come from: `builtin:NAME` or a directory, with errors that list the choices."""

from __future__ import annotations

import pytest

from latentkv.models.registry import BUILTINS, ModelNotFound, builtin_path, resolve


def test_builtin_tiny_resolves_to_the_bundled_directory(tiny_dir):
    assert resolve("builtin:tiny") == builtin_path("tiny") == tiny_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_dir / name).is_file()


def test_unknown_builtin_lists_the_available_ones():
    with pytest.raises(ModelNotFound, match="unknown builtin model 'nope'") as err:
        resolve("builtin:nope")
    for name in BUILTINS:
        assert f"builtin:{name}" in str(err.value)


def test_a_directory_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve(str(tmp_path)) == tmp_path


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelNotFound, match="is not a directory") as err:
        resolve(str(tmp_path / "missing"))
    assert "builtin:tiny" in str(err.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelNotFound, match="is not a directory"):
        resolve(str(tmp_path / "file"))


def test_a_directory_without_config_json(tmp_path):
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve(str(tmp_path))
