"""A thinking request's logits processor: the thought ends at its budget, closed by the
model's own end-of-thinking tokens, and the answer's processors (a JSON schema's or a
forced tool call's grammar) see only the answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from serve_app.reasoning.markers import ThinkingMarkers
from serve_app.reasoning.split import ThoughtSplitter

Processor = Callable[[Any, Any], Any]


def _force(logits: Any, token: int) -> Any:
    """``logits`` with every token but ``token`` at -inf."""
    import mlx.core as mx

    keep = mx.arange(logits.shape[-1]) == token
    return mx.where(keep, logits, mx.array(float("-inf"), dtype=logits.dtype))


def _allow(constrained: Any, logits: Any, token: int) -> Any:
    """``constrained`` with ``token``'s logit as in ``logits`` (a grammar would refuse
    the marker that opens a thought)."""
    import mlx.core as mx

    keep = mx.arange(logits.shape[-1]) == token
    return mx.where(keep, logits, constrained)


class ThoughtGate:
    """``(tokens, logits) -> logits`` for one request, as mlx-lm calls its processors
    (``tokens``: everything the model has seen; the first call sees the prompt alone).

    - Once the thought holds ``budget`` tokens only the closing marker is allowed, token by
      token, and the answer follows (``budget`` None: no limit).
    - ``answer``: makes the answer's processors; they are made when the thought has closed
      (their first call sees prompt and thought as their prompt) or, for an output that may
      open a thought (``may_open``), at its first token, with the opening marker allowed
      beside what they allow (taking it commits the output to a thought: the marker is
      completed and the processors are made again after it). An output that may not open
      one is all answer: the processors hold from its first token.
    Speculative verify steps may take tokens back: the gate follows ``tokens`` as given.
    """

    def __init__(self, markers: ThinkingMarkers, in_thought: bool, budget: int | None,
                 answer: Callable[[], Sequence[Processor]] = tuple,
                 may_open: bool = True) -> None:
        self._markers = markers
        self._may_open = may_open
        self._in_thought = in_thought
        self._budget = budget
        self._answer = answer
        self._start: int | None = None  # where generated tokens begin in ``tokens``
        self._fed: list[int] = []
        self._split = ThoughtSplitter(markers, in_thought)
        self._procs: Sequence[Processor] | None = None  # the answer's, once made
        self._probing = False  # ``_procs`` were made at an output that may open a thought
        self._answer_from: int | None = None  # generated tokens before the answer
        self._resumed = False  # ``begin_at``: generated tokens came before the first call

    @property
    def splitter(self) -> ThoughtSplitter:
        return self._split

    def begin_at(self, start: int) -> None:
        """Generated tokens begin at ``start`` of ``tokens``, not at the first call (a
        resumed request's prompt holds the tokens generated before): the first call
        follows them, and the answer's processors made then follow the answer's."""
        self._start, self._resumed = start, True

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self._start is None:
            self._start = int(tokens.size)
        else:
            self._follow(tokens)
        split = self._split
        if split.thought_done:
            if self._procs is None:
                self._procs = tuple(self._answer())
                if self._resumed:  # the answer began at the thought's end
                    for proc in self._procs:
                        begin_at = getattr(proc, "begin_at", None)  # a grammar's has one
                        if begin_at is not None:
                            begin_at(self._start + split.thought_tokens)
            self._probing = False
            for proc in self._procs:
                logits = proc(tokens, logits)
            return logits
        if split.in_thought:
            self._procs = None
            if self._budget is not None and split.content_tokens + split.held >= self._budget:
                return _force(logits, split.next_marker_token())
            if split.held:  # a closing marker begun is finished
                return _force(logits, split.next_marker_token())
            return logits
        # the output's first token(s): it may open a thought
        if split.held:
            self._procs = None
            return _force(logits, split.next_marker_token())
        procs = tuple(self._answer())
        if not procs:
            return logits
        if not self._may_open:
            self._procs = procs
            for proc in procs:
                logits = proc(tokens, logits)
            return logits
        self._procs, self._probing = procs, True
        constrained = logits
        for proc in procs:
            constrained = proc(tokens, constrained)
        return _allow(constrained, logits, self._markers.start[0])

    def _follow(self, tokens: Any) -> None:
        """Bring the splitter to the generated tokens in ``tokens``, replayed from the start
        when a verify step took some back (the answer's processors are kept while the
        answer still starts where it did: they follow such a step themselves)."""
        assert self._start is not None
        have = int(tokens.size) - self._start
        fed = self._fed
        check = min(len(fed), have, 32)
        tail = tokens[self._start + len(fed) - check:self._start + have].tolist() \
            if have else []
        if have < len(fed) or tail[:check] != fed[len(fed) - check:]:
            answer_from = self._answer_from
            self._fed, self._answer_from = [], None
            self._split = ThoughtSplitter(self._markers, self._in_thought)
            self._feed(tokens[self._start:].tolist() if have else [])
            if self._answer_from != answer_from:
                self._procs, self._probing = None, False
        else:
            self._feed(tail[check:])

    def _feed(self, new: list[int]) -> None:
        for token in new:
            self._fed.append(token)
            self._split.feed(token)
            if self._answer_from is None and self._split.thought_done:
                self._answer_from = len(self._fed)
