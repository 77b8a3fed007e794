"""Streamed text: the windowed detokenizer against whole-sequence decoding, stop strings against str.find."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from latentkv.server.text import REPLACEMENT, Detokenizer, StopStrings
from latentkv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_dir):
    return Tokenizer(tiny_dir)  # 256 tokens, one per byte: multi-byte characters span tokens


def _utf8_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_deltas_add_up_to_the_whole_decode_and_never_end_mid_character(byte_tokenizer, seed):
    rng = random.Random(seed)
    alphabet = "ab \n€é漢字😀"
    text = "".join(rng.choice(alphabet) for _ in range(200))
    ids = _utf8_ids(text)
    detok = Detokenizer(byte_tokenizer)
    deltas = [detok.push(t) for t in ids]
    out = "".join(deltas) + detok.flush()
    assert out == text == byte_tokenizer.decode(ids)
    assert not any(d.endswith(REPLACEMENT) for d in deltas)
    # A character is released with the token that completes it, not later.
    released = 0
    for k, d in enumerate(deltas):
        released += len(d)
        assert released == len(byte_tokenizer.decode(ids[: k + 1]).rstrip(REPLACEMENT))


def test_an_incomplete_character_at_the_end_comes_out_on_flush(byte_tokenizer):
    ids = _utf8_ids("ok") + _utf8_ids("€")[:2]  # the euro sign cut after 2 of its 3 bytes
    detok = Detokenizer(byte_tokenizer)
    assert "".join(detok.push(t) for t in ids) == "ok"
    assert detok.flush() == byte_tokenizer.decode(ids)[2:]
    assert REPLACEMENT in byte_tokenizer.decode(ids)[2:]


def test_invalid_bytes_inside_the_text_are_released_once_text_follows(byte_tokenizer):
    ids = _utf8_ids("a") + [0xFF] + _utf8_ids("bc")
    detok = Detokenizer(byte_tokenizer)
    out = "".join(detok.push(t) for t in ids) + detok.flush()
    assert out == byte_tokenizer.decode(ids)


def _reference(text: str, stops: list[str], bounds: list[int]) -> tuple[str, bool]:
    """Generation stops at the first delta after which the text holds a stop string; the text is cut
    where the earliest-starting one begins."""
    for end in bounds:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_stop_strings_release_exactly_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stopper = StopStrings(stops)
    released, hit = "", False
    for d in deltas:
        out, hit = stopper.push(d)
        released += out
        # Nothing released may be the start of a stop string the rest of the text completes.
        assert released == _reference(text, stops, bounds)[0][: len(released)]
        if hit:
            break
    if not hit:
        released += stopper.flush()
    assert (released, hit) == _reference(text, stops, bounds)


def test_the_tail_that_may_begin_a_stop_is_held_back():
    stopper = StopStrings(["</s>"])
    assert stopper.push("hello </") == ("hello ", False)
    assert stopper.push("x") == ("</x", False)
    assert stopper.push(" </s> more") == (" ", True)
