"""What a model replica sends the ingress for one request: typed events.

A replica's stream is batches (lists) of events: first ``[Start]`` (admitted) or
``[Failure]``, then ``Delta`` text and ``ToolCall`` s, then one ``Finish`` (or a
``Failure``). A batch with output carries ``Tokens`` after it (before a ``Finish``): the
ids generated since the last such batch, from which another replica can continue the
request (``api/resume.py``). Each API turns the same events into its own wire format
(``openai_api.CompletionStream``, ``anthropic_api.MessageStream``,
``responses_api.ResponseStream``). Plain frozen dataclasses: they pickle across Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.serving.tools import ToolCall

__all__ = ["Delta", "Event", "Failure", "Finish", "Reasoning", "Start", "TokenLogprob",
           "Tokens", "ToolCall"]


@dataclass(frozen=True, slots=True)
class Start:
    """The replica admitted the request; ``cached_tokens`` are planned to be restored."""

    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability: its text, raw bytes and (for a generated token) the
    most likely alternatives."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """Generated text; ``logprobs`` (when the request asked) one entry a token."""

    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None

    def merged(self, after: Delta) -> Delta:
        """This delta followed by ``after``, as one."""
        if self.logprobs is None and after.logprobs is None:
            return Delta(self.text + after.text)
        return Delta(self.text + after.text, (self.logprobs or ()) + (after.logprobs or ()))


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A thinking model's thought text (never part of the answer's ``Delta`` s)."""

    text: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a generation, with its usage (``cached_tokens`` as really restored)."""

    finish_reason: str  # stop, length or tool_calls
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    seconds: float = 0.0
    stop_sequence: str | None = None
    reasoning_tokens: int = 0  # of completion_tokens, the thought's (its markers too)


@dataclass(frozen=True, slots=True)
class Tokens:
    """The token ids whose output the events before it in its batch (and in earlier
    batches since the last ``Tokens``) carry: what the ingress resends to continue the
    request elsewhere if its replica is lost. Never reaches an API's wire format."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """An error, as ``serving.request.ApiError`` carries it (``ApiError.to_failure`` /
    ``from_failure``)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


Event = Start | Reasoning | Delta | ToolCall | Tokens | Finish | Failure
