"""Streamed text -> what a client may see: stop strings.

    detok = Detokenizer(tokenizer)                    # latentkv.tokenizer: ids -> text deltas
    stops = StopStrings(["\\n\\n"])
    for token in ...:
        text, hit = stops.push(detok.push(token))     # release `text`; on `hit`, cancel and stop
    text = stops.push(detok.flush())[0] + stops.flush()

StopStrings holds back the longest tail that could still begin a stop string, so a streamed
client never sees text that a later token turns into a stop.
"""

from __future__ import annotations


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
