"""The CLI under hypothesis (issue 13): random flag values, and model folders with random
damage. Every run ends with exit status 0, 1 or 2; a refusal is one `latentkv CMD: error:`
line and never a traceback (an exception escaping `main` fails the case); nothing is written
outside the folders the run was given; each case ends within seconds.

Runs in-process (`latentkv.cli.main`): the tiny model loads in a fraction of a second.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import time

import pytest
import torch
from budget import long, quick
from hypothesis import given
from hypothesis import strategies as st

from latentkv.cli import main
from latentkv.models.registry import resolve

SECONDS_PER_CASE = 60

FLAG_VALUES = {
    "--temperature": ["0", "0.7", "nan", "inf", "-inf", "-1", "1e-300", "5e-324", "1e300", "abc", ""],
    "--top-p": ["1", "0.5", "0", "1e-46", "nan", "inf", "-0.1", "1.5", "x"],
    "--top-k": ["0", "1", "5", "-1", "1000000", "1.5", "x"],
    "--seed": ["0", "7", "-1", str(2**64), str(2**64 - 1), "x"],
    "--threads": ["1", "2", "0", "-1", "100000", "x"],
    "--kv-cache-dtype": ["f32", "bf16", "fp8", "tq4", "tq2", "polar3", "tq4-r8", "bogus", "", "f32,tq4"],
    "--kv-group-size": ["8", "16", "3", "0", "-1", "1000", "x"],
    "--kv-seed": ["0", "7", "0x10", "-1", str(2**70), "x"],
    "--kv-recent-window": ["0", "4", "-1", "x"],
    "--weight-dtype": ["f32", "bf16", "int3"],
    "--max-tokens": ["0", "1", "3", "-1", "x", "1e3"],
}
TEXTS = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["caf\udce9", "lone \ud800", "", " ", "\x00", "é" * 50]),
)
IDS = st.one_of(
    st.lists(st.integers(-3, 300), max_size=6).map(lambda xs: ",".join(map(str, xs))),
    st.sampled_from(["", ",", "1,,2", "x", "1.5", " 5 , 6 ", str(2**40)]),
)
SESSIONS = st.sampled_from(["s", "../x", "", "a" * 200, ".hidden", "ok-1.2_3", "caf\udce9", "/abs"])


def _run(argv: list[str], stdin: str = "") -> None:
    """main(argv): exit 0/1/2, a refusal as one error line, never an escaping exception."""
    threads = torch.get_num_threads()
    old_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8", "surrogateescape")), encoding="utf-8")
    err, old_err, old_out = io.StringIO(), sys.stderr, sys.stdout
    sys.stderr, sys.stdout = err, io.StringIO()
    t0 = time.monotonic()
    try:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage + one error line, status 2
            code = exc.code
    finally:
        sys.stdin, sys.stderr, sys.stdout = old_stdin, old_err, old_out
        torch.set_num_threads(threads)
    text = err.getvalue()
    assert code in (0, 1, 2), (argv, code, text[-2000:])
    assert "Traceback" not in text, text
    if code == 2:
        errors = [line for line in text.splitlines() if ": error: " in line]
        assert len(errors) == 1, (argv, text[-2000:])
    assert time.monotonic() - t0 < SECONDS_PER_CASE


@st.composite
def flag_sets(draw) -> list[str]:
    names = draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), max_size=4, unique=True))
    argv = [f"{name}={draw(st.sampled_from(FLAG_VALUES[name]))}" for name in names]
    if "--max-tokens" not in names:
        argv.append("--max-tokens=2")
    return argv


def _fuzz_flags(tmp_path_factory, data) -> None:
    root = tmp_path_factory.mktemp("cli")
    kv = root / "kv"
    argv = ["generate", "builtin:tiny", *data.draw(flag_sets(), label="flags")]
    if data.draw(st.booleans(), label="text prompt"):
        argv += ["--prompt", data.draw(TEXTS, label="prompt")]
    else:
        argv += [f"--prompt-ids={data.draw(IDS, label='ids')}"]
    if data.draw(st.booleans(), label="session"):
        argv += ["--session", data.draw(SESSIONS, label="name"), "--kv-dir", str(kv)]
    _run(argv)
    assert {p.name for p in root.iterdir()} <= {"kv"}  # nothing written beside the KV folder


# --- model-folder damage ------------------------------------------------------------------------

FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
]
JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.text(max_size=8),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def damages(draw):
    """(file, how, payload): what to do to one file of a copy of builtin:tiny's folder."""
    file = draw(st.sampled_from([*FILES, "model.safetensors"]))
    how = draw(st.sampled_from(["bytes", "truncate", "json", "directory", "delete", "key"]))
    if how == "bytes":
        return file, how, draw(st.binary(max_size=64))
    if how == "truncate":
        return file, how, draw(st.integers(0, 4096))
    if how in ("json", "key"):
        key = draw(
            st.sampled_from(
                [
                    "hidden_size",
                    "num_hidden_layers",
                    "vocab_size",
                    "kv_lora_rank",
                    "eos_token_id",
                    "n_routed_experts",
                    "num_experts_per_tok",
                    "rope_parameters",
                    "model_type",
                    "max_position_embeddings",
                    "chat_template",
                    "index_topk",
                    "mlp_layer_types",
                ]
            )
        )
        return file, how, (key, draw(JSON_VALUES))
    return file, how, None


