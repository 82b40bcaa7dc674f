"""Tool calling: tools in the prompt, calls out of the output, calls forced by tool_choice.

Parsing uses mlx-lm's own parsers for each format; the scripted outputs are fed whole, in
every two-piece split, character by character and in random chunks, and must give the same
text and calls every time. Forcing runs the random-weight embedded model under the
tool_choice grammar: its noise must still be a call that parses, to the right tool, with
arguments that validate (greedy and sampled).
"""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from serve_app.models.embedded import materialize
from serve_app.serving.structured import StructuredOutputError, compile_tool_choice
from serve_app.serving.tools import (
    ToolCall,
    ToolCallStream,
    ToolStreamUpdate,
    ToolSupport,
    canonical_tools,
    new_call_id,
    partial_object,
    tool_support,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 16},
        "exact": {"type": "boolean"},
        "filters": {"type": "array", "items": {"type": "string", "maxLength": 6},
                    "maxItems": 2},
    },
    "required": ["query", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                      "parameters": SEARCH}},
    {"type": "function", "function": {"name": "ping", "description": "No arguments."}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH,
           "ping": {"type": "object", "additionalProperties": False}}

# A Qwen3-Coder-style template (tools as JSON, calls as XML): mlx-lm reads "qwen3_coder" in it.
CODER_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- 'Call one as <tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n</parameter>\\n"
    "</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = (  # the embedded models' template before tools: no tool-call format
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tools")


@pytest.fixture(scope="module")
def dense(home):
    return mlx_lm.load(str(materialize("tiny-dense", home)))


def _with_template(home, name: str, template: str):
    """tiny-dense with another chat template (the same weights and vocabulary)."""
    path = home / name
    if not path.exists():
        shutil.copytree(materialize("tiny-dense", home), path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return mlx_lm.load(str(path))


@pytest.fixture(scope="module")
def coder(home):
    return _with_template(home, "coder", CODER_TEMPLATE)


# ---- the prompt ------------------------------------------------------------------------


def test_tools_render_into_the_prompt(dense):
    tokenizer = dense[1]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tools = canonical_tools(TOOLS)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    lines = "".join(f"\n{json.dumps(t)}" for t in tools)
    assert text.startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>{lines}\n</tools>\n\n")
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 1}}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert ids.count(start) == ids.count(end) == 3  # twice in the system section, the call
    assert tokenizer.decode(ids) == text
    # No tools: the system prompt alone, as before.
    assert tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True,
                                         tokenize=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def _shuffled(value, rng: random.Random):
    """The same JSON with every object's keys in a random order (lists keep theirs)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def test_canonical_tools_render_to_the_same_tokens(dense):
    tokenizer = dense[1]
    messages = [{"role": "user", "content": "hi"}]

    def tokens(tools):
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)

    rng = random.Random(0)
    variants = [_shuffled(TOOLS, rng) for _ in range(8)]
    assert len({json.dumps(v) for v in variants}) > 1  # the control: they do differ
    assert len({tuple(tokens(v)) for v in variants}) > 1
    assert len({tuple(tokens(canonical_tools(v))) for v in variants}) == 1
    canonical = canonical_tools(variants[0])
    assert canonical == TOOLS  # the same JSON
    assert list(canonical[0]["function"]) == ["description", "name", "parameters"]
    weather = canonical[0]["function"]["parameters"]
    assert weather["required"] == ["city", "unit", "days"]  # list order kept
    assert weather["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert list(weather["properties"]) == ["city", "days", "unit"]


# ---- which format ----------------------------------------------------------------------


def test_tool_support_comes_from_mlx_lm(dense, coder, home):
    support = tool_support(dense[1])
    assert (support.parser, support.start, support.end) == \
        ("json_tools", "<tool_call>", "</tool_call>")
    assert tool_support(coder[1]).parser == "qwen3_coder"
    _, plain = _with_template(home, "plain", PLAIN_TEMPLATE)
    assert not plain.has_tool_calling
    assert tool_support(plain) is None
    assert tool_support(object()) is None
    assert ToolSupport.from_parser("mistral").end == ""


def test_profile_keys_reach_mlx_lms_tokenizer(home):
    """``chat_template`` and ``tool_call_format`` go to mlx-lm as its public
    ``tokenizer_config`` (from_pretrained's keyword arguments): the template replaces the
    checkpoint's, the format replaces the one mlx-lm infers, and a template alone brings the
    format mlx-lm reads in it."""
    from mlx_lm.utils import load_tokenizer

    from serve_app.config.chat_templates import BUILTIN_TEMPLATES, tokenizer_config

    path = home / "plain"
    _with_template(home, "plain", PLAIN_TEMPLATE)
    template = load_tokenizer(path, tokenizer_config("chatml-tools", None))
    assert template.chat_template == BUILTIN_TEMPLATES["chatml-tools"]
    assert tool_support(template).parser == "json_tools"
    both = load_tokenizer(path, tokenizer_config("chatml-tools", "qwen3_coder"))
    assert tool_support(both).parser == "qwen3_coder"
    format_only = load_tokenizer(path, tokenizer_config(None, "json_tools"))
    assert format_only.chat_template == PLAIN_TEMPLATE
    assert tool_support(format_only).start == "<tool_call>"
    assert tool_support(load_tokenizer(path, tokenizer_config(None, None))) is None


def test_call_ids_are_fresh():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


# ---- parsing ---------------------------------------------------------------------------


def _chunkings(text: str, seed: int = 0):
    """``text`` cut every way worth trying: whole, each two-piece split, by character, and
    random chunks."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _run(stream: ToolCallStream, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    text, calls = "", []
    for chunk in chunks:
        update = stream.feed(chunk)
        text += update.text
        calls += update.calls
    update = stream.finish()
    return text + update.text, calls + list(update.calls)


def _plain(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


CODER_TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "n": {"type": "integer"},
                                     "env": {"type": "object"}}}}}]

