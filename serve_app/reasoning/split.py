"""One request's generated tokens split into thought and answer, on token ids, as they
come (a marker of several tokens may span decode steps)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from serve_app.reasoning.markers import ThinkingMarkers


class Part(Enum):
    THOUGHT = "thought"
    ANSWER = "answer"
    MARKER = "marker"  # an opening or closing marker's token: neither thought nor answer


def _rfind(tokens: Sequence[int], seq: tuple[int, ...]) -> int:
    n = len(seq)
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i:i + n]) == seq:
            return i
    return -1


def opens_in_thought(prompt: Sequence[int], markers: ThinkingMarkers,
                     window: int = 64) -> bool:
    """Whether the prompt leaves a thought open for the output to continue: the template
    opened one in its generation prompt (Qwen3.5, DeepSeek-R1), or a client's final
    assistant message did. Only the prompt's tail is read: earlier turns' thoughts are
    closed, and the generation prompt is short."""
    tail = prompt[-window:]
    start, end = _rfind(tail, markers.start), _rfind(tail, markers.end)
    return start >= 0 and start > end


def closes_at_end(prompt: Sequence[int], markers: ThinkingMarkers, window: int = 8) -> bool:
    """Whether the prompt ends with a closed thought (``<think>\n\n</think>\n\n``: a
    template's thinking off)."""
    return _rfind(prompt[-window:], markers.end) >= 0


class ThoughtSplitter:
    """Which part each generated token is: a thought opened by the prompt or by the output's
    first tokens runs until the closing marker; everything after it, and everything of an
    output that does not open with a thought, is the answer (one thought per output, as the
    templates render it)."""

    def __init__(self, markers: ThinkingMarkers, in_thought: bool) -> None:
        self.markers = markers
        self._state = "thought" if in_thought else "opening"
        self._held: list[int] = []  # tokens that may begin the marker looked for
        self.thought_tokens = 0  # thought and marker tokens generated (reasoning tokens)
        self.content_tokens = 0  # the thought's own tokens, markers not counted

    @property
    def in_thought(self) -> bool:
        return self._state == "thought"

    @property
    def thought_done(self) -> bool:
        """The output is past its thought (or never had one)."""
        return self._state == "answer"

    def feed(self, token: int) -> list[tuple[Part, int]]:
        """``token``'s part, with any held tokens it resolves (in order); a token that may
        begin a marker is held until the marker is complete or ruled out."""
        if self._state == "answer":
            return [(Part.ANSWER, token)]
        want = self.markers.start if self._state == "opening" else self.markers.end
        self._held.append(token)
        if tuple(self._held) == want:
            out = [(Part.MARKER, t) for t in self._held]
            self.thought_tokens += len(self._held)
            self._held = []
            self._state = "thought" if self._state == "opening" else "answer"
            return out
        if tuple(self._held) == want[:len(self._held)]:
            return []  # the marker may still be coming
        held, self._held = self._held, []
        if self._state == "opening":  # the output does not open with a thought
            self._state = "answer"
            return [(Part.ANSWER, t) for t in held]
        # the first held token is thought; the rest may begin the marker afresh
        first, rest = held[0], held[1:]
        out = [(Part.THOUGHT, first)]
        self.thought_tokens += 1
        self.content_tokens += 1
        for t in rest:
            out.extend(self.feed(t))
        return out

    @property
    def held(self) -> int:
        """Tokens held as the possible start of the marker looked for."""
        return len(self._held)

    def next_marker_token(self) -> int:
        """The token that continues (or starts) the marker looked for now."""
        want = self.markers.start if self._state == "opening" else self.markers.end
        return want[len(self._held)]

    def flush(self) -> list[tuple[Part, int]]:
        """What is held at the output's end (a marker that never completed)."""
        held, self._held = self._held, []
        part = Part.THOUGHT if self._state == "thought" else Part.ANSWER
        if part is Part.THOUGHT:
            self.thought_tokens += len(held)
            self.content_tokens += len(held)
        return [(part, t) for t in held]
