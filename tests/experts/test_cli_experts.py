"""`latentkv experts convert|verify`: a store converted by the command verifies, one flipped bit
is reported by the expert's name with exit 1, a store of another model is refused (exit 2)."""

from __future__ import annotations

import json

from latentkv.cli import main
from latentkv.experts.store_file import read_manifest


def test_convert_then_verify_then_damage(tmp_path, capsys):
    out = tmp_path / "store"
    assert main(["experts", "convert", "builtin:tiny", "--out", str(out)]) == 0
    assert main(["experts", "convert", "builtin:tiny", "--out", str(out)]) == 2  # exists: needs --force
    capsys.readouterr()
    assert main(["experts", "verify", str(out), "--model", "builtin:tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == 16 and report["damaged"] == []
    entry = read_manifest(out).layers[4]
    path = out / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset(6) + 5] ^= 1
    path.write_bytes(bytes(data))
    assert main(["experts", "verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "1 damaged" in text and "model.layers.4.mlp.experts.6" in text
    assert main(["experts", "verify", str(out), "--model", "builtin:fixture"]) == 2
    assert "another model" in capsys.readouterr().err
    assert main(["experts", "verify", str(tmp_path / "nothing")]) == 2


def test_convert_of_a_builtin_goes_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path))
    assert main(["experts", "convert", "builtin:tiny"]) == 0
    assert len(list(tmp_path.glob("experts/*-f32/manifest.json"))) == 1
