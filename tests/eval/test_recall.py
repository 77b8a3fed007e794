"""`eval recall`: planted-identifier cases are what they say (a definition first, the use about D
tokens later, the name's tokens where the case points), the scoring rule counts a case only when
every later token of the name is the argmax, and the CLI's output and errors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from latentkv.cli import main
from latentkv.eval import recall
from latentkv.models.registry import builtin_path
from latentkv.tokenizer import Tokenizer

FIXTURE = builtin_path("fixture")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(FIXTURE)


@pytest.fixture(scope="module")
def cases(tok):
    text = (FIXTURE / "heldout.txt").read_text(encoding="utf-8")
    return recall.planted_cases(text, tok.encode_with_offsets, (128, 512), per=4, seed=3)


def test_cases_plant_a_definition_and_a_late_use(cases, tok):
    assert [c.distance for c in cases] == [128] * 4 + [512] * 4
    for c in cases:
        text = tok.decode(c.ids)
        assert text.startswith(f"{c.name} = ") and text.endswith(c.name)
        assert text.count(c.name) == 2  # the fresh name occurs nowhere else
        assert tok.decode(c.ids[c.first :]) == c.name  # the use starts at `first`, unindented
        assert c.ids[c.first :] == c.ids[: len(c.ids) - c.first]  # tokenized as the definition is
        assert c.distance - 40 <= len(c.ids) <= c.distance  # whole lines, within D tokens
        control = tok.decode(c.control_ids)
        assert control.count(c.name) == 1 and control.endswith(c.name)
        assert tok.decode(c.control_ids[c.control_first :]).strip() == c.name
    again = recall.planted_cases(
        (FIXTURE / "heldout.txt").read_text(encoding="utf-8"), tok.encode_with_offsets, (128, 512), 4, 3
    )
    assert again == cases  # the same seed, the same cases (every tier scores the same ones)


def test_names_are_fresh():
    rng = random.Random(0)
    names = [recall.random_name(rng) for _ in range(200)]
    assert len(set(names)) == 200 and all("_" in n and n.islower() for n in names)


def test_scoring_counts_only_whole_names(cases, tok):
    V = tok.vocab_size

    def oracle(ids):  # one-hot logits of the true next token: every name recalled
        out = torch.zeros(len(ids), V)
        out[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] = 1.0
        return out

    def one_wrong(ids):  # the same with the name's last token wrong
        out = oracle(ids)
        out[len(ids) - 2] = torch.roll(out[len(ids) - 2], 1)
        return out

    assert recall.score(oracle, cases) == {128: (4, 4), 512: (4, 4)}
    assert recall.score(oracle, cases, control=True) == {128: (4, 4), 512: (4, 4)}
    multi = [c for c in cases if len(c.ids) - c.first > 1]  # names of two or more tokens
    assert multi and all(h == 0 for h, _ in recall.score(one_wrong, multi).values())


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", "recall", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_scores_each_tier_and_the_control(capsys):
    code, out, err = _run(
        capsys, "builtin:fixture", "--distances", "96", "--cases", "2", "--kv-cache-dtype", "q8s", "--json"
    )
    assert code == 0, err
    payload = json.loads(out)
    assert [(r["tier"], r["kind"]) for r in payload["rows"]] == [
        ("f32", "planted"),
        ("f32", "control"),
        ("q8s", "planted"),
    ]
    for r in payload["rows"]:
        cell = r["distances"]["96"]
        assert cell["cases"] == 2 and 0 <= cell["hits"] <= 2 and len(cell["ci"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cases", "0"], "--cases must be positive"),
        (["--distances", "5000"], "the model's maximum"),
        (["--distances", "x"], "comma-separated integers"),
    ],
)
def test_cli_bad_flags_are_one_line(capsys, argv, message):
    code, out, err = _run(capsys, "builtin:fixture", *argv)
    assert code == 2 and message in err and "Traceback" not in err
