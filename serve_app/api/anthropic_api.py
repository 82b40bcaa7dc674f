"""Anthropic Messages API wire format: requests, errors, responses and SSE streams.

Pure translation, no model and no Ray: a ``/v1/messages`` body becomes a
``ChatInput`` (OpenAI-style chat messages, as a chat template expects them),
and the replica's typed events (``serve_app.serving.events``: ``Start``, ``Delta``,
``ToolCall``, ``Finish``, ``Failure``) become Anthropic's ``message`` object or its
SSE event sequence. Shapes are checked against the ``anthropic`` SDK in
``tests/unit/test_anthropic_units.py``.

``thinking``: with it (``enabled``, its ``budget_tokens`` the thought's budget), a
thinking model's thought is a ``thinking`` block before the answer, signed
(``thinking_signature``); without it the model renders with thinking off and no thought is
sent. Thinking blocks sent back in history must verify and are the assistant message's
``reasoning_content``; ``redacted_thinking`` blocks are dropped.

Accepted but without effect: ``top_k`` (carried in ``ChatInput``; the engine
samples with temperature and top_p only), ``metadata``, ``cache_control`` (kept as
hints in ``ChatInput.cache_control_points``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.api.openai_api import Collector
from serve_app.api.thinking_signature import ThoughtSigner
from serve_app.serving.events import Delta, Event, Failure, Finish, Reasoning, Start
from serve_app.serving.request import ApiError
from serve_app.serving.tools import ToolCall

# ---- internal seam types ------------------------------------------------------------


# ---- request schemas ----------------------------------------------------------------


# ---- conversion to chat-template input ------------------------------------------------


# ---- errors ---------------------------------------------------------------------------

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # ours: model not ready / replica lost, retry shortly
    504: "timeout_error",  # ours: ingress.request_timeout_s passed
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (their docs' table; other 4xx are
    invalid requests, other 5xx API errors)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


@dataclass(frozen=True)
class ErrorReply:
    """An ``ApiError`` as Anthropic sends it: status, headers (Retry-After) and body."""

    status: int
    type: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def error_reply(exc: ApiError) -> ErrorReply:
    """Our error in Anthropic's shape; the status is kept, the type follows from it."""
    return ErrorReply(exc.status, error_type(exc.status), exc.message, dict(exc.headers))


def error_event(exc: ApiError) -> dict[str, Any]:
    """The SSE ``error`` event for a failure after the 200 was sent."""
    return error_reply(exc).body()


