"""OpenAI wire format: response objects, stream chunks and error bodies.

Only shapes live here; no model, no Ray. The request schemas these answer are
``serving.request``'s.
"""


from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve_app.serving.events import (
    Delta,
    Event,
    Failure,
    Finish,
    Reasoning,
    Start,
    TokenLogprob,
    ToolCall,
)
from serve_app.serving.request import ApiError


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    @classmethod
    def of(cls, finish: Finish) -> Usage:
        return cls(finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens,
                   finish.reasoning_tokens)


def now() -> int:
    return int(time.time())


def tool_call_out(call: ToolCall, index: int | None = None) -> dict:
    """A tool call in OpenAI's shape (``index`` in stream deltas)."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **out} if index is not None else out


def _token_entry(t: TokenLogprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}


def reasoning_fields(response_field: str) -> tuple[str, ...]:
    """The chat fields a thought goes out in, for a profile's ``reasoning.response_field``."""
    if response_field == "both":
        return ("reasoning_content", "reasoning")
    return (response_field,)


class ChatWire:
    """``/v1/chat/completions``' shapes: message and delta choices, chat logprobs; a
    thinking model's thought in ``reasoning_content`` (and/or ``reasoning``)."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def reasoning_choice(self, text: str, fields: tuple[str, ...]) -> dict:
        """A stream chunk's choice carrying thought text."""
        return {"index": 0, "delta": dict.fromkeys(fields, text), "finish_reason": None,
                "logprobs": None}

    def opening(self) -> dict | None:
        """The stream's first choice, before any text: the assistant's role."""
        return self.chunk_choice(text="", role=True)

    def chunk_choice(self, *, text: str | None = None, role: bool = False,
                     finish_reason: str | None = None, tool_calls: list[dict] | None = None,
                     logprobs: dict | None = None) -> dict:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}

    def choice(self, text: str, finish_reason: str, tool_calls: list[ToolCall],
               logprobs: tuple[TokenLogprob, ...] | None, reasoning: str | None = None,
               fields: tuple[str, ...] = ()) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if reasoning is not None:
            message.update(dict.fromkeys(fields, reasoning))
        if tool_calls:
            message["tool_calls"] = [tool_call_out(c) for c in tool_calls]
        else:
            message["content"] = text
        return {"index": 0, "message": message, "finish_reason": finish_reason,
                "logprobs": self.logprobs(logprobs)}

    def logprobs(self, entries: tuple[TokenLogprob, ...] | None, offset: int = 0) -> dict | None:
        """``{"content": [...]}``, each entry with its ``top_logprobs``."""
        if entries is None:
            return None
        return {"content": [{**_token_entry(e), "top_logprobs": [_token_entry(t) for t in e.top]}
                            for e in entries],
                "refusal": None}


