"""The Anthropic Messages translation, checked against the real ``anthropic`` SDK.

No model and no server: requests are built by the SDK and captured through a
mock transport; our responses and SSE streams are fed back to the SDK, which
must parse them into its own types (``Message``, stream events, errors).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import anthropic
import anthropic._base_client as sdk_base
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from serve_app.api.anthropic_api import (
    MessageStream,
    ToolCall,
    accumulate,
    count_tokens_response,
    error_event,
    error_reply,
    error_type,
    message_collector,
    usage,
)
from serve_app.api.anthropic_request import (
    ChatInput,
    parse_count_tokens_request,
    parse_messages_request,
    to_chat_input,
)
from serve_app.api.sse import sse_event
from serve_app.serving.events import Delta, Event, Finish, Start
from serve_app.serving.request import ApiError

# The SDK's own HTTP module: httpx for older releases, httpx2 for newer ones.
HTTP = getattr(sdk_base, "httpx2", None) or sdk_base.httpx
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
ERROR_RESPONSE = TypeAdapter(ErrorResponse)
MODEL = "tiny-dense"

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {}},
             "cache_control": {"type": "ephemeral"}}


def sdk_client(handler) -> anthropic.Anthropic:
    transport = HTTP.MockTransport(handler)
    return anthropic.Anthropic(api_key="test-key", base_url="http://test", max_retries=0,
                               http_client=HTTP.Client(transport=transport))


def json_response(status: int, body: Any, headers: dict[str, str] | None = None):
    return HTTP.Response(status, json=body, headers=headers)


def sse_response(events: list[dict]):
    body = b"".join(sse_event(e) for e in events)
    return HTTP.Response(200, content=body, headers={"content-type": "text/event-stream"})


def base_request(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64,
            "messages": [{"role": "user", "content": "hello"}], **extra}


def internal(prompt: int = 30, cached: int = 16, *texts: str, reason: str = "stop",
             completion: int = 7, stop_sequence: str | None = None,
             calls: tuple[ToolCall, ...] = ()) -> list[Event]:
    """The service's events for one generation: start, text deltas, tool calls, finish."""
    finish = Finish(reason, prompt, completion, cached, 0.1, stop_sequence)
    return [Start(prompt, cached), *(Delta(t) for t in texts), *calls, finish]


def stream_events(events: list, message_id: str = "msg_test") -> list[dict]:
    stream = MessageStream(MODEL, message_id)
    out: list[dict] = []
    for e in events:
        out += stream.feed(e)
    assert stream.done
    return out


def collect(events: list, message_id: str = "msg_test") -> dict:
    collector = message_collector(MODEL, message_id)
    for e in events:
        collector.feed(e)
    return collector.response()


CALL_A = ToolCall("toolu_a", "get_weather", '{"city": "Paris"}')
CALL_B = ToolCall("toolu_b", "get_time", "")


# ---- requests: what the SDK sends, parsed and converted ------------------------------------


def captured_request(**kwargs: Any) -> dict:
    """The JSON body the SDK sends for ``messages.create(**kwargs)``."""
    seen: list[dict] = []

    def handler(request):
        seen.append(json.loads(request.content))
        message = collect(internal(10, 0, "ok"))
        return json_response(200, message)

    sdk_client(handler).messages.create(**kwargs)
    return seen[0]


def test_sdk_request_with_tools_converts_to_chat_messages():
    body = captured_request(
        model=MODEL,
        max_tokens=100,
        system=[{"type": "text", "text": "You are terse."},
                {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C, sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "clock"}, {"type": "text", "text": "down"}],
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Thanks, summarise."},
            ]},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
        # Newer SDKs dropped the sampling arguments; older ones and other clients send them.
        extra_body={"temperature": 0.5, "top_k": 5},
    )
    chat = to_chat_input(parse_messages_request(body))
    assert isinstance(chat, ChatInput)
    assert chat.template_messages() == [
        # One text part per system block (normalization rules see blocks); joined,
        # they are the blocks separated by newlines.
        {"role": "system", "content": [{"type": "text", "text": "You are terse.\n"},
                                       {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "content": "18C, sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: clock\ndown", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Thanks, summarise."},
    ]
    assert chat.template_tools() == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Current weather in a city",
                                          "parameters": WEATHER_TOOL["input_schema"]}},
        {"type": "function", "function": {"name": "get_time",
                                          "parameters": TIME_TOOL["input_schema"]}},
    ]
    assert chat.tool_choice.to_openai() == {"type": "function",
                                            "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.cache_control_points == (0, 4)  # the system message, the marked tool result
    assert chat.tools_cache_control is True
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.stop) == (100, 0.5, 5, ("END",))
    assert chat.continue_final is False


