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
- A call cut off by the token limit is still a call (``ToolCall.complete`` false), with its
  arguments as far as they got: never the raw markup as text.

Markers are found in the text, whatever tokens they came as: ``<tool_call>`` is one special
token on Qwen models but five ordinary ones on SmolLM2 (``<``, ``tool``, ``_``, ``call``,
``>``); text that may still become a marker is held back until it does or cannot.

Forcing a call (``tool_choice``) is grammar work:
``serve_app.serving.structured.compile_tool_choice``.
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ToolParser = Callable[[str, Any], Any]  # mlx-lm's: (text between the markers, tools) -> call(s)


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made (parsed from its output, or sent back in a history).

    ``arguments`` is the JSON text of an object (the call's input); it is checked
    here, at construction, because Anthropic's ``tool_use.input`` must be an object
    and a stream cannot take back a block once it is sent. Empty text means ``{}``.
    A call the token limit cut off (``complete`` false) keeps the arguments as far as
    they got, JSON cut short (OpenAI's ``arguments`` are text and may be).
    """

    id: str
    name: str
    arguments: str
    complete: bool = True

    def __post_init__(self) -> None:
        if not self.complete:
            return
        if not self.arguments.strip():
            object.__setattr__(self, "arguments", "{}")
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call {self.name!r}: arguments are not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r}: arguments must be a JSON object")

    def input(self) -> dict[str, Any]:
        """The arguments as the object Anthropic's ``tool_use.input`` carries (of a call
        cut short: what of it is whole, ``partial_object``)."""
        if not self.complete:
            return partial_object(self.arguments)
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

    def stream(self, tools: list[dict] | None = None,
               forced: Sequence[str] | None = None) -> ToolCallStream:
        """A fresh extractor for one response (``tools`` help parsers that read types;
        ``forced``: see ``ToolCallStream``)."""
        return ToolCallStream(self, tools, forced)

    def partial(self, body: str, tools: list[dict] | None = None,
                names: Sequence[str] = (), *, sure: bool = False) -> ToolCall | None:
        """A call the token limit cut off: ``body`` is its text after the start marker.

        Its name (an unfinished one completed when exactly one of ``names`` begins with
        it) and its arguments as far as they got (whole arguments make a whole call).
        None when the name cannot be told (unless ``sure``: the output is a call, so the
        name as far as it got) or the format is not one read here ("json_tools",
        "qwen3_coder").
        """
        if self.parser == "json_tools":
            found = _json_call_head(body)
        elif self.parser == "qwen3_coder":
            found = self._xml_call_head(body, tools)
        else:
            return None
        name, named, arguments = found
        if not named:
            matches = [n for n in names if n.startswith(name)]
            if len(matches) == 1:
                name = matches[0]
            elif not sure:
                return None
        whole = _whole_object(arguments) if named else None
        if whole is not None:
            return ToolCall(new_call_id(), name, whole)
        return ToolCall(new_call_id(), name, arguments, complete=False)

    def _xml_call_head(self, body: str, tools: list[dict] | None) -> tuple[str, bool, str]:
        """qwen3_coder, cut short: the name and the parameters whose closing tag came (the
        last one, cut, is left out), as JSON."""
        m = re.match(r"\s*<function=([^<>\n]*)(>)?", body)
        if m is None:
            return "", False, ""
        name, named = m.group(1).strip(), m.group(2) is not None
        end = body.rfind("</parameter>")
        if not named or end < 0:
            return name, named, ""
        try:
            (call, *_) = self.parse(body[: end + len("</parameter>")] + "\n</function>", tools)
        except ValueError:
            return name, named, ""
        arguments = call.arguments
        return name, named, arguments[:-1] if arguments.endswith("}") else arguments

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


_JSON_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?', re.S)
_JSON_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*', re.S)


def _json_call_head(body: str) -> tuple[str, bool, str]:
    """json_tools, cut short: (the name as far as it got, whether it is whole, the
    arguments' text as far as it got). A list of calls gives its first."""
    text = body.lstrip()
    if text.startswith("["):
        text = text[1:].lstrip()
    m = _JSON_NAME.match(text)
    if m is None:
        return "", False, ""
    raw, named = m.group(1), m.group(2) is not None
    try:
        name = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        name = raw
    if not named:
        return name, False, ""
    a = _JSON_ARGUMENTS.match(text, m.end())
    return name, True, text[a.end():] if a is not None else ""


def _whole_object(text: str) -> str | None:
    """The JSON text of the object ``text`` begins with, when it is whole (what follows it,
    such as the end of the call, is left out); None when it is not."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def partial_object(text: str) -> dict[str, Any]:
    """The object that JSON text cut short begins, as far as it is whole: an unfinished
    string value is kept as far as it got; an unfinished key, number or literal is left
    out with its entry; open arrays and objects are closed. {} when ``text`` begins no
    object (Anthropic's ``tool_use.input`` of a call the token limit cut off)."""
    text = text.strip()
    if not text.startswith("{"):
        return {}
    closers: list[str] = []
    in_string = escape = False
    good: list[tuple[int, str]] = []  # prefixes that end after a whole value, closed
    end = len(text)
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
            good.append((i + 1, "".join(reversed(closers))))
        elif ch in "}]":
            if not closers or closers[-1] != ch:
                return {}
            closers.pop()
            good.append((i + 1, "".join(reversed(closers))))
            if not closers:
                end = i + 1
                break
        elif ch == ",":
            good.append((i, "".join(reversed(closers))))
    body = text[:end]
    if in_string:
        if escape:
            body = body[:-1]
        u = re.search(r"(\\+)u[0-9a-fA-F]{0,3}$", body)  # a \uXXXX escape cut short
        if u is not None and len(u.group(1)) % 2:
            body = body[: u.end(1) - 1]
        body += '"'
    tail = "".join(reversed(closers))
    for candidate in [body + tail] + [text[:at] + close for at, close in reversed(good)]:
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return {}


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
    without an end marker, or output cut at the end marker), else returned as text. When
    the token limit cut the output (``cut``), a call left open is a call still, cut short
    (``ToolSupport.partial``), where its name can be told.

    ``forced``: the names a forced call (``tool_choice`` "required" or a named function)
    may have; None when nothing is forced. A forced output is calls only (the grammar's),
    so when it is cut even the start of a marker is a call's start, never text.
    """

    def __init__(self, support: ToolSupport, tools: list[dict] | None = None,
                 forced: Sequence[str] | None = None) -> None:
        self.support = support
        self.tools = tools
        self.forced = tuple(forced) if forced is not None else None
        self._names = self.forced if self.forced is not None else tuple(
            function_name(t) for t in tools or ())
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

    def finish(self, text: str = "", cut: bool = False) -> ToolStreamUpdate:
        """The output ended (with ``text``, its last chunk): release what was held back.
        ``cut``: the token limit ended it (a call left open is a call cut short)."""
        fed = self.feed(text)
        out: list[str] = [fed.text]
        calls: list[ToolCall] = list(fed.calls)
        forced = cut and self.forced is not None
        if not self._inside and forced and not self.calls and self.support.start.startswith(
                self._buf.strip()):
            self._buf, self._inside = "", True  # a forced call cut inside its start marker
        if self._inside:
            self._close(self._buf, self.support.start + self._buf, out, calls, cut)
        elif not self._after_call and not forced:
            out.append(self._buf)  # (a forced output's text is markup: a next call's start)
        self._buf, self._inside, self._after_call, self._scan, self._gap = "", False, False, 0, ""
        return ToolStreamUpdate("".join(out), tuple(calls))

    def _close(self, body: str, raw: str, out: list[str], calls: list[ToolCall],
               cut: bool = False) -> None:
        try:
            parsed = self.support.parse(body, self.tools)
        except ValueError:
            partial = self.support.partial(body, self.tools, self._names,
                                           sure=self.forced is not None) if cut else None
            if partial is None:
                out.append(self._gap + raw)  # not a call after all: what the model wrote
                return
            parsed = [partial]
        calls.extend(parsed)
        self.calls.extend(parsed)
        self._after_call = True


def function_name(tool: Any) -> str:
    """A tool definition's function name ("" when it has none)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else ""


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (not all of it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
