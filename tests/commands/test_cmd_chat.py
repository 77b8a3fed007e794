"""`latentkv chat`: turns read from a pipe, the conversation kept in a session and resumed after a
restart with nothing prefilled again, /reset and /exit, and chat templates rendered piecewise in
a sandbox."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from latentkv.chat_template import ChatTemplateError, PlainFormat, TemplateFormat
from latentkv.cli import main
from latentkv.kv.store import KVFile
from latentkv.models.registry import BUILTIN_DIR

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _saved(path: Path) -> bytes:
    with KVFile.open(path) as f:
        return bytes(f.load().tokens)  # builtin:tiny's tokens are bytes


def _chat_subprocess(tmp_path: Path, text: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KV8", "KV_TQ", "KV_TQ_POLAR")}
    env.update(LATENTKV_THREADS="1", LATENTKV_CACHE=str(tmp_path / "cache"))
    argv = ["chat", "builtin:tiny", "--session", "c", "--kv-dir", str(tmp_path), "--max-tokens", "8", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "latentkv.cli", *argv],
        input=text,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_two_turns_through_a_pipe_then_a_restart_resumes_without_prefilling_them(tmp_path):
    one = _chat_subprocess(tmp_path, "hello\nhow are you\n")
    assert "plain User/Assistant format" in one.stderr
    reused = [int(n) for n in re.findall(r"\[reused (\d+) tokens", one.stderr)]
    assert reused[0] == 0 and reused[1] > 0  # the second turn reused the first
    saved = _saved(tmp_path / "c.kv")
    assert saved.startswith(b"User: hello\nAssistant:") and b"\nUser: how are you\nAssistant:" in saved
    assert saved.endswith(b"\n")  # the turn ended by feeding the reply's end: nothing left over

    two = _chat_subprocess(tmp_path, "again\n", "--system", "ignored")
    assert f"resumed {len(saved)} tokens" in two.stderr and "keeps its own" in two.stderr
    new = len(b"User: again\nAssistant:")
    assert f"[reused {len(saved)} tokens, prefilled {new} " in two.stderr
    assert _saved(tmp_path / "c.kv").startswith(saved + b"User: again\nAssistant:")


def _chat(monkeypatch, capsys, text: str, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = main(["chat", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_reset_empties_the_session_and_exit_stops_reading(tmp_path, monkeypatch, capsys):
    flags = ["builtin:tiny", "--session", "r", "--kv-dir", str(tmp_path), "--max-tokens", "4"]
    code, out, err = _chat(monkeypatch, capsys, "one\n/reset\ntwo\n/exit\nthree\n", *flags, "--system", "S")
    assert code == 0 and "started over" in err
    assert out.count("\n") == 2  # two replies, one line each; "three" was never read
    assert _saved(tmp_path / "r.kv").startswith(b"S\n\nUser: two\nAssistant:")
    code, _, err = _chat(monkeypatch, capsys, "/reset\n", *flags)
    assert code == 0 and _saved(tmp_path / "r.kv") == b""


def test_chat_without_a_session_keeps_the_conversation_in_memory(tmp_path, monkeypatch, capsys):
    code, out, err = _chat(monkeypatch, capsys, "a\nb\n", "builtin:tiny", "--max-tokens", "3")
    assert code == 0 and "[reused 0 tokens" in err and "[reused 0 tokens" not in err.split("\n", 2)[-1]


@pytest.fixture
def template_model(tmp_path) -> Path:
    """builtin:tiny with a chat template (its byte tokenizer spells the markers out)."""
    directory = tmp_path / "templated"
    shutil.copytree(BUILTIN_DIR / "tiny", directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "^", "chat_template": CHATML}))
    return directory


def test_a_chat_template_is_rendered_piecewise_into_the_whole_conversation(
    template_model, tmp_path, monkeypatch, capsys
):
    flags = [str(template_model), "--session", "t", "--kv-dir", str(tmp_path), "--max-tokens", "4"]
    code, _, err = _chat(monkeypatch, capsys, "hi\nmore\n", *flags, "--system", "be brief")
    assert code == 0 and "the model's chat template" in err
    saved = _saved(tmp_path / "t.kv").decode("latin-1")
    fmt = TemplateFormat(CHATML, {"bos_token": "^"})
    turns = re.fullmatch(
        r"(.*<\|assistant\|>)(.*?)<\|end\|>\n(<\|user\|>more.*<\|assistant\|>)(.*?)<\|end\|>\n", saved, re.S
    )
    assert turns, saved
    first, reply, second, reply2 = turns.groups()
    assert (
        first == fmt.first("be brief", "hi") == "^<|system|>be brief<|end|>\n<|user|>hi<|end|>\n<|assistant|>"
    )
    assert second == fmt.next("more") == "<|user|>more<|end|>\n<|assistant|>"
    whole = fmt.render(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": reply2},
        ],
        False,
    )
    if reply.strip() == reply and reply2.strip() == reply2:  # the template trims what it shows
        assert saved == whole


def test_template_pieces_and_refusals():
    fmt = TemplateFormat(CHATML, {"bos_token": "<s>"})
    assert fmt.closing == "<|end|>\n"
    assert fmt.next("q") == "<|user|>q<|end|>\n<|assistant|>"
    plain = PlainFormat()
    assert plain.first("sys", "q") == "sys\n\nUser: q\nAssistant:" and plain.closing == "\n"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        TemplateFormat("{% for %}", {})
    with pytest.raises(ChatTemplateError, match="failed"):  # the sandbox refuses attribute tricks
        TemplateFormat("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError, match="failed: roles"):
        TemplateFormat("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(ChatTemplateError, match="differently"):  # only the last turn is shown
        TemplateFormat("{{ messages[-1]['content'] }}", {})


def test_a_template_that_cannot_go_piecewise_falls_back_to_plain(
    template_model, tmp_path, monkeypatch, capsys
):
    (template_model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[-1]['content'] }}"})
    )
    code, _, err = _chat(monkeypatch, capsys, "hi\n", str(template_model), "--max-tokens", "2")
    assert code == 0 and "using the plain format instead" in err


# --- the plain format's stop text and --json -------------------------------------------------


def _scripted(monkeypatch, text: bytes) -> None:
    """builtin:tiny 'writes' `text` (its byte tokenizer: one token per byte), then spaces."""
    script = iter(text)
    monkeypatch.setattr("latentkv.engine.generate.sample", lambda *a, **k: next(script, ord(" ")))


def test_the_plain_format_stops_where_the_model_writes_the_next_user_turn(tmp_path, monkeypatch, capsys):
    _scripted(monkeypatch, b" ok\nUser:" + b" fine\nUser:")  # each turn stops at its ":"
    flags = ["builtin:tiny", "--session", "s", "--kv-dir", str(tmp_path), "--max-tokens", "40"]
    code, out, err = _chat(monkeypatch, capsys, "hello\nagain\n", *flags)
    assert code == 0, err
    assert out == " ok\n fine\n"  # "\nUser" was held back, never shown
    # the file holds each reply up to the stop text, then the closing: nothing the model made up
    assert _saved(tmp_path / "s.kv") == b"User: hello\nAssistant: ok\nUser: again\nAssistant: fine\n"


def test_chat_json_writes_one_object_per_turn(tmp_path, monkeypatch, capsys):
    _scripted(monkeypatch, b" hi\nUser:" + b" x")
    flags = ["builtin:tiny", "--max-tokens", "9", "--json"]
    code, out, err = _chat(monkeypatch, capsys, "a\nb\n", *flags)
    assert code == 0, err
    first, second = (json.loads(line) for line in out.splitlines())
    assert (first["user"], first["reply"], first["finish_reason"]) == ("a", " hi", "stop")
    assert (second["user"], second["reply"], second["finish_reason"]) == ("b", " x" + " " * 7, "length")
    assert first["conversation_tokens"] == len(b"User: a\nAssistant: hi\n")
    assert second["reused_tokens"] == first["conversation_tokens"] and second["session"] is None
    assert second["stats"]["generated_tokens"] == 9 and "decode_tps" in second["stats"]


@pytest.mark.parametrize(
    ("deltas", "shown", "text", "stopped"),
    [
        (["a\n", "Us", "er", ": b"], ["a", "", "", ""], "a", True),
        (["a\nUs", "ually"], ["a", "\nUsually"], "a\nUsually", False),
        (["x\nUser:"], ["x"], "x", True),
        (["\n"], [""], "\n", False),  # held until flush
    ],
)
def test_held_text_never_shows_the_start_of_a_stop_text(deltas, shown, text, stopped):
    from latentkv.tokenizer import StopStrings

    stops = StopStrings(list(PlainFormat.stop_texts))
    pushed = [stops.push(d) for d in deltas]
    assert [t for t, _ in pushed] == shown
    assert any(hit for _, hit in pushed) == stopped
    assert "".join(shown) + ("" if stopped else stops.flush()) == text