def test_tool_arguments_reach_templates_as_objects():
    body = base_request(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
    ], tools=[WEATHER_TOOL])
    chat = to_chat_input(parse_messages_request(body))
    assert chat.template_messages()[1]["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Zürich"}')
    # As the chat request every replica takes, the template gets an object.
    from serve_app.api.http import chat_request

    message = chat_request(chat, "m", False).messages[1].to_template()
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}
    assert chat.template_messages()[2] == {"role": "tool", "content": "", "tool_call_id": "t1"}


@pytest.mark.parametrize("choice, expected, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}},
     True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
])
def test_tool_choice_maps_to_openai(choice, expected, parallel):
    chat = to_chat_input(parse_messages_request(
        base_request(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)))
    assert chat.tool_choice.to_openai() == expected
    assert chat.parallel_tool_calls is parallel


def test_no_tool_choice_and_no_tools():
    chat = to_chat_input(parse_messages_request(base_request()))
    assert chat.tool_choice is None and chat.tools == () and chat.template_tools() is None
    assert chat.template_messages() == [{"role": "user", "content": "hello"}]


def test_user_turn_is_split_around_tool_results_in_block_order():
    body = base_request(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "get_time", "input": {}},
            {"type": "tool_use", "id": "b", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "before", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "b", "content": "B"},
            {"type": "text", "text": "between"},
            {"type": "tool_result", "tool_use_id": "a", "content": "A"},
        ]},
    ], tools=[TIME_TOOL])
    chat = to_chat_input(parse_messages_request(body))
    got = [(m.role, m.content, m.tool_call_id) for m in chat.messages]
    assert got == [("user", "go", None), ("assistant", "", None), ("user", "before", None),
                   ("tool", "B", "b"), ("user", "between", None), ("tool", "A", "a")]
    assert chat.cache_control_points == (2,)


def test_final_assistant_message_is_continued_and_redacted_thinking_is_dropped():
    body = base_request(messages=[
        {"role": "user", "content": "Pick A or B"},
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "The answer is ("}]},
    ])
    chat = to_chat_input(parse_messages_request(body))
    assert chat.continue_final is True
    assert chat.template_messages()[-1] == {"role": "assistant", "content": "The answer is ("}


@pytest.mark.parametrize("content", [[], "", [{"type": "redacted_thinking", "data": "d"}]])
def test_empty_final_assistant_message_is_dropped(content):
    body = base_request(messages=[{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": content}])
    chat = to_chat_input(parse_messages_request(body))
    assert chat.continue_final is False
    assert [m.role for m in chat.messages] == ["user"]


def test_top_level_cache_control_marks_the_last_message():
    body = base_request(system="s", cache_control={"type": "ephemeral"}, messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}])
    chat = to_chat_input(parse_messages_request(body))
    assert chat.cache_control_points == (3,)


def test_system_string_and_plain_request():
    chat = to_chat_input(parse_messages_request(base_request(system="Be brief.")))
    assert chat.template_messages() == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "hello"}]
    assert chat.cache_control_points == ()


def bad(body: dict, where: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_messages_request(body)
    assert info.value.status == 400
    assert info.value.param == where, info.value.message
    assert info.value.message.startswith(f"{where}: "), info.value.message
    assert words in info.value.message, info.value.message


def user(*blocks: dict) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
CALLED = [{"role": "user", "content": "x"},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time",
                                             "input": {}}]}]


