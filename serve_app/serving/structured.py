"""Structured output: OpenAI's ``response_format`` by grammar-constrained decoding.

``compile_response_format`` turns ``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`` into a ``Grammar`` (None for ``"text"``), and
``Grammar.processor()`` gives one request its own mlx-lm logits processor. A processor is
per request, so constrained and free requests share one ``BatchGenerator`` batch
(``insert(..., logits_processors=[[proc], []])``). Nothing here knows about HTTP: a bad
``response_format`` raises ``StructuredOutputError`` (a ``ValueError``; ``param`` names the
field) for the server to answer 400. ``compile_tool_choice`` does the same for OpenAI's
``tool_choice`` ("required" or a named function): a grammar of the model family's own
tool-call markup, so that even a random-weight model writes a call that parses.

Library: llguidance (guidance-ai; also a grammar backend of vLLM, SGLang and llama.cpp),
chosen by measurement against xgrammar 0.2.9 and outlines-core 0.2.14 (all three have Linux
x86_64 and macOS arm64 wheels) on the embedded tiny-dense tokenizer (then vocab 259) and on a
100k-token byte-level BPE trained offline (real vocabularies are ~150k), 2-core Linux CPU:

- compile a nested schema (object, enum, array, integer bounds, pattern): llguidance 1.4 ms,
  xgrammar 15.7 ms, outlines-core 897 ms; ``json_object``: 0.9 ms, 37 ms, 11 s (100k vocab).
- mask per token (100k vocab): llguidance 0.1-1.1 ms, xgrammar 0.02-0.06 ms,
  outlines-core 0.03-0.21 ms; 2-40 us each on tiny-dense.
- correctness: llguidance passed every check. xgrammar lets raw control bytes into strings
  that have ``maxLength`` (invalid JSON) and needs torch + triton on Linux (5.6 GB);
  outlines-core ignores integer ``minimum``/``maximum`` (a 150-digit "age" for
  ``maximum: 150``).
- llguidance's masks cost more than xgrammar's, but the processor starts the forward pass
  before computing one, so on a GPU the mask (CPU) overlaps the model's step.
- llguidance has no Python dependencies. Its ``llguidance.mlx`` helper applies the mask with
  a Metal-only kernel (``mx.fast.metal_kernel``); here the mask is applied with plain MLX ops
  (a byte-table gather and an add) that run on Metal and on the CPU backend alike.

Whole processor (feed, mask, apply): 60-90 us a token on tiny-dense, 0.2-0.75 ms at 100k
vocab on this CPU; ``python -m bench.structured`` measures it against free decoding.

JSON is generated compact (``","`` and ``":"``, no free whitespace: a model cannot stall in
endless newlines); a schema's ``"x-guidance"`` options may change that. The schema is enforced
whether or not ``strict`` is true.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, TypedDict, cast

import llguidance
import llguidance.hf
import numpy as np

from serve_app.models.compat import wrapped_hf_tokenizer
from serve_app.serving.tool_rules import choice_problem

if TYPE_CHECKING:
    import mlx.core as mx

    from serve_app.models.compat import JsonCompileOptions
    from serve_app.serving.tools import ToolSupport

logger = logging.getLogger(__name__)

JSON_OBJECT_SCHEMA: dict = {"type": "object"}
# llguidance's defaults; "x-guidance" overrides
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
MAX_CACHED_GRAMMARS = 256  # per tokenizer
# llguidance's resource limits, set here rather than left to the library's defaults, so a
# pathological schema is a 400 in milliseconds, never seconds of a prepare thread (an
# allOf of four 8-way anyOfs, 2.8 KB, takes 2 s to compile under the defaults, 0.2 s to
# refuse here). Measured: a 300-way anyOf of objects is ~4,000 symbols, Claude Code's
# tools ~200. The per-token fuel and item limits are llguidance's defaults (about 15 ms
# and 2.5 ms of a mask at most); lexer states are capped at a fifth of its default
# (~1-2 kB each, per cached grammar).


class _ParserLimits(TypedDict):
    """The integer limits of ``llguidance.LLParserLimits`` set here."""

    max_grammar_size: int
    initial_lexer_fuel: int
    step_lexer_fuel: int
    step_max_items: int
    max_items_in_row: int
    max_lexer_states: int


GRAMMAR_LIMITS: _ParserLimits = {
    "max_grammar_size": 50_000,  # symbols in the grammar's productions (default 500,000)
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes (~20 ms)
    "step_lexer_fuel": 200_000,  # one mask's lexer work
    "step_max_items": 50_000,  # one mask's Earley items
    "max_items_in_row": 2_000,  # branching of one production
    "max_lexer_states": 50_000,  # default 250,000
}
MAX_ERROR_CHARS = 500
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Byte value -> the additive bias of its 8 tokens (bit i of the byte is token 8 * byte + i).
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
    0.0,
    -np.inf,
).astype(np.float32)


class StructuredOutputError(ValueError):
    """A ``response_format`` that cannot be served; ``param`` is the offending field."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


