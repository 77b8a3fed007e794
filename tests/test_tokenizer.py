"""The byte-level tokenizer (builtin:tiny's) and the streaming decoder."""

from __future__ import annotations

import random

import pytest

from latentkv.tokenizer import StreamDecoder, Tokenizer, TokenizerError, byte_level_tokenizer_json

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
    decoder = StreamDecoder(tok)
    deltas = [decoder.push(i) for i in ids]
    deltas.append(decoder.flush())
    return deltas


@pytest.mark.parametrize("text", SAMPLES[:-1] + [_random_text(s) for s in range(10, 15)])
def test_stream_decoder_emits_whole_characters_only(text, tok):
    """After each byte, the text emitted so far is exactly the complete characters received."""
    ids = tok.encode(text)
    decoder = StreamDecoder(tok)
    emitted = ""
    for k, token in enumerate(ids, start=1):
        delta = decoder.push(token)
        assert "\ufffd" not in delta
        emitted += delta
        assert emitted == bytes(ids[:k]).decode("utf-8", errors="ignore")
    emitted += decoder.flush()
    assert emitted == text


@pytest.mark.parametrize("seed", range(5))
def test_stream_decoder_on_arbitrary_bytes_matches_a_full_decode(seed, tok):
    """Invalid UTF-8 too: whatever the bytes, the deltas add up to the one-shot decode."""
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(80)]
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_stream_decoder_holds_back_a_split_character(tok):
    ids = list("a€".encode())  # 61 e2 82 ac
    assert _stream(tok, ids) == ["a", "", "", "€", ""]


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