@pytest.mark.parametrize("body, where, words", [
    (base_request(messages=user({"type": "image", "source": {"type": "base64"}})),
     "messages.0.content.0.source", "a base64 image needs media_type and data"),
    (base_request(messages=user({"type": "document", "source": {}})), "messages.0.content.0",
     "document content blocks are not supported"),
    (base_request(messages=[*CALLED, *user({"type": "tool_result", "tool_use_id": "t1",
                                            "content": [IMAGE]})]),
     "messages.2.content.0.content.0", "image content blocks are not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens",
     "Field required"),
    (base_request(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (base_request(temperature=1.5), "temperature", "less than or equal to 1"),
    (base_request(stream="yes"), "stream", "valid boolean"),
    (base_request(stop_sequences="END"), "stop_sequences", "valid list"),
    (base_request(messages=[]), "messages", "at least 1 item"),
    (base_request(messages=[{"role": "system", "content": "x"}]), "messages.0.role",
     "'user' or 'assistant'"),
    (base_request(messages=[{"role": "user", "content": []}]), "messages.0.content",
     "must not be empty"),
    (base_request(messages=user({"type": "video"})), "messages.0.content.0",
     "content block type 'video' is not supported"),
    (base_request(messages=user({"text": "no type"})), "messages.0.content.0", "no 'type'"),
    (base_request(messages=user({"type": "text"})), "messages.0.content.0.text",
     "Field required"),
    (base_request(messages=user({"type": "tool_use", "id": "t", "name": "n", "input": {}})),
     "messages.0.content.0", "tool_use blocks belong in assistant messages"),
    (base_request(messages=[{"role": "user", "content": "x"},
                            {"role": "assistant", "content": [
                                {"type": "tool_result", "tool_use_id": "t"}]},
                            {"role": "user", "content": "y"}]),
     "messages.1.content.0", "tool_result blocks belong in user messages"),
    (base_request(messages=user({"type": "tool_result", "tool_use_id": "nope"})),
     "messages.0.content.0.tool_use_id", "no tool_use block with id 'nope'"),
    (base_request(messages=CALLED), "messages.1", "final assistant message cannot contain"),
    (base_request(messages=user({"type": "text", "text": "x", "cache_control": {"type": "x"}})),
     "messages.0.content.0.cache_control.type", "'ephemeral'"),
    (base_request(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_time"}),
     "tool_choice.name", "no tool named 'get_time'"),
    (base_request(tools=[WEATHER_TOOL], tool_choice={"type": "tool"}), "tool_choice.name",
     "required"),
    (base_request(tool_choice={"type": "any"}), "tool_choice", "needs tools"),
    (base_request(tool_choice={"type": "sometimes"}), "tool_choice.type", "'auto'"),
    (base_request(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "tools.0.type", "server tool 'web_search_20250305' is not supported"),
    (base_request(tools=[WEATHER_TOOL, WEATHER_TOOL]), "tools.1.name", "used twice"),
    (base_request(tools=[{**WEATHER_TOOL, "name": "get weather"}]), "tools.0.name",
     "only letters, digits"),
    (base_request(tools=[{"name": "t"}]), "tools.0.input_schema", "Field required"),
    (base_request(tools=[{"name": "t", "input_schema": {"type": "string"}}]),
     "tools.0.input_schema", "type 'object'"),
])
def test_invalid_requests_are_400_naming_the_field(body, where, words):
    bad(body, where, words)


def test_non_object_body_is_400():
    with pytest.raises(ApiError) as info:
        parse_messages_request([1, 2])
    assert info.value.status == 400 and "JSON object" in info.value.message


def test_check_supported_raises_the_same_400():
    from serve_app.api.anthropic_request import MessagesRequest

    parsed = MessagesRequest.model_validate(base_request(messages=user(
        {"type": "document", "source": {}})))
    with pytest.raises(ApiError, match="document content blocks are not supported"):
        parsed.check_supported()


def test_count_tokens_request_needs_no_max_tokens_and_sdk_accepts_the_answer():
    seen: list[dict] = []

    def handler(request):
        assert request.url.path == "/v1/messages/count_tokens"
        seen.append(json.loads(request.content))
        return json_response(200, count_tokens_response(42))

    result = sdk_client(handler).messages.count_tokens(
        model=MODEL, system="sys", messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER_TOOL])
    assert result.input_tokens == 42
    assert MessageTokensCount.model_validate(count_tokens_response(42)).input_tokens == 42
    chat = to_chat_input(parse_count_tokens_request(seen[0]))
    assert chat.max_tokens is None and [m.role for m in chat.messages] == ["system", "user"]
    assert [t.name for t in chat.tools] == ["get_weather"]


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
    (503, "overloaded_error"), (529, "overloaded_error"),
])
def test_error_type_follows_the_status(status, kind):
    assert error_type(status) == kind
    reply = error_reply(ApiError(status, "boom", type="whatever"))
    assert reply.status == status
    assert reply.body() == {"type": "error", "error": {"type": kind, "message": "boom"}}


def test_error_reply_keeps_retry_after_and_validates_as_sdk_error_response():
    exc = ApiError(429, "queue full", type="rate_limit_error", code="queue_full",
                   headers={"Retry-After": "1"})
    reply = error_reply(exc)
    assert reply.headers == {"Retry-After": "1"}
    parsed = ERROR_RESPONSE.validate_python(reply.body())
    assert (parsed.type, parsed.error.type, parsed.error.message) == (
        "error", "rate_limit_error", "queue full")


@pytest.mark.parametrize("status, sdk_error", [
    (400, anthropic.BadRequestError),
    (401, anthropic.AuthenticationError),
    (404, anthropic.NotFoundError),
    (429, anthropic.RateLimitError),
    (500, anthropic.InternalServerError),
    (503, anthropic.InternalServerError),
    (529, anthropic.OverloadedError),
])
def test_sdk_raises_its_error_class_with_our_message(status, sdk_error):
    reply = error_reply(ApiError(status, f"failure {status}"))

    def handler(request):
        return json_response(reply.status, reply.body(), reply.headers)

    with pytest.raises(sdk_error) as info:
        sdk_client(handler).messages.create(**base_request())
    assert info.value.status_code == status
    assert info.value.body["error"] == {"type": error_type(status), "message": f"failure {status}"}
    assert f"failure {status}" in str(info.value)


def test_sdk_stream_request_refused_before_streaming_raises_bad_request():
    reply = error_reply(ApiError(400, "messages.0.content.0: image content blocks are not "
                                      "supported by this server"))

    def handler(request):
        assert json.loads(request.content)["stream"] is True
        return json_response(reply.status, reply.body())

    with pytest.raises(anthropic.BadRequestError, match="image content blocks"):
        with sdk_client(handler).messages.stream(**base_request()) as stream:
            stream.get_final_message()


def test_sdk_raises_on_an_error_event_mid_stream():
    stream = MessageStream(MODEL, "msg_err")
    sent = stream.start(30) + stream.text("partial ")
    sent += stream.feed(ApiError(503, "the replica went away; retry shortly").to_failure())
    assert sent[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                   "message": "the replica went away; "
                                                              "retry shortly"}}
    assert stream.done

    def handler(request):
        return sse_response(sent)

    texts: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as info:
        with sdk_client(handler).messages.stream(**base_request()) as s:
            for text in s.text_stream:
                texts.append(text)
    assert texts == ["partial "]
    assert info.value.body["error"]["type"] == "overloaded_error"
    assert info.value.body["error"]["message"] == "the replica went away; retry shortly"