SCRIPTS = {
    "json_tools": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "ping", '
        '"arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "celsius", "days": 2}), ("ping", {})],
        None,
    ),
    "qwen3_coder": (
        "Running it.\n\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -l <dir>\n"
        "</parameter>\n<parameter=n>\n3\n</parameter>\n<parameter=env>\n{\"A\": \"1\"}\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n"
        "<parameter=cmd>\npwd\n</parameter>\n</function>\n</tool_call>",
        "Running it.",
        [("run", {"cmd": "ls -l <dir>", "n": 3, "env": {"A": "1"}}), ("run", {"cmd": "pwd"})],
        CODER_TOOLS,
    ),
    # No end marker: the calls run to the end of the output.
    "mistral": (
        'Sure [TOOL_CALLS][{"name": "ping", "arguments": {}}, {"name": "search", "arguments": '
        '{"query": "mlx", "exact": true}}]',
        "Sure",
        [("ping", {}), ("search", {"query": "mlx", "exact": True})],
        None,
    ),
    "pythonic": (
        "<|tool_call_start|>[search(query='a, b', exact=False)]<|tool_call_end|> done",
        "done",
        [("search", {"query": "a, b", "exact": False})],
        None,
    ),
}


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_calls_parse_however_the_text_is_chunked(parser):
    output, text, calls, tools = SCRIPTS[parser]
    support = ToolSupport.from_parser(parser)
    seen = set()
    for chunks in _chunkings(output):
        got_text, got_calls = _run(support.stream(tools), chunks)
        assert (got_text, _plain(got_calls)) == (text, calls), chunks
        seen.update(c.id for c in got_calls)
    assert all(i.startswith("call_") for i in seen)
    whole = support.extract(output, tools)
    assert (whole.text, _plain(list(whole.calls))) == (text, calls)


def test_calls_complete_as_soon_as_their_end_marker_arrives():
    stream = ToolSupport.from_parser("json_tools").stream()
    assert stream.feed("Hi <tool").text == "Hi"  # " <tool" may still become a marker
    assert stream.feed('_call>\n{"name": "ping", "arguments": {}}\n</tool_cal') == \
        ToolStreamUpdate()  # nothing yet
    update = stream.feed("l>")
    assert [c.name for c in update.calls] == ["ping"] and update.text == ""
    assert stream.calls == list(update.calls)
    assert stream.feed("\n\nBye").text == "Bye"  # whitespace after a call is dropped
    assert stream.finish().text == ""


def test_text_that_only_looks_like_a_marker_is_released():
    stream = ToolSupport.from_parser("json_tools").stream()
    assert stream.feed("a < b, <tool").text == "a < b,"
    assert stream.feed("s> and <").text == " <tools> and"
    assert stream.feed("3 ").text == " <3"
    assert stream.finish().text == " "
    assert stream.calls == []


