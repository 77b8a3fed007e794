"""Tokenizer: a model directory's tokenizer.json through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


def unicode_problem(text: str, from_bytes: bool = True) -> str | None:
    """Why `text` is not valid Unicode text, or None. The rule on every surface (server fields,
    --prompt, chat's stdin): such text is refused, naming where, never replaced. A character in
    U+DC80..U+DCFF is how Python carries an undecodable byte (argv, stdin with surrogateescape);
    any other surrogate is a lone one (JSON's "\\ud800"); with `from_bytes` False all are."""
    for i, char in enumerate(text):
        code = ord(char)
        if from_bytes and 0xDC80 <= code <= 0xDCFF:
            return f"byte 0x{code - 0xDC00:02x} at character {i} is not valid UTF-8"
        if 0xD800 <= code <= 0xDFFF:
            return f"character {i} is a lone surrogate U+{code:04X}, not a Unicode character"
    return None


def is_valid_text(text: str) -> bool:
    """Fast path of `unicode_problem`: no surrogate anywhere."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"no tokenizer.json at {path}; pass token ids instead (--prompt-ids)")
        if not path.is_file():
            raise TokenizerError(f"{path} is not a regular file")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own kinds
            detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise TokenizerError(f"{path} is not a usable tokenizer.json: {detail}") from None
        self.chat_template = _chat_template(path.parent)

    @classmethod
    def of_model(cls, directory: str | Path) -> Tokenizer | None:
        """A model directory's tokenizer, or None when it has no tokenizer.json (ids only)."""
        return cls(directory) if (Path(directory) / "tokenizer.json").exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """ValueError for text that is not valid Unicode (see `unicode_problem`)."""
        if not is_valid_text(text):
            raise TokenizerError(f"the text is not valid Unicode: {unicode_problem(text)}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each token's character span in `text`), no special tokens added."""
        if not is_valid_text(text):
            raise TokenizerError(f"the text is not valid Unicode: {unicode_problem(text)}")
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character


class Detokenizer:
    """Text deltas of a growing id sequence, at a cost per token that does not grow with the output.

        detok = Detokenizer(tokenizer)
        for token in ...:
            text = detok.push(token)     # "" while held back
        text = detok.flush()             # what is still held back, at the end

    Each step decodes a short window, ids[prefix:], never the whole output: ids[prefix:read]
    were released by the previous delta and stay as context (a decoder's output for a token may
    depend on its neighbours), ids[read:] are new, and the delta is what the new ids add. Text
    is held back while it ends in U+FFFD: a multi-byte character may still be arriving. When
    more than MAX_HELD ids are held (invalid bytes), the text up to the latest id boundary that
    later ids cannot change is released: a boundary where decoding the two sides apart gives
    what decoding them together does, with text on both sides (skipped special tokens decode
    to nothing and cannot tell). So the window stays under 2 * (MAX_HELD + 1) ids plus any run
    of special tokens that follows an incomplete character, and for byte-level tokenizers the
    deltas add up to `tokenizer.decode(ids)` whatever the ids.
    """

    MAX_HELD = 4  # a UTF-8 character is at most 4 bytes, so at most 4 tokens

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window
        self.read = 0  # ids before this were released

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.prefix, self.read)
        after = self._decode(self.prefix, len(self.ids))
        if len(after) >= len(before) and not after.endswith(REPLACEMENT):
            return self._release(before, after, len(self.ids))
        if len(self.ids) - self.read > self.MAX_HELD:
            return self._release_settled(before, after)
        return ""

    def flush(self) -> str:
        """Everything still held back (an incomplete character comes out as U+FFFD)."""
        before = self._decode(self.prefix, self.read)
        after = self._decode(self.prefix, len(self.ids))
        return self._release(before, after, len(self.ids))

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _release(self, before: str, window: str, end: int) -> str:
        """Release the window's text past `before`; ids up to `end` are done."""
        self.prefix, self.read = self.read, end
        return window[len(before) :] if len(window) > len(before) else ""

    def _release_settled(self, before: str, after: str) -> str:
        """The text up to the latest boundary that later ids cannot change (see the class)."""
        for split in range(len(self.ids) - 1, self.read, -1):
            head, tail = self._decode(self.prefix, split), self._decode(split, len(self.ids))
            if tail and head + tail == after:
                return self._release(before, head, split)
        return ""


def _chat_template(directory: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template; TokenizerError (naming
    the file) for one that is not a UTF-8 regular file or not a JSON object."""
    from latentkv.config import ConfigError, read_json_object

    jinja = directory / "chat_template.jinja"
    try:
        if jinja.exists():
            if not jinja.is_file():
                raise TokenizerError(f"{jinja} is not a regular file")
            return jinja.read_bytes().decode("utf-8")
        config = directory / "tokenizer_config.json"
        if config.exists():
            template = read_json_object(config).get("chat_template")
            if isinstance(template, str):
                return template
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{jinja} is not UTF-8 text (byte {exc.start})") from None
    except (ConfigError, OSError) as exc:
        raise TokenizerError(str(exc)) from None
    return None


def byte_level_tokenizer_json() -> str:
    """A tokenizer.json whose 256 tokens are the 256 bytes (GPT-2's byte-to-unicode map)."""
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    assert set(byte_chars.values()) == set(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str(pretty=True)


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class StopStrings:
    """Releases text up to the first stop string; holds back a tail that may begin one, so a
    streamed reader (the server's choices, chat's stop texts) never sees text that a later token
    turns into a stop:

        stops = StopStrings(["\\n\\n"])
        text, hit = stops.push(detok.push(token))     # release `text`; on `hit`, stop
        text = stops.push(detok.flush())[0] + stops.flush()
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """(text to release, whether a stop string was reached; the text ends before it)."""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text, False
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = self._partial(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, at the end of the output (it never became a stop string)."""
        text, self.held = self.held, ""
        return text

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
