"""Server-sent events, as the three APIs frame them: one home for the bytes on the wire."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"  # the end of an OpenAI Chat Completions stream


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def data_event(obj: Any) -> bytes:
    """A ``data:`` line alone: OpenAI Chat Completions and Completions chunks."""
    return f"data: {_json(obj)}\n\n".encode()


def sse_event(event: dict[str, Any]) -> bytes:
    """An ``event:`` line naming the type, then the data: Anthropic Messages and OpenAI
    Responses (their SDKs dispatch on the event line)."""
    return f"event: {event['type']}\ndata: {_json(event)}\n\n".encode()
