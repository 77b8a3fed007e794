"""Planted-identifier recall: does the model (through a KV tier) use context N tokens back?

A case is held-out code with a definition `NAME = <int>` planted as its first line and a bare,
unindented use of NAME at the start of a line as many whole lines later as fit in `distance`
tokens in all (the use ends 8-24 tokens short of it, less a partial line). The use is unindented
so that it is tokenized as the definition is: a byte-level BPE joins an indent's last space to the
word after it (`Ġk` where the definition has `k`), which would test how the model aliases two
spellings of a token rather than whether it reaches back to the definition.
NAME is fresh and random (`kovu_relami`: two parts of 2-3 consonant-vowel syllables), so nothing
but the definition says how it continues. The model is scored on the use: given everything up
to and including the name's first token, is every later token of the name the argmax? (That is
what greedy decoding would produce.) The control removes the definition line: the same cases,
scored the same way, must fail, or the test measures guessing rather than recall.

Cases depend only on the text, the tokenizer and the seed, so every tier (and the trainer,
tools/train_moe.py, which tracks this during training) scores the same ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
DISTANCES = (512, 1024, 2048, 4096)

Encode = Callable[[str], tuple[list[int], list[tuple[int, int]]]]  # text -> (ids, char offsets)


def random_name(rng: random.Random) -> str:
    """A fresh identifier: two parts of 2-3 consonant-vowel syllables joined by '_'."""

    def part() -> str:
        return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(2, 3)))

    return f"{part()}_{part()}"


@dataclass(frozen=True)
class Case:
    distance: int
    ids: list[int]  # definition line, code and the name (the use)
    first: int  # position of the name's first token at the use
    name: str
    control_ids: list[int]  # the same without the definition line
    control_first: int


def _first_token_at(offsets: Sequence[tuple[int, int]], char: int) -> int:
    return next(i for i, (_a, b) in enumerate(offsets) if b > char)


def planted_cases(
    text: str, encode: Encode, distances: Sequence[int] = DISTANCES, per: int = 16, seed: int = 1
) -> list[Case]:
    """`per` cases at each distance (tokens from the definition line to the use), from random
    places in `text` (whole lines)."""
    rng = random.Random(seed)
    cases = []
    for d in distances:
        for _ in range(per):
            name = random_name(rng)
            start = text.find("\n", rng.randrange(0, max(1, len(text) - 8 * d))) + 1
            lines = text[start : start + 6 * d].splitlines(keepends=True)
            definition = f"{name} = {rng.randint(0, 999)}\n"
            n_def = len(encode(definition)[0])
            kept: list[str] = []
            for line in lines:  # whole lines while the use stays within d tokens of the text's start
                if n_def + len(encode("".join(kept) + line)[0]) > d - 24:
                    break
                kept.append(line)
            body = "".join(kept)
            ids, offsets = encode(definition + body + name)
            control, control_offsets = encode(body + name)
            cases.append(
                Case(
                    distance=d,
                    ids=ids,
                    first=_first_token_at(offsets, len(definition + body)),
                    name=name,
                    control_ids=control,
                    control_first=_first_token_at(control_offsets, len(body)),
                )
            )
    return cases


def recalled(logits: torch.Tensor, ids: Sequence[int], first: int) -> bool:
    """logits [S, V] of `ids`: are all the name's tokens after `first` the argmax?"""
    target = torch.tensor(ids[first + 1 :])
    return bool((logits[first : len(ids) - 1].argmax(-1) == target).all())


def score(
    logits_of: Callable[[list[int]], torch.Tensor], cases: Sequence[Case], control: bool = False
) -> dict:
    """Recall per distance: {distance: (hits, cases)}; `logits_of(ids)` -> [S, V]."""
    out: dict[int, list[int]] = {}
    for c in cases:
        ids, first = (c.control_ids, c.control_first) if control else (c.ids, c.first)
        hit = recalled(logits_of(ids), ids, first)
        tally = out.setdefault(c.distance, [0, 0])
        tally[0] += hit
        tally[1] += 1
    return {d: tuple(v) for d, v in sorted(out.items())}
