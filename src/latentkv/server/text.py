"""Token ids -> streamed text: incremental detokenization and stop strings.

    detok = Detokenizer(tokenizer)
    stops = StopStrings(["\\n\\n"])
    for token in ...:
        text, hit = stops.push(detok.push(token))     # release `text`; on `hit`, cancel and stop
    text = stops.push(detok.flush())[0] + stops.flush()

The detokenizer decodes a short window of recent ids, never the whole output again, and holds
back text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token completes it
(or the output ends). StopStrings holds back the longest tail that could still begin a stop
string, so a streamed client never sees text that a later token turns into a stop.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Text deltas of a growing id sequence (vLLM's prefix/read offsets)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already released (the window's context)
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a multi-byte character still arriving
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is still held back (an incomplete character comes out as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopStrings:
    """Releases text up to the first stop string; holds back a tail that may begin one."""

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