@pytest.mark.parametrize("tail,calls", [
    # Cut off before the end marker: parsed where the parser can, else passed through.
    ('<tool_call>\n{"name": "ping", "arguments": {}}\n', ["ping"]),
    ('<tool_call>\n{"name": "ping", "argu', []),
    ("<tool_call>", []),
    ("<tool_c", []),
    # Complete, but not a call: the model's text, markers included.
    ("<tool_call>oops</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', []),
])
def test_unfinished_or_broken_calls(tail, calls):
    for chunks in _chunkings("Ok. " + tail):
        text, got = _run(ToolSupport.from_parser("json_tools").stream(), chunks)
        assert [c.name for c in got] == calls
        assert text == ("Ok." if calls else "Ok. " + tail), chunks


FULL_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
             "\n</tool_call>")
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize("forced", [None, ("get_weather",), tuple(NAMES)])
def test_a_call_cut_by_the_token_limit_is_a_call_with_its_arguments_so_far(forced):
    """Cut anywhere in a call, the output is one call (never its markup as text): its
    arguments as far as they got, whole once they are. Unforced, a call whose name cannot
    be told yet stays the model's text."""
    support = ToolSupport.from_parser("json_tools")
    tools = [{"type": "function", "function": {"name": n}} for n in NAMES]
    head = len('<tool_call>\n{"name": "get_weather", "arguments": ')
    for end in range(1, len(FULL_CALL)):
        stream = support.stream(tools, forced)
        update = stream.feed(FULL_CALL[:end])
        done = stream.finish(cut=True)
        text, calls = update.text + done.text, [*update.calls, *done.calls]
        named = end >= len('<tool_call>\n{"name": "get_w')  # get_weather alone begins so
        if forced is None and not named:
            assert not calls and text == FULL_CALL[:end], end
            continue
        assert text == "" and len(calls) == 1, end
        [call] = calls
        assert call.name == ("get_weather" if named or forced == ("get_weather",) else
                             FULL_CALL[len('<tool_call>\n{"name": "'):end]), end
        arguments = FULL_CALL[head:end] if end > head else ""
        if end >= head + len('{"city": "Paris", "days": 2}'):
            assert call.complete and json.loads(call.arguments) == {"city": "Paris", "days": 2}
        else:
            assert not call.complete and call.arguments == arguments, end
            got = call.input()  # Anthropic's input: what of the arguments is whole
            assert got.get("days", 2) == 2 and "Paris".startswith(got.get("city", "")), end
    # An output the limit did not cut: a call left open is the model's text, as before.
    stream = support.stream(tools, forced)
    assert stream.finish(FULL_CALL[:40]).text == FULL_CALL[:40]


def test_forced_parallel_calls_cut_in_the_next_marker_are_the_calls_made():
    support = ToolSupport.from_parser("json_tools")
    stream = support.stream(None, NAMES)
    first = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_c'
    update, done = stream.feed(first), stream.finish(cut=True)
    assert [c.name for c in update.calls] == ["get_time"] and done == ToolStreamUpdate()
    assert update.text == ""


def test_a_qwen3_coder_call_cut_short_keeps_its_closed_parameters():
    support = ToolSupport.from_parser("qwen3_coder")
    body = "\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n<parameter=n>\n3"
    call = support.partial(body, CODER_TOOLS, ["run"])
    assert (call.name, call.complete, call.input()) == ("run", False, {"cmd": "ls"})
    assert support.partial("\n<function=ru", CODER_TOOLS, ["run"]).name == "run"
    assert support.partial("\n<function=ru", CODER_TOOLS, ["run", "rust"]) is None
    assert ToolSupport.from_parser("mistral").partial('[{"name": "x"', None, ["x"]) is None


@pytest.mark.parametrize("text,value", [
    ('{"city": "Pa', {"city": "Pa"}),
    ('{"city', {}),
    ('{"a": 1, "b": tr', {"a": 1}),
    ('{"a": 12', {"a": 12}),
    ('{"a": "x\\', {"a": "x"}),
    ('{"a": "x\\u00', {"a": "x"}),
    ('{"a": "\\\\u00', {"a": "\\u00"}),
    ('{"a": "x", ', {"a": "x"}),
    ('{"a": [1, {"b": [true', {"a": [1, {"b": [True]}]}),
    ('{"a": {"b": "x"}, "c"', {"a": {"b": "x"}}),
    ('{"a": 1}}\n</tool', {"a": 1}),
    ("", {}), ("[1, 2", {}), ("nope", {}), ('{"a": ]', {}),
])
def test_partial_object_keeps_what_is_whole(text, value):
    assert partial_object(text) == value


