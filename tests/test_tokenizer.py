"""The byte-level tokenizer (builtin:tiny's) and the incremental detokenizer."""

from __future__ import annotations

import random

import pytest

from latentkv.models.registry import BUILTIN_DIR
from latentkv.tokenizer import (
    REPLACEMENT,
    Detokenizer,
    Tokenizer,
    TokenizerError,
    byte_level_tokenizer_json,
)

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld ñ",
    "中文字符和日本語のテキスト",
    "emoji 😀👍🏽 and flags 🇫🇷",
    "combining e\u0301 and zero\u200bwidth",
    "math ∑∫√ and arrows →⇒",
    "nul \x00 and del \x7f",
    "\ufffd is a real character too",
]


def _random_text(seed: int, n: int = 60) -> str:
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(byte_level_tokenizer_json())
    return Tokenizer(path)


def test_the_bundled_tokenizer_is_the_byte_level_one(tiny_dir, tok):
    bundled = Tokenizer(tiny_dir)
    assert bundled.vocab_size == tok.vocab_size == 256
    for text in SAMPLES:
        assert bundled.encode(text) == tok.encode(text)


@pytest.mark.parametrize("text", SAMPLES + [_random_text(s) for s in range(5)])
def test_ids_are_the_utf8_bytes_and_decode_round_trips(text, tok):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_every_byte_is_one_token(tok):
    for b in range(256):
        assert tok.decode([b]).encode("utf-8", "surrogatepass") in (bytes([b]), "\ufffd".encode())
    assert tok.decode(list(range(0x20, 0x7F))) == bytes(range(0x20, 0x7F)).decode()


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = Detokenizer(tok)
    deltas = [decoder.push(i) for i in ids]
    deltas.append(decoder.flush())
    return deltas


@pytest.mark.parametrize("text", SAMPLES[:-1] + [_random_text(s) for s in range(10, 15)])
def test_detokenizer_emits_whole_characters_only(text, tok):
    """After each byte, the text emitted so far is exactly the complete characters received."""
    ids = tok.encode(text)
    decoder = Detokenizer(tok)
    emitted = ""
    for k, token in enumerate(ids, start=1):
        delta = decoder.push(token)
        assert "\ufffd" not in delta
        emitted += delta
        assert emitted == bytes(ids[:k]).decode("utf-8", errors="ignore")
    emitted += decoder.flush()
    assert emitted == text


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_on_arbitrary_bytes_matches_a_full_decode(seed, tok):
    """Invalid UTF-8 too: whatever the bytes, the deltas add up to the one-shot decode."""
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(80)]
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_detokenizer_holds_back_a_split_character(tok):
    ids = list("a€".encode())  # 61 e2 82 ac
    assert _stream(tok, ids) == ["a", "", "", "€", ""]


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


class _Counting:
    """A tokenizer that counts the ids each decode call is given."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


SPECIAL_RUN = 8  # the longest run of special tokens in a random stream
# The documented bound: a window of 2 * (MAX_HELD + 1) ids plus a run of specials, decoded twice
# per step and once more per held id when the settled text is searched for.
WINDOW = 2 * (Detokenizer.MAX_HELD + 1) + SPECIAL_RUN
PER_STEP = (2 + Detokenizer.MAX_HELD + 1 + SPECIAL_RUN) * WINDOW


def _random_stream(rng: random.Random, vocab: int, n: int, special: list[int]) -> list[int]:
    """Random ids with runs of the kinds that hold text back: multi-byte pieces, specials."""
    ids = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.1 and special:
            ids += [rng.choice(special)] * rng.randint(1, SPECIAL_RUN)  # skipped: decode to nothing
        elif kind < 0.2:
            ids += [rng.randrange(0x80, 0x100) for _ in range(rng.randint(1, 8))]  # stray bytes
        else:
            ids.append(rng.randrange(vocab))
    return ids[:n]


@pytest.mark.parametrize("model", ["tiny", "fixture"])
@pytest.mark.parametrize("seed", range(4))
def test_detokenizer_on_random_streams_adds_up_to_the_full_decode(model, seed):
    """Whatever the ids (invalid UTF-8, specials, multi-byte BPE merges), the deltas plus the
    flush are the one-shot decode, and each step decodes a bounded window, not the output."""
    tok = Tokenizer(BUILTIN_DIR / model)
    special = [i for i in (tok.token_to_id("<|endoftext|>"),) if i is not None]
    rng = random.Random(seed)
    ids = _random_stream(rng, tok.vocab_size, 600, special)
    counting = _Counting(tok)
    detok = Detokenizer(counting)
    deltas = []
    for token in ids:
        before = counting.decoded
        deltas.append(detok.push(token))
        assert counting.decoded - before <= PER_STEP
    out = "".join(deltas) + detok.flush()
    assert out == tok.decode(ids)
    assert counting.decoded < 40 * len(ids)  # re-decoding the output at every step: ~n^2 / 2


@pytest.mark.parametrize("seed", range(3))
def test_detokenizer_releases_a_character_with_the_token_that_completes_it(seed):
    """On valid text from the fixture's BPE, every delta ends on whole characters and is released
    as soon as the ids so far decode to whole characters."""
    tok = Tokenizer(BUILTIN_DIR / "fixture")
    rng = random.Random(seed)
    text = "".join(rng.choice(["the ", "def ", "€", "é", "漢字", "😀", "\n", "x = 1"]) for _ in range(80))
    ids = tok.encode(text, add_special_tokens=False)
    detok = Detokenizer(tok)
    released = ""
    for k, token in enumerate(ids, start=1):
        delta = detok.push(token)
        assert not delta.endswith(REPLACEMENT)
        released += delta
        so_far = tok.decode(ids[:k])
        assert so_far.startswith(released)
        if not so_far.endswith(REPLACEMENT):
            assert released == so_far
    assert released + detok.flush() == text


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer(tmp_path)


def test_chat_template_is_read_from_the_model_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    assert Tokenizer(tmp_path).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert Tokenizer(tmp_path).chat_template == "{{ messages }}"
    (tmp_path / "chat_template.jinja").write_text("jinja wins")
    assert Tokenizer(tmp_path).chat_template == "jinja wins"