# ---- non-streaming message ------------------------------------------------------------------


def test_text_message_validates_as_sdk_message_with_anthropic_usage():
    message = collect(internal(30, 16, "Hel", "lo"))
    assert message == {
        "id": "msg_test", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 14, "output_tokens": 7, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 16},
    }
    parsed = Message.model_validate(message)
    assert parsed.content[0].text == "Hello"
    assert parsed.usage.input_tokens == 14 and parsed.usage.cache_read_input_tokens == 16


@pytest.mark.parametrize("kwargs, reason, sequence", [
    ({"reason": "length"}, "max_tokens", None),
    ({"reason": "stop", "stop_sequence": "END"}, "stop_sequence", "END"),
    ({"reason": "stop"}, "end_turn", None),
    ({"reason": "stop", "calls": (CALL_A,)}, "tool_use", None),
    ({"reason": "length", "calls": (CALL_A,)}, "max_tokens", None),
])
def test_stop_reasons(kwargs, reason, sequence):
    message = collect(internal(10, 0, "x", **kwargs))
    parsed = Message.model_validate(message)
    assert (parsed.stop_reason, parsed.stop_sequence) == (reason, sequence)
    delta = [e for e in stream_events(internal(10, 0, "x", **kwargs))
             if e["type"] == "message_delta"]
    assert delta[0]["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


def test_tool_use_message_has_text_then_tool_use_blocks():
    message = collect(internal(20, 0, "Let me check.", calls=(CALL_A, CALL_B)))
    parsed = Message.model_validate(message)
    assert [b.type for b in parsed.content] == ["text", "tool_use", "tool_use"]
    assert parsed.content[1].id == "toolu_a" and parsed.content[1].name == "get_weather"
    assert parsed.content[1].input == {"city": "Paris"}
    assert parsed.content[2].input == {}
    assert parsed.stop_reason == "tool_use"


def test_empty_generation_is_a_valid_message():
    parsed = Message.model_validate(collect(internal(5, 0, completion=1)))
    assert parsed.content == [] and parsed.stop_reason == "end_turn"
    assert parsed.usage.output_tokens == 1


def test_collector_raises_the_error_event():
    collector = message_collector(MODEL)
    collector.feed(Start(3, 0))
    with pytest.raises(ApiError) as info:
        collector.feed(ApiError(500, "engine failed", type="server_error").to_failure())
    assert info.value.status == 500 and error_reply(info.value).type == "api_error"


def test_collector_without_finish_is_a_500():
    collector = message_collector(MODEL)
    collector.feed(Start(3, 0))
    collector.feed(Delta("a"))
    with pytest.raises(ApiError) as info:
        collector.response()
    assert info.value.status == 500


def test_sdk_create_returns_our_message():
    message = collect(internal(30, 16, "Hi", calls=(CALL_A,)))

    def handler(request):
        assert request.url.path == "/v1/messages"
        return json_response(200, message)

    got = sdk_client(handler).messages.create(**base_request())
    assert got.id == "msg_test" and got.stop_reason == "tool_use"
    assert got.content[0].text == "Hi" and got.content[1].input == {"city": "Paris"}
    assert got.usage.input_tokens == 14


def test_usage_never_goes_negative():
    assert usage(5, 1, 5) == {"input_tokens": 0, "output_tokens": 1,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 5}


# ---- streaming -----------------------------------------------------------------------------


def test_stream_event_sequence_and_each_event_validates():
    events = stream_events(internal(30, 16, "Let me ", "check.", calls=(CALL_A, CALL_B)))
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None),
    ]
    for e in events:
        assert STREAM_EVENT.validate_python(e).type == e["type"]
    start = events[0]["message"]
    assert start["usage"] == {"input_tokens": 14, "output_tokens": 0,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16}
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert events[2]["delta"] == {"type": "text_delta", "text": "Let me "}
    assert events[5]["content_block"] == {"type": "tool_use", "id": "toolu_a",
                                          "name": "get_weather", "input": {}}
    assert events[6]["delta"] == {"type": "input_json_delta",
                                  "partial_json": '{"city": "Paris"}'}
    assert events[9]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert events[11]["usage"]["output_tokens"] == 7
    assert events[11]["delta"]["stop_reason"] == "tool_use"


