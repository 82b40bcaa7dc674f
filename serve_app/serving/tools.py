"""Tool calling: the tools a prompt offers, and the calls a model's output makes.

mlx-lm already knows each model family's tool-call format. ``mlx_lm.load`` infers it from
the chat template (or ``tool_parser_type`` in tokenizer_config.json) and its
``TokenizerWrapper`` carries the markers around one call (``tool_call_start``,
``tool_call_end``) and a parser for the text between them (``tool_parser``): "json_tools"
for Qwen3 and the embedded models (``<tool_call>\\n{"name": ..., "arguments": ...}\\n
</tool_call>``), "qwen3_coder" for Qwen3-Coder (XML-style ``<function=...>``), and others.
This module reuses those instead of its own per-family code:

- ``tool_support(tokenizer)``: the model's format, or None when it has none (the server
  answers a request with ``tools`` with 400).
- ``ToolCallStream``: calls out of streamed text, as they complete; the text around them
  is passed through, never a prefix of a marker that may still become one.
- ``canonical_tools``: the same tools always render to the same prompt tokens.

Forcing a call (``tool_choice``) is grammar work:
``serve_app.serving.structured.compile_tool_choice``.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ToolParser = Callable[[str, Any], Any]  # mlx-lm's: (text between the markers, tools) -> call(s)


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made (parsed from its output, or sent back in a history).

    ``arguments`` is the JSON text of an object (the call's input); it is checked
    here, at construction, because Anthropic's ``tool_use.input`` must be an object
    and a stream cannot take back a block once it is sent. Empty text means ``{}``.
    """

    id: str
    name: str
    arguments: str

    def __post_init__(self) -> None:
        if not self.arguments.strip():
            object.__setattr__(self, "arguments", "{}")
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call {self.name!r}: arguments are not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r}: arguments must be a JSON object")

    def input(self) -> dict[str, Any]:
        """The arguments as the object Anthropic's ``tool_use.input`` carries."""
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ToolStreamUpdate:
    """What one ``feed`` or ``finish`` released: text to send now, calls completed now."""

    text: str = ""
    calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    """A fresh id in OpenAI's shape (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def canonical_tools(tools: list[dict]) -> list[dict]:
    """``tools`` with every object's keys sorted (recursively; lists keep their order).

    Clients build tool definitions from dicts in whatever order; templates render them
    with ``tojson`` in insertion order. Sorted, the same tools always give the same prompt
    tokens, so a conversation's next request hits the prefix cache.
    """
    return [_sorted_keys(tool) for tool in tools]


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted_keys(item) for item in value]
    return value


@dataclass(frozen=True)
class ToolSupport:
    """A model's tool-call format, as mlx-lm's tokenizer describes it."""

    parser: str  # mlx-lm's parser module: "json_tools", "qwen3_coder", ...
    start: str  # the marker that opens a call, e.g. "<tool_call>"
    end: str  # the marker that closes it; "" where a call runs to the end of the output
    parse_fn: ToolParser = field(repr=False, compare=False)

    @classmethod
    def from_parser(cls, name: str) -> ToolSupport:
        """mlx-lm's parser ``name`` (a module of ``mlx_lm.tool_parsers``), whatever the
        tokenizer says: for a checkpoint whose template mlx-lm cannot read, and tests."""
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        return cls(name, module.tool_call_start, module.tool_call_end or "",
                   module.parse_tool_call)

    def parse(self, body: str, tools: list[dict] | None = None) -> list[ToolCall]:
        """The calls in ``body`` (the text between the markers), each with a fresh id.

        Raises ``ValueError`` when the text is not a call (cut short, or not the format).
        """
        try:
            parsed = self.parse_fn(body, tools)
        except Exception as exc:  # parsers raise JSON, regex, key and index errors alike
            raise ValueError(f"not a {self.parser} tool call: {exc}") from exc
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items:
            raise ValueError(f"not a {self.parser} tool call: no call in it")
        return [_tool_call(item) for item in items]

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        """A fresh extractor for one response (``tools`` help parsers that read types)."""
        return ToolCallStream(self, tools)

    def extract(self, text: str, tools: list[dict] | None = None) -> ToolStreamUpdate:
        """A whole response at once: its text outside calls, and its calls."""
        return self.stream(tools).finish(text)


def _tool_call(item: Any) -> ToolCall:
    if not isinstance(item, dict):
        raise ValueError(f"a tool call must be an object, not {type(item).__name__}")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a name")
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # some formats carry the arguments as JSON text
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call arguments are not JSON: {exc}") from exc
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be an object")
    # json.dumps's default separators are what Qwen-style templates render (tojson), so a
    # call sent back in the next request's history renders as the model wrote it.
    try:  # a parser's literal_eval may give sets, bytes or NaN: not JSON, not a call
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tool call arguments are not JSON: {exc}") from exc
    return ToolCall(new_call_id(), name, text)


def tool_support(tokenizer: Any) -> ToolSupport | None:
    """The tool-call format of ``tokenizer`` (mlx-lm's ``TokenizerWrapper``); None when
    the model has none (no parser inferred from its chat template)."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parse_fn = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if parse_fn is None or not start:
        return None
    module = getattr(parse_fn, "__module__", None) or "unknown"
    return ToolSupport(parser=module.rpartition(".")[2], start=start,
                       end=getattr(tokenizer, "tool_call_end", None) or "", parse_fn=parse_fn)


class ToolCallStream:
    """Tool calls out of one response's text, fed as it streams (chunks of any size).

    ``feed`` returns the text that is safe to send now and the calls completed by this
    chunk. Text that may be the start of a call marker waits for the next chunk.
    Whitespace next to a call (the newline a template puts between content and a call,
    or between calls) is dropped; other text passes through unchanged. A complete call
    that does not parse is passed through as text, markers and whitespace included.
    ``finish`` flushes: a call the output left open is parsed if the parser can (a format
    without an end marker, or output cut at the end marker), else returned as text.
    """

    def __init__(self, support: ToolSupport, tools: list[dict] | None = None) -> None:
        self.support = support
        self.tools = tools
        self.calls: list[ToolCall] = []  # every call so far
        self._buf = ""  # outside a call: text held back; inside: the call's text so far
        self._inside = False
        self._after_call = False  # drop whitespace that follows a call
        self._scan = 0  # inside: where the end marker may begin, at the earliest
        self._gap = ""  # inside: the whitespace dropped before the call

    def feed(self, text: str) -> ToolStreamUpdate:
        """Take the next chunk of output; return what it released."""
        self._buf += text
        start, end = self.support.start, self.support.end
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                if not end:
                    break  # the call runs to the end of the output
                i = self._buf.find(end, self._scan)
                if i < 0:
                    self._scan = max(0, len(self._buf) - len(end) + 1)
                    break
                body, self._buf = self._buf[:i], self._buf[i + len(end):]
                self._inside, self._scan = False, 0
                self._close(body, start + body + end, out, calls)
                continue
            if self._after_call:
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self._after_call = stripped, False
            i = self._buf.find(start)
            if i >= 0:
                before = self._buf[:i].rstrip()  # whitespace before a call: dropped
                out.append(before)
                self._gap = self._buf[len(before):i]  # unless the call fails
                self._buf, self._inside = self._buf[i + len(start):], True
                continue
            held = _marker_prefix_at_end(self._buf, start)
            ready = self._buf[: len(self._buf) - held].rstrip()  # trailing space may precede a call
            out.append(ready)
            self._buf = self._buf[len(ready):]
            break
        return ToolStreamUpdate("".join(out), tuple(calls))

    def finish(self, text: str = "") -> ToolStreamUpdate:
        """The output ended (with ``text``, its last chunk): release what was held back."""
        fed = self.feed(text)
        out: list[str] = [fed.text]
        calls: list[ToolCall] = list(fed.calls)
        if self._inside:
            self._close(self._buf, self.support.start + self._buf, out, calls)
        elif not self._after_call:
            out.append(self._buf)
        self._buf, self._inside, self._after_call, self._scan, self._gap = "", False, False, 0, ""
        return ToolStreamUpdate("".join(out), tuple(calls))

    def _close(self, body: str, raw: str, out: list[str], calls: list[ToolCall]) -> None:
        try:
            parsed = self.support.parse(body, self.tools)
        except ValueError:
            out.append(self._gap + raw)  # not a call after all: what the model wrote
            return
        calls.extend(parsed)
        self.calls.extend(parsed)
        self._after_call = True


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (not all of it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