def test_a_call_cut_short_needs_no_json():
    call = ToolCall("call_x", "f", '{"a": [1, "b', complete=False)
    assert call.arguments == '{"a": [1, "b' and call.input() == {"a": [1, "b"]}
    with pytest.raises(ValueError):
        ToolCall("call_x", "f", '{"a": [1, "b')


def test_arguments_are_a_json_object_string():
    support = ToolSupport.from_parser("json_tools")
    [call] = support.parse('{"name": "f", "arguments": "{\\"x\\": 1}"}')  # JSON in a string
    assert (call.name, call.arguments) == ("f", '{"x": 1}')
    [call] = support.parse('{"name": "f", "arguments": {"s": "é"}}')
    assert call.arguments == '{"s": "é"}'
    [call] = support.parse('{"name": "f"}')
    assert call.arguments == "{}"
    for bad in ('{"name": "f", "arguments": [1]}', '{"name": 3}', "[]", "nope"):
        with pytest.raises(ValueError):
            support.parse(bad)


# ---- forcing calls (tool_choice) -------------------------------------------------------


def _generate(loaded, prompt, processors, temp: float, seed: int, max_tokens: int = 400):
    """The output's text, as a server would stream it: a segment a token."""
    model, tokenizer = loaded
    mx.random.seed(seed)
    segments, finish = [], None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                             sampler=make_sampler(temp=temp), logits_processors=processors):
        segments.append(r.text)
        finish = r.finish_reason
    return segments, finish


def _check_calls(calls: list[ToolCall], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}},
           {"type": "function", "function": {"name": "search"}},
           {"type": "function", "function": {"name": "ping"}}]


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c if isinstance(c, str) else
                         c["function"]["name"])
@pytest.mark.parametrize("family", ["json_tools", "qwen3_coder"])
def test_forced_calls_parse_and_validate(dense, coder, family, choice, temp):
    loaded = dense if family == "json_tools" else coder
    tokenizer = loaded[1]
    support = tool_support(tokenizer)
    assert support.parser == family
    tools = canonical_tools(TOOLS)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}],
                                           tools=tools, add_generation_prompt=True)
    grammar = compile_tool_choice(tools, choice, tokenizer, support)
    proc = grammar.processor()
    segments, finish = _generate(loaded, prompt, [proc], temp, seed=len(str(choice)))
    text, calls = _run(support.stream(tools), segments)
    assert proc.error is None
    if isinstance(choice, dict):  # exactly that one call, then EOS
        name = choice["function"]["name"]
        assert finish == "stop" and proc.finished, "".join(segments)
        assert text == "" and len(calls) == 1
        _check_calls(calls, {name})
    else:  # one or more calls; a random model may run on to max_tokens with more of them
        _check_calls(calls, set(SCHEMAS))
        if finish == "stop":
            assert text == "" and proc.accepting
        else:
            assert text.startswith(support.start)  # the call cut short, as text


def after_calls(tokenizer, calls: int):
    """A stand-in for a model that makes ``calls`` parallel calls: after each end marker
    it favours the newline that begins another call, after the last one EOS."""
    end = tokenizer.convert_tokens_to_ids("</tool_call>")
    eos = min(tokenizer.eos_token_ids)
    state = {}

    def processor(tokens, logits):
        done = tokens.tolist().count(end) - state.setdefault("prompt", tokens.tolist().count(end))
        if tokens[-1].item() == end and state.get("seen") != tokens.size:
            state["seen"] = tokens.size
            bias = mx.zeros(logits.shape[-1])
            bias[ord("\n") if done < calls else eos] = 100.0
            return logits + bias
        return logits

    return processor


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("family", ["json_tools", "qwen3_coder"])
def test_forced_parallel_calls(dense, coder, family, temp):
    loaded = dense if family == "json_tools" else coder
    tokenizer = loaded[1]
    support = tool_support(tokenizer)
    tools = canonical_tools(TOOLS)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Three calls."}],
                                           tools=tools, add_generation_prompt=True)
    proc = compile_tool_choice(tools, "required", tokenizer, support).processor()
    segments, finish = _generate(loaded, prompt, [after_calls(tokenizer, 3), proc], temp,
                                 seed=7, max_tokens=800)
    assert finish == "stop" and proc.error is None, "".join(segments)
    for chunks in (segments, list("".join(segments))):
        text, calls = _run(support.stream(tools), chunks)
        assert text == "" and len(calls) == 3
        _check_calls(calls, set(SCHEMAS))
    single = compile_tool_choice(tools, "required", tokenizer, support, parallel=False)
    segments, finish = _generate(loaded, prompt, [after_calls(tokenizer, 3),
                                                  single.processor()], temp, seed=7)
    text, calls = _run(support.stream(tools), segments)
    assert finish == "stop" and text == "" and len(calls) == 1