class _Vocab:
    """What one tokenizer needs: llguidance's tokenizer (about 1 s to build for a 100k
    vocabulary) and the compiled grammars for it, newest last."""

    def __init__(self, tokenizer: Any) -> None:
        wrapped = wrapped_hf_tokenizer(tokenizer)
        if wrapped is not None:  # mlx-lm's, around Hugging Face's
            hf, eos = wrapped, tokenizer.eos_token_ids
        else:
            hf, eos = tokenizer, tokenizer.eos_token_id
        self.eos_ids = sorted({int(eos)} if isinstance(eos, int) else {int(t) for t in eos or ()})
        if not self.eos_ids:
            raise StructuredOutputError("response_format needs a model whose tokenizer has EOS")
        self.eos = frozenset(self.eos_ids)
        try:
            self.lltok = llguidance.hf.from_tokenizer(hf, eos_token=self.eos_ids)
        except ValueError as exc:  # a slow (non-Rust) tokenizer
            raise StructuredOutputError(
                f"response_format is not supported for this model's tokenizer: {exc}"
            ) from exc
        self.size = self.lltok.vocab_size
        self.words = (self.size + 31) // 32  # int32 words of a mask
        self.lock = threading.Lock()
        self.grammars: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._biases: dict[Any, mx.array] = {}

    def byte_bias(self, dtype: mx.Dtype) -> mx.array:
        """``_BYTE_BIAS`` in ``dtype``, made once and evaluated (usable on any thread)."""
        import mlx.core as mx  # here, not at import: the ingress compiles without MLX

        bias = self._biases.get(dtype)
        if bias is None:
            bias = mx.array(_BYTE_BIAS).astype(dtype)
            mx.eval(bias)
            self._biases[dtype] = bias
        return bias


_vocabs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabs_lock = threading.Lock()


def _vocab(tokenizer: Any) -> _Vocab:
    with _vocabs_lock:
        vocab = _vocabs.get(tokenizer)
        if vocab is None:
            vocab = _vocabs[tokenizer] = _Vocab(tokenizer)
        return vocab