# ---- responses ---------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic usage: ``input_tokens`` excludes the tokens read from the cache."""
    return {
        "input_tokens": max(prompt_tokens - cached_tokens, 0),
        "output_tokens": completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def stop_reason(finish_reason: str, *, stop_sequence: str | None = None,
                tool_calls: bool = False) -> str:
    """Our finish reason as Anthropic's stop_reason; a cut-off wins over a tool call."""
    if finish_reason == "length":
        return "max_tokens"
    if tool_calls or finish_reason == "tool_calls":
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def count_tokens_response(input_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens}


class MessageStream:
    """Internal events in, Anthropic stream events out, in the order the API sends them.

    message_start, then per block content_block_start / _delta... / _stop (a thought
    as thinking_delta and, last, its signature_delta; text blocks as text_delta, tool
    calls as one input_json_delta each), then
    message_delta (stop_reason, usage) and message_stop. An error ends the stream
    with an ``error`` event. Each method returns the events to send now.
    """

    def __init__(self, model: str, message_id: str | None = None, *,
                 signer: ThoughtSigner | None = None) -> None:
        """``signer``: the request asked for thinking (its blocks are signed with it);
        None drops a thought."""
        self.model = model
        self.message_id = message_id or new_message_id()
        self.started = False
        self.done = False
        self.signer = signer
        self._thought: list[str] = []  # the open thinking block's text
        self._open: Literal["thinking", "text", "tool_use"] | None = None
        self._index = -1
        self._tool_calls = 0

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """Dispatch one replica event (``serve_app.serving.events``)."""
        if isinstance(event, ToolCall):
            return self.tool_call(event)
        if isinstance(event, Start):
            return self.start(event.prompt_tokens, event.cached_tokens)
        if isinstance(event, Reasoning):
            return self.thinking(event.text)
        if isinstance(event, Delta):
            return self.text(event.text)
        if isinstance(event, Finish):
            return self.finish(event.finish_reason, prompt_tokens=event.prompt_tokens,
                               completion_tokens=event.completion_tokens,
                               cached_tokens=event.cached_tokens,
                               stop_sequence=event.stop_sequence)
        if isinstance(event, Failure):
            return self.error(ApiError.from_failure(event))
        raise ValueError(f"unknown event {event!r}")

    def start(self, prompt_tokens: int, cached_tokens: int = 0) -> list[dict[str, Any]]:
        self._check(started=False)
        self.started = True
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(prompt_tokens, 0, cached_tokens),
        }
        return [{"type": "message_start", "message": message}]

    def ping(self) -> list[dict[str, Any]]:
        """A keep-alive the SDK skips; e.g. while a long prompt is prefilled."""
        return [{"type": "ping"}]

    def thinking(self, text: str) -> list[dict[str, Any]]:
        """Thought text: a thinking block (none without a signer: the request did not ask
        for thinking)."""
        self._check(started=True)
        if not text or self.signer is None:
            return []
        out = []
        if self._open != "thinking":
            out += self._close()
            out += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
            self._open = "thinking"
        self._thought.append(text)
        out.append({"type": "content_block_delta", "index": self._index,
                    "delta": {"type": "thinking_delta", "thinking": text}})
        return out

    def text(self, text: str) -> list[dict[str, Any]]:
        self._check(started=True)
        if not text:
            return []
        out = []
        if self._open != "text":
            out += self._close()
            out += self._open_block({"type": "text", "text": ""})
            self._open = "text"
        out.append({"type": "content_block_delta", "index": self._index,
                    "delta": {"type": "text_delta", "text": text}})
        return out

    def tool_call(self, call: ToolCall) -> list[dict[str, Any]]:
        self._check(started=True)
        out = self._close()
        out += self._open_block({"type": "tool_use", "id": call.id, "name": call.name,
                                 "input": {}})
        self._open = "tool_use"
        self._tool_calls += 1
        # A call the token limit cut off sends what of its input is whole, as JSON: the
        # block's input must be an object, whoever reads the stream.
        arguments = call.arguments if call.complete else json.dumps(call.input(),
                                                                    ensure_ascii=False)
        out.append({"type": "content_block_delta", "index": self._index,
                    "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return out + self._close()

    def finish(self, finish_reason: str, *, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int = 0, stop_sequence: str | None = None) -> list[dict[str, Any]]:
        """Close the message. The input counts are repeated: the cached count is final
        only now (a failed restore is prefilled cold), and message_delta usage is
        cumulative, so the SDK takes these over message_start's."""
        self._check(started=True)
        out = self._close()
        reason = stop_reason(finish_reason, stop_sequence=stop_sequence,
                             tool_calls=self._tool_calls > 0)
        out.append({
            "type": "message_delta",
            "delta": {"stop_reason": reason,
                      "stop_sequence": stop_sequence if reason == "stop_sequence" else None},
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        })
        out.append({"type": "message_stop"})
        self.done = True
        return out

    def error(self, exc: ApiError) -> list[dict[str, Any]]:
        """The stream's last event: Anthropic sends no block or message stop after it."""
        self.done = True
        return [error_event(exc)]

    def _check(self, *, started: bool) -> None:
        if self.done:
            raise RuntimeError("the message stream has already ended")
        if self.started != started:
            raise RuntimeError("message already started" if self.started
                               else "the first event must be start")

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._index += 1
        return [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking" and self.signer is not None:
            signature = self.signer.signature(self.model, "".join(self._thought))
            self._thought = []
            out.append({"type": "content_block_delta", "index": self._index,
                        "delta": {"type": "signature_delta", "signature": signature}})
        self._open = None
        return [*out, {"type": "content_block_stop", "index": self._index}]


def message_collector(model: str, message_id: str | None = None, *,
                      signer: ThoughtSigner | None = None) -> Collector:
    """The non-streaming ``message`` object, accumulated from ``MessageStream``'s events
    as the SDK accumulates a stream, so both answers to one generation are the same."""
    return Collector(MessageStream(model, message_id, signer=signer), accumulate)


def accumulate(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A finished stream's events as the final ``message`` object (SDK semantics:
    message_delta's usage overwrites message_start's)."""
    message: dict[str, Any] | None = None
    partial: dict[int, str] = {}
    for e in events:
        kind = e["type"]
        if kind == "message_start":
            message = json.loads(json.dumps(e["message"]))
        elif message is None:
            if kind == "ping":
                continue
            raise ValueError(f"{kind} before message_start")
        elif kind == "content_block_start":
            message["content"].append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop":
            if e["index"] in partial:
                message["content"][e["index"]]["input"] = json.loads(partial.pop(e["index"]))
        elif kind == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
        elif kind == "error":
            raise ValueError("an errored stream has no message")
    if message is None:
        raise ValueError("no message_start")
    return message