def test_text_after_a_tool_call_opens_a_new_text_block():
    generation = internal(5, 0, "a", calls=(CALL_A,))
    generation.insert(-1, Delta("b"))
    events = stream_events(generation)
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["text", "tool_use", "text"]
    message = accumulate(events)
    assert [b.get("text") for b in message["content"]] == ["a", None, "b"]


def test_sse_framing_is_exact():
    assert sse_event({"type": "message_stop"}) == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    ping = MessageStream(MODEL).ping()
    assert sse_event(ping[0]) == b'event: ping\ndata: {"type":"ping"}\n\n'


def test_sdk_accumulates_our_stream_to_the_same_message_as_non_streaming():
    generation = internal(30, 16, "Let me ", "check.", calls=(CALL_A,))
    events = stream_events(generation)
    events.insert(1, {"type": "ping"})  # the SDK skips pings

    def handler(request):
        assert json.loads(request.content)["stream"] is True
        return sse_response(events)

    with sdk_client(handler).messages.stream(**base_request()) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Let me check."
    assert final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 7 and final.usage.cache_read_input_tokens == 16
    expected = Message.model_validate(collect(generation))
    assert final.model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)


def test_a_call_cut_by_the_token_limit_is_a_tool_use_block_with_its_input_so_far():
    """The token limit cut a call in its arguments: a tool_use block whose input is what
    of it is whole (an object, streamed or not), and stop_reason max_tokens."""
    cut = ToolCall("toolu_c", "get_weather", '{"city": "Par', complete=False)
    generation = internal(30, 0, calls=(cut,), reason="length")
    message = Message.model_validate(collect(generation))
    assert [b.type for b in message.content] == ["tool_use"]
    assert (message.content[0].name, message.content[0].input) == ("get_weather",
                                                                    {"city": "Par"})
    assert message.stop_reason == "max_tokens"

    def handler(request):
        return sse_response(stream_events(generation))

    with sdk_client(handler).messages.stream(**base_request()) as s:
        final = s.get_final_message()
    assert final.model_dump(exclude_none=True) == message.model_dump(exclude_none=True)