class GrammarProcessor:
    """One request's mlx-lm logits processor: ``(tokens, logits) -> logits``.

    ``tokens`` is everything the model has seen, prompt included, as mlx-lm passes it
    (``generate_step`` and ``BatchGenerator`` alike). The first call takes it all as the
    prompt; each later call feeds the matcher what was generated since. Speculative decoding
    (``speculative_generate_step``) also takes tokens back and rewrites them: the matcher
    rolls back to where ``tokens`` and what it was fed part, within the last ``REWIND``.
    ``logits`` (shape ``(..., vocab)``) come back with every token the grammar does not
    allow at -inf; once the grammar is complete, or after a token it rejected, only EOS.
    """

    REWIND = 32

    __slots__ = ("_matcher", "_vocab", "_mask", "_start", "_fed", "error")

    def __init__(self, matcher: llguidance.LLMatcher, vocab: _Vocab) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._mask = np.empty(vocab.words, dtype=np.int32)
        self._start: int | None = None  # where generated tokens begin in ``tokens``
        self._fed: list[int] = []  # generated tokens the matcher has consumed
        self.error: str | None = None  # why the matcher stopped early, if it did

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar allows nothing more than EOS."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete document (it could end here)."""
        return self._matcher.is_accepting()

    def begin_at(self, start: int) -> None:
        """Generated tokens begin at ``start`` of ``tokens`` (a resumed request's prompt
        ends with the tokens generated before): the first call feeds the matcher those."""
        self._start = start

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Start the forward pass now: on a GPU it runs while the CPU computes the mask
        # (mlx-lm would only start it after the processors return).
        import mlx.core as mx  # loaded by now (the engine's thread runs this)

        mx.async_eval(logits)
        if self._start is None:
            self._start = tokens.size  # the first call sees only the prompt
        elif self.error is None:
            self._follow(tokens, self._start)
        # In an error state llguidance's mask is EOS alone: the request ends.
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        return logits + self._bias(logits.shape[-1], logits.dtype)

    def _follow(self, tokens: mx.array, start: int) -> None:
        """Bring the matcher to ``tokens`` (generated from ``start`` on): roll back what
        changed, feed what is new."""
        fed = self._fed
        low = max(start, min(start + len(fed), tokens.size) - self.REWIND)
        # usually the one token sampled last step (1-D: a list of ints; mlx types any tolist)
        window = cast(list[int], tokens[low:].tolist())
        old = fed[low - start :]
        same = 0
        while same < min(len(old), len(window)) and old[same] == window[same]:
            same += 1
        eos = self._vocab.eos
        if same < len(old):
            self._matcher.rollback(sum(t not in eos for t in old[same:]))
            del fed[low - start + same :]
        for token in window[same:]:
            fed.append(token)
            # EOS ends the request: it is never fed (a stopped matcher would take it as a
            # no-op, and rolling it back would then undo a real token).
            if token not in eos and not self._matcher.consume_token(token):
                self.error = self._matcher.get_error()[:MAX_ERROR_CHARS]
                logger.warning("structured output: token %d rejected: %s", token, self.error)
                return

    def _bias(self, size: int, dtype: mx.Dtype) -> mx.array:
        """0 where the mask allows a token, -inf elsewhere (beyond the tokenizer too)."""
        import mlx.core as mx

        table = self._vocab.byte_bias(dtype)
        bias = table[mx.array(self._mask.view(np.uint8))].reshape(-1)  # copies the mask
        if size <= bias.size:
            return bias[:size]
        return mx.concatenate([bias, mx.full((size - bias.size,), -mx.inf, dtype=dtype)])


class Grammar:
    """A compiled ``response_format`` for one tokenizer; cheap to turn into processors."""

    __slots__ = ("kind", "schema", "_template", "_vocab")

    def __init__(self, kind: str, schema: dict, template: llguidance.LLMatcher,
                 vocab: _Vocab) -> None:
        self.kind = kind  # "json_object", "json_schema" or "tool_choice"
        self.schema = schema
        self._template = template
        self._vocab = vocab

    def processor(self) -> GrammarProcessor:
        """A fresh logits processor for one request (a copy of the compiled matcher)."""
        with self._vocab.lock:
            matcher = self._template.deep_copy()
        return GrammarProcessor(matcher, self._vocab)


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise StructuredOutputError(message, param)


