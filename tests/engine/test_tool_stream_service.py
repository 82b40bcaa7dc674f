"""Tool-call parsing through the service, for each parser, with a scripted token stream.

The real engine and ``ModelService`` run the embedded model; a logits processor makes
it say exactly the scripted text, token by token (its random weights would say noise),
so the service's streaming extraction is exercised the way a real model's output
arrives: one token at a time, calls split across many chunks, text around them.
"""

from __future__ import annotations

import asyncio
import json

import mlx_lm
import pytest

from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.events import Delta, Event, Finish, ToolCall
from serve_app.serving.request import ChatCompletionRequest
from serve_app.serving.service import ModelService
from serve_app.serving.tools import ToolSupport
from tests.support.engine import Script

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}

SCRIPTS = {
    "json_tools": (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "CET"}}\n</tool_call>'),
    "qwen3_coder": (
        "Let me look.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
        "</function>\n</tool_call>"),
}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    path = materialize("tiny-dense", tmp_path_factory.mktemp("tools"))
    model, tokenizer = mlx_lm.load(str(path))
    svc = ModelService(ModelProfile(name="m", source="embedded:tiny-dense",
                                    cache={"enabled": False}), model, tokenizer, path)
    yield svc
    svc.shutdown()


def events_of(service: ModelService, script: str, stream_tools: bool = True,
              max_tokens: int = 400, choice=None) -> list[Event]:
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Go"}],
                                    tools=[WEATHER, TIME], max_tokens=max_tokens,
                                    temperature=0,
                                    tool_choice=choice or ("auto" if stream_tools else "none"))
    tokens = service.tokenizer.encode(script, add_special_tokens=False)
    eos = next(iter(service.eos_ids))

    async def go() -> list[Event]:
        prepared = service.prepare(request)
        out = []
        service.constraints = lambda _: (Script(tokens, eos),)
        try:
            async for batch in service.stream(prepared):
                out += batch
        finally:
            del service.constraints
        return out

    return asyncio.run(go())


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_scripted_tool_calls_come_out_as_calls(service, parser):
    service.preparer._tool_support = ToolSupport.from_parser(parser)
    try:
        events = events_of(service, SCRIPTS[parser])
    finally:
        service.preparer._tool_support = ToolSupport.from_parser("json_tools")
    text = "".join(e.text for e in events if isinstance(e, Delta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    finish = events[-1]
    assert text == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert isinstance(finish, Finish) and finish.finish_reason == "tool_calls"


def test_the_embedded_models_own_parser_is_picked(service):
    support = service.preparer.tool_support
    assert support is not None and support.parser == "json_tools"


def test_tool_choice_none_leaves_the_text_alone(service):
    events = events_of(service, SCRIPTS["json_tools"], stream_tools=False)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    assert text == SCRIPTS["json_tools"] and not [e for e in events if isinstance(e, ToolCall)]
    assert events[-1].finish_reason == "stop"


def test_a_call_cut_short_is_text_not_a_broken_call(service):
    cut = SCRIPTS["json_tools"][:60]  # inside the first call's arguments
    events = events_of(service, cut)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    assert not [e for e in events if isinstance(e, ToolCall)]
    assert text == cut and events[-1].finish_reason == "stop"


FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
          "</tool_call>")


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required", None])
def test_a_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(service, choice):
    """Forced (a named function, "required") or not: the call as far as it got, never its
    markup as text. A forced call is one from its first token on."""
    tokens = service.tokenizer.encode(FORCED, add_special_tokens=False)
    name_end = len(service.tokenizer.encode('<tool_call>\n{"name": "get_w',
                                            add_special_tokens=False))
    for max_tokens in (1, 3, name_end + 1, len(tokens) - 8, len(tokens) - 1):
        events = events_of(service, FORCED, max_tokens=max_tokens, choice=choice)
        calls = [e for e in events if isinstance(e, ToolCall)]
        text = "".join(e.text for e in events if isinstance(e, Delta))
        assert events[-1].finish_reason == "length", max_tokens
        if choice is None and max_tokens < name_end:  # auto: not yet a call of a tool
            assert not calls and FORCED.startswith(text), max_tokens
            continue
        assert text == "" and len(calls) == 1, (max_tokens, text)
        [call] = calls
        assert call.name == "get_weather" or choice == "required", max_tokens
        full = '{"city": "Oslo", "days": 2}'
        if max_tokens == len(tokens) - 1:  # all but the end marker: the arguments are whole
            assert call.complete and json.loads(call.arguments) == json.loads(full)
        else:
            assert not call.complete and full.startswith(call.arguments), max_tokens


def test_a_model_without_a_tool_format_refuses_tools(service):
    """400 in either API's shape (the Anthropic routes map it), never a silent prompt."""
    from serve_app.api.anthropic_api import error_reply
    from serve_app.serving.request import ApiError

    saved = service.preparer._tool_support
    service.preparer._tool_support = None
    try:
        with pytest.raises(ApiError) as err:
            service.prepare(ChatCompletionRequest(
                model="m", messages=[{"role": "user", "content": "Go"}], tools=[WEATHER]))
        # Without tools (or with tool_choice none) the same model serves the request.
        service.prepare(ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "Go"}], tools=[WEATHER],
            tool_choice="none"))
    finally:
        service.preparer._tool_support = saved
    assert err.value.status == 400 and err.value.code == "tools_not_supported"
    assert err.value.param == "tools" and "cannot call tools" in err.value.message
    assert error_reply(err.value).body()["error"]["type"] == "invalid_request_error"


def test_the_last_text_is_parsed_before_the_stream_finishes(service):
    """Text the decoder releases only at the end (held for a stop string, say) still
    comes out in order, and a call it completes is a call."""
    from serve_app.serving.stream import emit_text

    calls = service.preparer.tool_support.stream()
    out: list[Event] = []
    head = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
    emit_text(out, "Hello " + head, calls, None)
    emit_text(out, "\n</tool_call> world", calls, None, final=True)
    text = "".join(e.text for e in out if isinstance(e, Delta))
    assert text == "Helloworld"  # in order; whitespace next to a call is the template's
    assert [e.name for e in out if isinstance(e, ToolCall)] == ["get_time"]
