"""A request body, read and parsed defensively before any model sees it: 413 past the
size limit (counted while a chunked body streams in), 400 for JSON nested deeper than
``MAX_JSON_DEPTH``, for NaN or Infinity, and for strings a tokenizer cannot encode
(lone surrogates); large bodies are parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import Request

from serve_app.serving.request import ApiError

T = TypeVar("T")

# JSON deeper than this is refused before validation: no request needs it, and
# nesting costs recursion in every layer that walks the body.
MAX_JSON_DEPTH = 64
INLINE_PARSE_BYTES = 256 * 1024  # larger bodies are parsed off the event loop


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` bytes.

    Content-Length is checked before reading; a chunked body is counted while
    it streams in, so an oversized upload is never held in memory.
    """
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes "
                         "(ingress.max_request_bytes)", code="request_too_large")


def json_depth_over(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests containers deeper than ``limit``; no recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


_BRACKET_STEP = np.zeros(256, np.int32)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1


def raw_json_depth(raw: bytes) -> int:
    """How deep valid UTF-8 JSON text nests containers, from its bytes: strings dropped
    by a regex, brackets summed by numpy. Walking the parsed body instead costs ~1 us a
    container: seconds for 16 MiB of ``[],[],...``."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_BRACKET_STEP[np.frombuffer(brackets, np.uint8)]).max())


def parse_json(raw: bytes, precheck: Callable[[Any], None] | None = None) -> Any:
    """A request body as JSON; 400 for invalid or too deeply nested JSON, for integers
    too long to convert (Python's 4300-digit limit), NaN / Infinity (not JSON), and for
    strings with a lone surrogate (valid JSON escapes, but not encodable text).
    ``precheck`` sees the body first, before any walk of it (a count of its messages)."""
    too_deep = ApiError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                        code="json_too_deep")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:  # the C parser gives up near the interpreter's recursion limit
        raise too_deep from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the digit limit
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:300]}") from None
    if precheck is not None:
        precheck(body)
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk the body
        where = unencodable_string(body)
        if where is not None:
            raise ApiError(400, f"{where or 'body'}: must be valid Unicode text (a lone "
                                "surrogate escape cannot be encoded as UTF-8)",
                           param=where or None, code="invalid_unicode")
    # Nesting needs an opening bracket per level: few brackets, no walk.
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_JSON_DEPTH and isinstance(body, (dict, list)):
        utf8 = b"\0" not in raw[:4]  # json.loads also takes UTF-16 and UTF-32
        if (raw_json_depth(raw) if utf8 else 0) > MAX_JSON_DEPTH or (
                not utf8 and json_depth_over(body, MAX_JSON_DEPTH)):
            raise too_deep
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def unencodable_string(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string, key or value, that UTF-8
    cannot encode; None when every string can. No recursion."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _encodable(node):
                return path
        elif isinstance(node, dict):
            for k, v in node.items():
                where = f"{path}.{k}" if path else k
                if not _encodable(k):
                    return path
                stack.append((v, where))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def parsed_body(request: Request, max_bytes: int, parse: Callable[[Any], T],
                      precheck: Callable[[Any], None] | None = None) -> T:
    """The body as JSON, validated by ``parse`` once, here: the replica gets the object,
    not the raw JSON. A large body is parsed and validated on a worker thread: the
    ingress's event loop also carries every other request's stream."""
    raw = await read_body(request, max_bytes)
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(lambda: parse(parse_json(raw, precheck)))
    return parse(parse_json(raw, precheck))