class CompletionWire:
    """``/v1/completions``' shapes: text choices, the legacy parallel-list logprobs."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def opening(self) -> dict | None:
        return None

    def chunk_choice(self, *, text: str | None = None, role: bool = False,
                     finish_reason: str | None = None, tool_calls: list[dict] | None = None,
                     logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text or "", "finish_reason": finish_reason,
                "logprobs": logprobs}

    def choice(self, text: str, finish_reason: str, tool_calls: list[ToolCall],
               logprobs: tuple[TokenLogprob, ...] | None, reasoning: str | None = None,
               fields: tuple[str, ...] = ()) -> dict:
        return {"index": 0, "text": text, "finish_reason": finish_reason,
                "logprobs": self.logprobs(logprobs)}

    def logprobs(self, entries: tuple[TokenLogprob, ...] | None, offset: int = 0) -> dict | None:
        """Parallel lists; ``text_offset`` counts from ``offset``."""
        if entries is None:
            return None
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
                "text_offset": offsets}


Wire = ChatWire | CompletionWire
CHAT = ChatWire()
COMPLETION = CompletionWire()


class CompletionStream:
    """A replica's events in, one OpenAI endpoint's (``wire``) stream chunks out; the same
    steps keep what the non-streamed answer needs (``response``).

    On ``Start`` (chat) the role chunk, a chunk per ``Reasoning`` (chat: the thought in
    ``fields``), per ``Delta`` and per ``ToolCall``, on
    ``Finish`` the finish chunk and, with ``include_usage``, the usage chunk; a
    ``Failure`` is one ``{"error": ...}`` object. Each ``feed`` returns the chunks to
    send now; ``done`` once the answer ended.
    """

    def __init__(self, wire: Wire, model: str, *, include_usage: bool = False,
                 reasoning_field: str = "reasoning_content") -> None:
        self.wire, self.model, self.include_usage = wire, model, include_usage
        self.fields = reasoning_fields(reasoning_field)
        self._reasoning: list[str] = []
        self.id = f"{wire.id_prefix}-{uuid.uuid4().hex}"
        self.created = now()
        self.done = False
        self.finish: Finish | None = None
        self._text: list[str] = []
        self._calls: list[ToolCall] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._offset = 0  # of the next delta's text

    def feed(self, event: Event) -> list[dict]:
        if isinstance(event, Start):
            opening = self.wire.opening()
            return [self._chunk(opening)] if opening is not None else []
        if isinstance(event, Reasoning):
            if not isinstance(self.wire, ChatWire):
                return []
            self._reasoning.append(event.text)
            return [self._chunk(self.wire.reasoning_choice(event.text, self.fields))]
        if isinstance(event, Delta):
            logprobs = self.wire.logprobs(event.logprobs, self._offset)
            self._offset += len(event.text)
            self._text.append(event.text)
            if event.logprobs is not None:
                self._logprobs = (self._logprobs or []) + list(event.logprobs)
            return [self._chunk(self.wire.chunk_choice(text=event.text, logprobs=logprobs))]
        if isinstance(event, ToolCall):
            call = tool_call_out(event, len(self._calls))
            self._calls.append(event)
            return [self._chunk(self.wire.chunk_choice(tool_calls=[call]))]
        if isinstance(event, Finish):
            self.done, self.finish = True, event
            out = [self._chunk(self.wire.chunk_choice(finish_reason=event.finish_reason))]
            if self.include_usage:
                out.append({**self._chunk(None), "choices": [],
                            "usage": Usage.of(event).to_dict()})
            return out
        if isinstance(event, Failure):
            self.done = True
            return [ApiError.from_failure(event).body()]
        raise ValueError(f"unknown event {event!r}")

    def _chunk(self, choice: dict | None) -> dict:
        return {"id": self.id, "object": self.wire.chunk_object, "created": self.created,
                "model": self.model, "choices": [choice]}

    def response(self) -> dict:
        """The whole answer, once ``Finish`` was fed."""
        if self.finish is None:
            raise ApiError(500, "the model replica ended the request early", type="server_error")
        logprobs = tuple(self._logprobs) if self._logprobs is not None else None
        reasoning = "".join(self._reasoning) if self._reasoning else None
        choice = self.wire.choice("".join(self._text), self.finish.finish_reason, self._calls,
                                  logprobs, reasoning, self.fields)
        return {"id": self.id, "object": self.wire.object, "created": now(), "model": self.model,
                "choices": [choice], "usage": Usage.of(self.finish).to_dict()}


class Collector:
    """A wire stream fed a replica's events with nothing sent; the non-streamed answer is
    then built from what the stream would have sent (``build``), so both answers to one
    generation are the same. One for every API: each passes its stream and builder."""

    def __init__(self, stream: Any, build: Callable[[list[dict]], dict]) -> None:
        self._stream = stream
        self._build = build
        self._events: list[dict] = []

    @property
    def done(self) -> bool:
        return self._stream.done

    def feed(self, event: Event) -> None:
        """Take one event; a ``Failure`` raises its ``ApiError``."""
        if isinstance(event, Failure):
            self._stream.done = True
            raise ApiError.from_failure(event)
        self._events += self._stream.feed(event)

    def response(self) -> dict:
        """The answer; 500 when the replica ended the request before its ``Finish``."""
        if not self._stream.done:
            raise ApiError(500, "the model replica ended the request early", type="server_error")
        return self._build(self._events)


def completion_collector(wire: Wire, model: str,
                         reasoning_field: str = "reasoning_content") -> Collector:
    """The non-streamed OpenAI answer: ``CompletionStream`` keeps what it needs itself."""
    stream = CompletionStream(wire, model, reasoning_field=reasoning_field)
    return Collector(stream, lambda _: stream.response())