def test_unforced_output_is_no_call(dense):
    """The control: without the grammar the random model writes no call."""
    model, tokenizer = dense
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Weather?"}],
                                           tools=canonical_tools(TOOLS),
                                           add_generation_prompt=True)
    segments, _ = _generate(dense, prompt, [], 0.0, 0, max_tokens=60)
    text, calls = _run(tool_support(tokenizer).stream(), segments)
    assert calls == [] and text


def _finite(logits: mx.array) -> set[int]:
    return set(np.nonzero(np.isfinite(np.array(logits.astype(mx.float32)))[0])[0].tolist())


def test_the_first_token_is_the_start_marker_and_eos_ends_one_call(dense):
    model, tokenizer = dense
    support = tool_support(tokenizer)
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    prompt = tokenizer.encode("hi")
    size = model.model.embed_tokens.weight.shape[0]
    for parallel, after in ((True, {ord("\n")} | tokenizer.eos_token_ids),
                            (False, tokenizer.eos_token_ids)):
        proc = compile_tool_choice(TOOLS, "required", tokenizer, support,
                                   parallel=parallel).processor()
        assert _finite(proc(mx.array(prompt), mx.zeros((1, size)))) == {start}
        call = ([start] + tokenizer.encode('\n{"name": "ping", "arguments": {}}\n',
                                           add_special_tokens=False) + [end])
        assert _finite(proc(mx.array(prompt + call), mx.zeros((1, size)))) == after
        assert proc.accepting and proc.error is None


def test_tool_choice_errors(dense):
    tokenizer = dense[1]
    support = tool_support(tokenizer)
    for choice in ("auto", "none", None):
        assert compile_tool_choice(TOOLS, choice, tokenizer, support) is None
    cases = [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, support, "tool_choice",
         "nope"),
        (TOOLS, {"type": "function"}, support, "tool_choice", "tool_choice must be"),
        (TOOLS, "always", support, "tool_choice", "always"),
        ([], "required", support, "tools", "needs tools"),
        (TOOLS, "required", None, "tools", "cannot call tools"),
        (TOOLS, "required", ToolSupport.from_parser("pythonic"), "tool_choice",
         "pythonic"),
        ([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
         "required", support, "tools", "nonsense"),
    ]
    for tools, choice, sup, param, words in cases:
        with pytest.raises(StructuredOutputError, match=words) as info:
            compile_tool_choice(tools, choice, tokenizer, sup)
        assert info.value.param == param


@pytest.mark.parametrize("extra", [None, True])
def test_a_forced_call_takes_only_the_declared_arguments_unless_open(dense, extra):
    """A parameters schema without ``additionalProperties`` is closed in a forced call (a small
    model invented a "description" argument and wrote it until max_tokens cut the call);
    ``additionalProperties: true`` keeps it open."""
    tokenizer = dense[1]
    support = tool_support(tokenizer)
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    if extra is not None:
        params["additionalProperties"] = extra
    tools = canonical_tools([{"type": "function", "function": {"name": "get_weather",
                                                               "parameters": params}}])
    grammar = compile_tool_choice(tools, "required", tokenizer, support)

    def accepted(arguments: str) -> bool:
        text = (f'{support.start}\n{{"name": "get_weather", "arguments": {arguments}}}\n'
                f'{support.end}')
        tokens = tokenizer.encode(text, add_special_tokens=False)
        return grammar._template.deep_copy().validate_tokens(tokens) == len(tokens)

    assert accepted('{"city": "Oslo"}')
    assert accepted('{"city": "Oslo", "description": "x"}') is bool(extra)