def _damaged_copy(root, damage):
    source = resolve("builtin:tiny")
    folder = root / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    file, how, payload = damage
    path = folder / file
    if file == "model.safetensors":
        shutil.copy(source / file, path)  # damaged in place: a copy, never the bundled one
    else:
        (folder / "model.safetensors").symlink_to(source / "model.safetensors")
        if not path.exists():
            path.write_text("{}")  # an optional file, present so it can be damaged
    if how == "bytes":
        path.write_bytes(payload)
    elif how == "truncate" and path.exists():
        with open(path, "r+b") as f:
            f.truncate(min(payload, path.stat().st_size))
    elif how == "json":
        path.write_text(json.dumps({payload[0]: payload[1]} if file != "model.safetensors" else payload[1]))
    elif how == "key" and file != "model.safetensors":
        raw = json.loads(path.read_text() or "{}")
        raw = raw if isinstance(raw, dict) else {}
        raw[payload[0]] = payload[1]
        path.write_text(json.dumps(raw))
    elif how == "directory":
        if path.exists() or path.is_symlink():
            path.unlink()
        path.mkdir()
    elif how == "delete" and (path.exists() or path.is_symlink()):
        path.unlink()
    return folder


def _fuzz_folder(tmp_path_factory, data) -> None:
    root = tmp_path_factory.mktemp("folder")
    folder = _damaged_copy(root, data.draw(damages(), label="damage"))
    before = sorted(p.name for p in folder.iterdir())
    command = data.draw(st.sampled_from(["generate", "chat", "inspect"]), label="command")
    if command == "generate":
        _run(["generate", str(folder), "--prompt-ids", "5,6", "--max-tokens", "2"])
    elif command == "chat":
        _run(["chat", str(folder), "--max-tokens", "2"], stdin="hello\n")
    else:  # a KV file checked against the damaged model
        _run(["kv", "inspect", str(folder / "config.json"), "--model", str(folder)])
    assert sorted(p.name for p in folder.iterdir()) == before  # the folder is only read


@quick()
@given(data=st.data())
def test_random_flags_exit_0_1_or_2_with_one_line(tmp_path_factory, data):
    _fuzz_flags(tmp_path_factory, data)


@quick()
@given(data=st.data())
def test_damaged_model_folders_are_one_line_never_a_traceback(tmp_path_factory, data):
    _fuzz_folder(tmp_path_factory, data)


@pytest.mark.slow
@long(scale=0.5)
@given(data=st.data())
def test_random_flags_long(tmp_path_factory, data):
    _fuzz_flags(tmp_path_factory, data)


@pytest.mark.slow
@long(scale=0.5)
@given(data=st.data())
def test_damaged_model_folders_long(tmp_path_factory, data):
    _fuzz_folder(tmp_path_factory, data)