def parse_response_format(response_format: Any) -> tuple[str, dict] | None:
    """Validate ``response_format`` (OpenAI's shape): ``(kind, schema)``, None for text."""
    p = "response_format"
    _require(isinstance(response_format, dict), f"{p} must be an object", p)
    kind = response_format.get("type")
    _require(kind is not None, f"{p}.type is required", f"{p}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, dict(JSON_OBJECT_SCHEMA)
    _require(
        kind == "json_schema",
        f"{p}.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
        f"{p}.type",
    )
    spec = response_format.get("json_schema")
    p = f"{p}.json_schema"
    _require(spec is not None, f"{p} is required when type is 'json_schema'", p)
    _require(isinstance(spec, dict), f"{p} must be an object", p)
    name = spec.get("name")
    _require(name is not None, f"{p}.name is required", f"{p}.name")
    _require(
        isinstance(name, str) and _NAME.match(name) is not None,
        f"{p}.name must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'",
        f"{p}.name",
    )
    for key, kinds, what in (("description", str, "a string"), ("strict", bool, "a boolean")):
        value = spec.get(key)
        _require(value is None or isinstance(value, kinds), f"{p}.{key} must be {what}",
                 f"{p}.{key}")
    schema = spec.get("schema")
    _require(schema is not None, f"{p}.schema is required", f"{p}.schema")
    _require(isinstance(schema, dict), f"{p}.schema must be a JSON Schema object",
             f"{p}.schema")
    return kind, schema


def compile_response_format(response_format: Any, tokenizer: Any) -> Grammar | None:
    """The grammar of ``response_format`` for ``tokenizer`` (mlx-lm's ``TokenizerWrapper``
    or a fast Hugging Face tokenizer); None for ``{"type": "text"}``.

    Compiled grammars are cached per tokenizer by the schema's canonical JSON, bad schemas
    included, so a repeated schema costs a dictionary look-up. Raises
    ``StructuredOutputError`` for a malformed ``response_format`` or an invalid or
    unsupported schema.
    """
    parsed = parse_response_format(response_format)
    if parsed is None:
        return None
    kind, schema = parsed
    param = "response_format" if kind == "json_object" else "response_format.json_schema.schema"
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputError(f"the schema is not valid JSON: {exc}", param) from exc
    vocab = _vocab(tokenizer)
    with vocab.lock:
        compiled = vocab.grammars.get(key)
        if compiled is not None:
            vocab.grammars.move_to_end(key)
    if compiled is None:
        compiled = _compile(schema, vocab)
        with vocab.lock:
            vocab.grammars[key] = compiled
            while len(vocab.grammars) > MAX_CACHED_GRAMMARS:
                vocab.grammars.popitem(last=False)
    if isinstance(compiled, str):
        raise StructuredOutputError(f"invalid JSON schema: {compiled}", param)
    return Grammar(kind, schema, compiled, vocab)


def _compile(schema: dict, vocab: _Vocab) -> llguidance.LLMatcher | str:
    """A fresh matcher for ``schema`` (the template of its processors), or the error."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        return str(exc)[:MAX_ERROR_CHARS]
    return _matcher(grammar, vocab)


def _matcher(grammar: str, vocab: _Vocab) -> llguidance.LLMatcher | str:
    """A fresh matcher for llguidance's ``grammar``, or the error."""
    limits = llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)
    matcher = llguidance.LLMatcher(vocab.lltok, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return matcher.get_error()[:MAX_ERROR_CHARS]
    matcher.compute_bitmask()  # builds the lexer's first states, shared by every copy
    return matcher


# ---- tool_choice: forcing tool calls --------------------------------------------------

# Tool-call JSON as Qwen-style templates render it (``tojson``: ", " and ": "), so a forced
# call reads like the calls the model saw in its prompt and training; still no free
# whitespace. A parameters schema's own "x-guidance" wins.
TOOL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
# mlx-lm's qwen3_coder parser keeps the text of parameters of these types as it is.
_XML_TEXT_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
NL = "\n"
# A character of such text: not "<" (the parser would take "</parameter>" for the end), nor a
# control character other than tab and newline.
_XML_CHAR = r"[^<\x00-\x08\x0b-\x1f\x7f]"


def compile_tool_choice(tools: list[dict] | None, choice: str | dict | None, tokenizer: Any,
                        support: ToolSupport | None, *, parallel: bool = True) -> Grammar | None:
    """The grammar that forces OpenAI's ``tool_choice`` in the model's own call markup.

    ``"required"``: one or more calls (one when ``parallel`` is false) of any of ``tools``;
    ``{"type": "function", "function": {"name": ...}}``: exactly one call of that tool.
    Each call's arguments are valid against its tool's ``parameters`` schema (whose top-level
    object is closed unless it says ``additionalProperties``), and EOS follows the last call.
    None for ``"auto"``, ``"none"`` and None: nothing is forced.

    ``support`` (``serve_app.serving.tools.tool_support``) gives the markup: mlx-lm's parser for the
    model family. Markers are forced as the exact tokens the tokenizer makes of them (one
    special token each on Qwen-style models). Formats: "json_tools" (Qwen3, Hermes-style:
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``) and "qwen3_coder"
    (``<tool_call>\\n<function=...>\\n<parameter=...>\\n...\\n</parameter>\\n...``; a text
    parameter's ``pattern`` and ``format`` are not enforced there, and its text holds no
    "<" and no control characters but tab and newline).

    The call starts the reply: no text and no ``<think>`` block before it. Raises
    ``StructuredOutputError`` (``param`` "tool_choice" or "tools") for an unknown tool name,
    a bad ``tool_choice``, a model without tool calls or with another format, or a
    ``parameters`` schema that does not compile. Cached like response formats.
    """
    p = "tool_choice"
    if choice is None or choice in ("auto", "none"):
        return None
    if support is None:
        raise StructuredOutputError("this model cannot call tools: its chat template and "
                                    "tokenizer define no tool-call format", "tools")
    functions = _functions(tools)
    if choice_problem(True, None, functions) == "needs_tools":
        raise StructuredOutputError(f"{p} needs tools", "tools")
    if choice == "required":
        chosen, many = functions, parallel
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not (choice.get("type") == "function" and isinstance(name, str)):
            raise StructuredOutputError(
                f'{p} must be "none", "auto", "required" or {{"type": "function", '
                f'"function": {{"name": ...}}}}', p)
        _require(choice_problem(True, name, functions) is None,
                 f"{p} names function {name!r}, which is not among the request's tools "
                 f"({', '.join(sorted(functions)) or 'none'})", p)
        chosen, many = {name: functions[name]}, False
    else:
        raise StructuredOutputError(
            f'{p} must be "none", "auto", "required" or a named function, not {choice!r}', p)
    build = _CALL_FORMATS.get(support.parser)
    if build is None:
        raise StructuredOutputError(
            f"{p} {choice!r} is not supported for this model's tool-call format "
            f"({support.parser}); use \"auto\"", p)
    start = _token_refs(tokenizer, support.start)
    end = _token_refs(tokenizer, support.end) if support.end else ""
    lark = build(chosen, start, end, many)
    vocab = _vocab(tokenizer)
    key = "tool_choice\0" + lark
    with vocab.lock:
        compiled = vocab.grammars.get(key)
        if compiled is not None:
            vocab.grammars.move_to_end(key)
    if compiled is None:
        compiled = _matcher(llguidance.LLMatcher.grammar_from_lark(lark), vocab)
        with vocab.lock:
            vocab.grammars[key] = compiled
            while len(vocab.grammars) > MAX_CACHED_GRAMMARS:
                vocab.grammars.popitem(last=False)
    if isinstance(compiled, str):
        raise StructuredOutputError(f"a tool's parameters schema does not compile: {compiled}",
                                    "tools")
    return Grammar("tool_choice", chosen, compiled, vocab)


def _functions(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters schema (an object schema; none means no arguments)."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not (isinstance(function, dict) and isinstance(name, str) and name):
            raise StructuredOutputError(
                f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                f"tools[{i}]")
        params = function.get("parameters")
        _require(params is None or isinstance(params, dict),
                 f"tools[{i}].function.parameters must be a JSON Schema object",
                 f"tools[{i}].function.parameters")
        if not params:
            params = _NO_ARGUMENTS
        elif "type" not in params:
            params = {**params, "type": "object"}  # arguments are an object, always
        if "properties" in params and "additionalProperties" not in params:
            # A function takes the arguments it declares: left open, a small model invents
            # one ("description": ...) and writes until max_tokens cuts the call.
            params = {**params, "additionalProperties": False}
        out.setdefault(name, params)
    return out


def _token_refs(tokenizer: Any, marker: str) -> str:
    """``marker`` as Lark references to the exact tokens the tokenizer makes of it.

    llguidance takes a tokenizer's added tokens for special ones, which string literals
    never match; ``<[id]>`` forces the very token (or tokens) the model knows the marker as.
    """
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return " ".join(f"<[{int(t)}]>" for t in ids)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    """``text`` as a Rust regex inside Lark's ``/.../`` (``re.escape`` is Python's)."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{{{ord(ch):02x}}}")
        else:
            out.append(ch)
    return "".join(out)


def _tool_schema(schema: dict, root: dict | None = None) -> str:
    """``%json`` of ``schema`` with the tool-call JSON options (and ``root``'s definitions,
    which its ``$ref``s may point at)."""
    options = {**TOOL_JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    defs = {k: root[k] for k in ("$defs", "definitions") if root and k in root and k not in schema}
    return "%json " + json.dumps({**defs, **schema, "x-guidance": options})


def _calls_rule(n: int, many: bool) -> str:
    one = " | ".join(f"call_{i}" for i in range(n))
    # Qwen-style templates put a newline between calls.
    return f"start: call ({_lit(NL)} call)*\ncall: {one}\n" if many else f"start: {one}\n"


def _json_calls(functions: dict[str, dict], start: str, end: str, many: bool) -> str:
    """json_tools: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``."""
    lines = [_calls_rule(len(functions), many)]
    for i, (name, params) in enumerate(functions.items()):
        head = '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        tail = _lit("}" + NL)
        lines.append(f"call_{i}: {start} {_lit(head)} args_{i} {tail} {end}")
        lines.append(f"args_{i}: {_tool_schema(params)}")
    return "\n".join(lines) + "\n"


def _xml_calls(functions: dict[str, dict], start: str, end: str, many: bool) -> str:
    """qwen3_coder: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n
    </function>\\n</tool_call>``; required parameters always, in the schema's order."""
    lines = [_calls_rule(len(functions), many)]
    close = "\n</parameter>\n"
    for i, (name, params) in enumerate(functions.items()):
        properties = params.get("properties") or {}
        required = set(params.get("required") or ())
        parts = []
        for j, (pname, schema) in enumerate(properties.items()):
            rule = f"param_{i}_{j}"
            head = _lit(f"<parameter={pname}>\n")
            text = _xml_text(schema if isinstance(schema, dict) else {})
            if text is not None:  # one terminal with its closing tag: ends unambiguously
                lines.append(f"{rule}: {head} /{text}{_regex_literal(close)}/")
            else:
                lines.append(f"{rule}: {head} value_{i}_{j} {_lit(close)}")
                lines.append(f"value_{i}_{j}: {_tool_schema(schema, params)}")
            parts.append(rule if pname in required else f"{rule}?")
        body = " ".join([_lit(f"\n<function={name}>\n"), *parts, _lit("</function>\n")])
        lines.append(f"call_{i}: {start} {body} {end}")
    return "\n".join(lines) + "\n"


def _xml_text(schema: dict) -> str | None:
    """The regex of a parameter whose text qwen3_coder's parser keeps as it is (strings,
    and schemas without a type); None for the rest (JSON, which it decodes)."""
    kind = schema.get("type")
    if isinstance(kind, str) and kind.strip().lower() not in _XML_TEXT_TYPES:
        return None
    if kind is not None and not isinstance(kind, str):
        return None  # a list of types: JSON, which the parser's literal_eval reads
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return "(" + "|".join(_regex_literal(c) for c in choices) + ")"
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    low = low if isinstance(low, int) and low >= 0 else 0
    high = high if isinstance(high, int) and high >= low else None
    return f"{_XML_CHAR}{{{low},{'' if high is None else high}}}"


_CALL_FORMATS = {"json_tools": _json_calls, "qwen3_coder": _xml_calls}
