"""Stop strings over streamed text.

Stops are matched on decoded text, not token ids, so a stop string is found
however the tokenizer happened to split it. Text that might be the start of a
stop string is held back until it is known not to be one.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed decoded text in; get back what is safe to emit and whether a stop hit."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._buffer = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, stopped). The stop itself is dropped."""
        if not self.stops:
            return text, False
        self._buffer += text
        hits = [(i, s) for s, i in ((s, self._buffer.find(s)) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            out = self._buffer[:at]
            self._buffer = ""
            return out, True
        hold = self._held_suffix()
        cut = len(self._buffer) - hold
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop."""
        out, self._buffer = self._buffer, ""
        return out

    def _held_suffix(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._buffer)), best, -1):
                if self._buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