def test_sdk_reads_a_stream_split_into_small_chunks():
    body = b"".join(sse_event(e) for e in stream_events(internal(8, 0, "héllo ", "wörld")))

    def handler(request):
        chunks = [body[i:i + 5] for i in range(0, len(body), 5)]
        return HTTP.Response(200, headers={"content-type": "text/event-stream"},
                             stream=HTTP.ByteStream(b"".join(chunks)))

    with sdk_client(handler).messages.stream(**base_request()) as s:
        assert s.get_final_message().content[0].text == "héllo wörld"


def test_final_cached_count_overrides_the_start_one():
    """A restore that failed is prefilled cold: message_delta's usage is final."""
    generation = internal(30, 16, "x")
    generation[-1] = dataclasses.replace(generation[-1], cached_tokens=0)
    events = stream_events(generation)
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 16

    def handler(request):
        return sse_response(events)

    with sdk_client(handler).messages.stream(**base_request()) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens == 0 and final.usage.input_tokens == 30


def test_stream_rejects_events_out_of_order():
    stream = MessageStream(MODEL)
    with pytest.raises(RuntimeError):
        stream.text("early")
    stream.start(3)
    with pytest.raises(RuntimeError):
        stream.start(3)
    stream.finish("stop", prompt_tokens=3, completion_tokens=0)
    with pytest.raises(RuntimeError):
        stream.feed(Delta("late"))


def test_error_event_shape():
    assert error_event(ApiError(429, "busy")) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}


def test_tool_call_arguments_must_be_a_json_object():
    assert ToolCall("t", "n", "  ").arguments == "{}"
    assert ToolCall("t", "n", '{"a": [1]}').input() == {"a": [1]}
    with pytest.raises(ValueError, match="not JSON"):
        ToolCall("t", "n", "{oops")
    with pytest.raises(ValueError, match="JSON object"):
        ToolCall("t", "n", "[1, 2]")


def test_image_blocks_become_chat_parts_in_order_with_text_runs_joined():
    """Text blocks around images: each run joined as text-only messages join blocks; the
    images as chat image_url parts (data URLs) where they stood."""
    data = {"type": "base64", "media_type": "image/png", "data": "AA=="}
    chat = to_chat_input(parse_messages_request(base_request(messages=user(
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
        {"type": "image", "source": data}, {"type": "text", "text": "c"},
        {"type": "image", "source": data}))))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert chat.template_messages() == [{"role": "user", "content": [
        {"type": "text", "text": "a\nb"}, image, {"type": "text", "text": "c"}, image]}]
    text_only = to_chat_input(parse_messages_request(base_request(messages=user(
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}))))
    assert text_only.template_messages() == [{"role": "user", "content": "a\nb"}]
