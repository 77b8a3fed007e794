"""Streamed text: stop strings against str.find."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from latentkv.tokenizer import StopStrings


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
