"""The OpenAI Responses translation, checked against the real ``openai`` SDK.

No model and no server: requests are built by the SDK and captured through a
mock transport; our response objects and SSE streams are fed back to the SDK,
which must parse them into its own types (``Response``, stream events) and
accumulate a stream to the same response as the non-streamed answer.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import openai._base_client as sdk_base
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from serve_app.api.responses_api import ResponseStream, accumulate, response_collector
from serve_app.api.responses_request import (
    parse_request,
    renamed,
    to_chat_request,
    validation_error,
)
from serve_app.api.sse import sse_event
from serve_app.serving.events import Delta, Event, Finish, Start, ToolCall
from serve_app.serving.request import ApiError, ChatCompletionRequest, checked

HTTP = getattr(sdk_base, "httpx2", None) or sdk_base.httpx
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
MODEL = "tiny-dense"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def sdk_client(handler) -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                         http_client=HTTP.Client(transport=HTTP.MockTransport(handler)))


def internal(*texts: str, calls: tuple[tuple[str, str, str], ...] = (), reason: str = "stop",
             prompt: int = 30, cached: int = 16, completion: int = 7) -> list[Event]:
    """The service's events for one generation: start, text deltas, tool calls, finish."""
    return [Start(prompt, cached), *(Delta(t) for t in texts),
            *(ToolCall(i, n, a) for i, n, a in calls),
            Finish(reason, prompt, completion, cached, 0.1)]


def request(**extra: Any):
    return parse_request({"model": MODEL, "input": "hello", **extra})


def stream_events(generation: list[dict], **extra: Any) -> list[dict]:
    stream = ResponseStream(request(**extra), "resp_test")
    out: list[dict] = []
    for e in generation:
        out += stream.feed(e)
    assert stream.done
    return out


def collect(generation: list[dict], **extra: Any) -> dict:
    collector = response_collector(request(**extra), "resp_test")
    for e in generation:
        collector.feed(e)
    return collector.response()


def captured(**kwargs: Any) -> dict:
    """The JSON body the SDK sends for ``responses.create(**kwargs)``."""
    seen: list[dict] = []

    def handler(req):
        seen.append(json.loads(req.content))
        return HTTP.Response(200, json=collect(internal("ok")))

    sdk_client(handler).responses.create(**kwargs)
    return seen[0]


def templated(chat: ChatCompletionRequest) -> list[dict]:
    """What the chat template renders (``Preparer.template_input``'s messages)."""
    return [m.to_template() for m in chat.messages]


def chat_equivalent(messages: list[dict], **extra: Any) -> ChatCompletionRequest:
    return checked(ChatCompletionRequest, {"model": MODEL, "messages": messages, **extra},
                   validation_error)


# ---- requests --------------------------------------------------------------------------------


def test_sdk_request_converts_to_the_chat_request():
    body = captured(
        model=MODEL, instructions="You are terse.",
        input=[{"role": "developer", "content": "Use tools."},
               {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                            {"type": "input_text", "text": "in Oslo?"}]}],
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False, max_output_tokens=50, temperature=0.3, top_p=0.9,
        store=False, metadata={"k": "v"}, user="u1")
    chat = to_chat_request(parse_request(body))
    assert templated(chat) == [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    assert [t.to_template() for t in chat.tools] == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Weather in a city",
                                          "parameters": WEATHER["parameters"], "strict": True}}]
    assert chat.tool_choice.model_dump() == {"type": "function",
                                             "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.stream) == (50, 0.3, 0.9, False)
    assert chat.response_format is None


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}),
])
def test_text_format_becomes_response_format(fmt, expected):
    body = captured(model=MODEL, input="x", text={"format": fmt})
    assert to_chat_request(parse_request(body)).response_format == expected


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_string_tool_choices_pass_through(choice):
    chat = to_chat_request(request(tools=[WEATHER], tool_choice=choice))
    assert chat.tool_choice == choice


def test_the_models_own_output_sent_back_renders_as_the_chat_conversation():
    """A Responses turn (text then a call) sent back with the function's output is the
    same chat conversation, message for message, as a chat client would send: the same
    tokens, so the prefix cache is reused across turns."""
    first = collect(internal("Let me check.", calls=(("call_1", "get_weather",
                                                      '{"city": "Oslo"}'),)))
    output = Response.model_validate(first).output  # the SDK's own items, sent back as is
    body = captured(model=MODEL, instructions="Be brief.", tools=[WEATHER],
                    input=[{"role": "user", "content": "Weather in Oslo?"},
                           {"type": "reasoning", "id": "rs_1", "summary": []},
                           *output,
                           {"type": "function_call_output", "call_id": "call_1",
                            "output": "12 degrees"},
                           {"role": "user", "content": "Thanks"}])
    assert [i.get("type") for i in body["input"]][2:4] == ["message", "function_call"]
    chat = to_chat_request(parse_request(body))
    equivalent = chat_equivalent([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
        {"role": "user", "content": "Thanks"},
    ], tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                if k != "type"}}])
    assert templated(chat) == templated(equivalent)
    assert [t.to_template() for t in chat.tools] == [t.to_template() for t in equivalent.tools]


def test_consecutive_calls_are_one_assistant_turn_and_reasoning_without_text_is_dropped():
    items = [{"role": "user", "content": "two calls"},
             {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "b", "name": "f", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "a",
              "output": [{"type": "input_text", "text": "one"}]},
             {"type": "function_call_output", "call_id": "b", "output": "two"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
             {"role": "user", "content": "again"}]
    plain = templated(to_chat_request(request(input=items)))
    assert plain == [
        {"role": "user", "content": "two calls"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}},
            {"id": "b", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "one", "tool_call_id": "a"},
        {"role": "tool", "content": "two", "tool_call_id": "b"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "again"},
    ]
    reasoning = {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text",
                                                               "text": "hmm"}]}
    for at in (1, 2, 5, 6):
        with_reasoning = [*items[:at], reasoning, *items[at:]]
        assert templated(to_chat_request(request(input=with_reasoning))) == plain


def test_store_true_is_served_as_not_stored_and_ignored_fields_are_accepted():
    r = request(store=True, metadata={"a": "b"}, user="u", include=["reasoning.encrypted_content"],
                reasoning={"effort": "low"}, prompt_cache_key="k", truncation="disabled",
                service_tier="auto", text={"verbosity": "low"})
    to_chat_request(r)
    obj = collect(internal("x"), store=True, metadata={"a": "b"})
    assert obj["store"] is False and obj["metadata"] == {"a": "b"}


def bad(body: dict, param: str, words: str, code: str | None = None) -> None:
    with pytest.raises(ApiError) as err:
        parse_request({"model": MODEL, **body})
    exc = err.value
    assert exc.status == 400, exc.message
    assert exc.param == param, (exc.param, exc.message)
    assert exc.message.startswith(param) and words in exc.message, exc.message
    if code is not None:
        assert exc.code == code
    body = exc.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather",
        "arguments": '{"city": "x"}'}


@pytest.mark.parametrize("body, param, words, code", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     "does not store responses", "unsupported_parameter"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "does not store", None),
    ({"input": "x", "background": True}, "background", "not supported", None),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
     "'item_reference' is not supported", "unsupported_value"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type",
     "'web_search_call' is not supported", None),
    ({"input": user({"type": "input_image", "file_id": "file-1"})},
     "input[0].content[0].image_url", "stores no files", "unsupported_content"),
    ({"input": user({"type": "input_file", "file_id": "f"})}, "input[0].content[0].type",
     "input_file content is not supported", "unsupported_content"),
    ({"input": user({"type": "hologram"})}, "input[0].content[0].type",
     "'hologram' is not supported", None),
    ({"input": user({"type": "input_text"})}, "input[0].content[0].text", "Field required", None),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "Input should be", None),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "c9", "output": "r"}]},
     "input[1].call_id", "no function_call with call_id 'c9'", None),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "c1",
                       "output": [{"type": "input_image", "image_url": "u"}]}]},
     "input[1].output[0].type", "input_image content belongs in a user message", None),
    ({"input": [{**CALL, "arguments": "[1]"}]}, "input[0].arguments", "JSON text of an object",
     None),
    ({"input": [{**CALL, "arguments": "{oops"}]}, "input[0].arguments", "JSON text", None),
    ({"input": []}, "input", "at least one message", None),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input",
     "at least one message", None),
    ({"input": 5}, "input", "valid", None),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type",
     "'web_search' tools are not supported", "unsupported_tool"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}]},
     "tools[0].parameters", "type 'object'", None),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "object",
                                                         "properties": [1]}}]},
     "tools[0].parameters.properties", "mapping names to schemas", None),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "object",
                                                         "required": "city"}}]},
     "tools[0].parameters.required", "list of property names", None),
    ({"input": "x", "tools": [{**WEATHER, "parameters": "nope"}]}, "tools[0].parameters",
     "valid dictionary", None),
    ({"input": "x", "tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name", "pattern",
     None),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "Field required", None),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name", "used twice", None),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name", "no function named 'nope'", None),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools", None),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}},
     "tool_choice.type", "Input should be 'function'", None),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema", "Field required", None),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type",
     "'grammar' is not supported", None),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format", "forced tool_choice", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than", None),
    ({"input": "x", "temperature": 3}, "temperature", "less than", None),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", "not supported", None),
    ({"input": "x", "stream": "yes"}, "stream", "valid boolean", None),
])
def test_invalid_requests_are_400_naming_the_field(body, param, words, code):
    bad(body, param, words, code)


def test_non_object_body_is_400():
    with pytest.raises(ApiError) as err:
        parse_request(["x"])
    assert err.value.status == 400


@pytest.mark.parametrize("exc, param", [
    (ApiError(400, "too long", param="messages", code="context_length_exceeded"), "input"),
    (ApiError(400, "response_format.json_schema.schema: bad",
              param="response_format.json_schema.schema"), "text.format.schema"),
    (ApiError(400, "tools[0].function.parameters: bad", param="tools[0].function.parameters"),
     "tools[0].parameters"),
    (ApiError(400, "tool_choice: bad", param="tool_choice"), "tool_choice"),
    (ApiError(404, "nope", param="model", code="model_not_found"), "model"),
])
def test_errors_from_the_chat_path_name_the_responses_field(exc, param):
    out = renamed(exc)
    assert (out.status, out.param, out.code) == (exc.status, param, exc.code)
    if exc.message.startswith(exc.param):
        assert out.message.startswith(param)


def test_sdk_raises_bad_request_with_our_param():
    err = ApiError(400, "previous_response_id: no", param="previous_response_id")

    def handler(req):
        return HTTP.Response(400, json=err.body())

    with pytest.raises(openai.BadRequestError) as raised:
        sdk_client(handler).responses.create(model=MODEL, input="x",
                                             previous_response_id="resp_1")
    assert raised.value.param == "previous_response_id"


# ---- responses and streams --------------------------------------------------------------------


def test_text_response_validates_as_the_sdks_response():
    obj = collect(internal("Hel", "lo"), instructions="sys", max_output_tokens=20,
                  temperature=0.5, tools=[WEATHER], tool_choice="auto", user="u")
    r = Response.model_validate(obj)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello" and r.incomplete_details is None
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.usage.input_tokens == 30 and r.usage.input_tokens_details.cached_tokens == 16
    assert r.usage.output_tokens == 7 and r.usage.total_tokens == 37
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.user) == ("sys", 20, 0.5, "u")
    assert r.tools[0].name == "get_weather" and r.tools[0].strict is True
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.text.format.type == "text" and r.store is False


def test_function_calls_are_output_items():
    obj = collect(internal("Checking.", calls=(("call_a", "get_weather", '{"city": "Oslo"}'),
                                               ("call_b", "get_weather", '{"city": "Rome"}')),
                           reason="tool_calls"), tools=[WEATHER], tool_choice="required")
    r = Response.model_validate(obj)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    calls = r.output[1:]
    assert [(c.call_id, c.name, c.arguments, c.status) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Oslo"}', "completed"),
        ("call_b", "get_weather", '{"city": "Rome"}', "completed")]
    assert all(c.id.startswith("fc_") for c in calls) and calls[0].id != calls[1].id


def test_cut_by_the_token_limit_is_incomplete():
    obj = collect(internal("abc", reason="length"), max_output_tokens=7)
    r = Response.model_validate(obj)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"


def test_a_call_cut_by_the_token_limit_is_an_incomplete_function_call():
    """Its arguments as far as they got, never the call's markup as message text."""
    cut = ToolCall("call_c", "get_weather", '{"city": "Os', complete=False)
    generation = [Start(30, 0), cut, Finish("length", 30, 7, 0, 0.1)]
    for obj in (collect(generation, tools=[WEATHER], tool_choice="required"),
                accumulate(stream_events(generation, tools=[WEATHER],
                                         tool_choice="required"))):
        r = Response.model_validate(obj)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        [call] = r.output
        assert (call.type, call.name, call.arguments, call.status) == (
            "function_call", "get_weather", '{"city": "Os', "incomplete")


def test_empty_generation_is_a_valid_response():
    r = Response.model_validate(collect(internal(completion=0)))
    assert r.output == [] and r.status == "completed" and r.output_text == ""


def test_named_choice_and_json_schema_format_are_echoed():
    obj = collect(internal("{}"), tools=[WEATHER],
                  tool_choice={"type": "function", "name": "get_weather"})
    assert Response.model_validate(obj).tool_choice.name == "get_weather"
    fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    obj = collect(internal("{}"), text={"format": fmt})
    assert obj["text"] == {"format": fmt}
    assert Response.model_validate(obj).text.format.name == "pick"


def test_stream_event_sequence_and_each_event_validates():
    events = stream_events(internal("Let me ", "check.",
                                    calls=(("call_a", "get_weather", '{"city": "Oslo"}'),)),
                           tools=[WEATHER])
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.delta", 0),
        ("response.output_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        assert STREAM_EVENT.validate_python(e).type == e["type"]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None
    assert events[6]["text"] == "Let me check."
    assert events[4]["item_id"] == events[2]["item"]["id"] == events[8]["item"]["id"]
    assert events[10]["delta"] == events[11]["arguments"] == '{"city": "Oslo"}'
    assert events[11]["name"] == "get_weather"
    assert events[9]["item"]["arguments"] == "" and events[9]["item"]["status"] == "in_progress"
    assert events[12]["item"]["status"] == "completed"
    done = events[-1]["response"]
    assert done["status"] == "completed" and len(done["output"]) == 2
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == 16


def test_stream_cut_by_the_limit_ends_with_response_incomplete():
    events = stream_events(internal("abc", reason="length"))
    assert events[-1]["type"] == "response.incomplete"
    assert STREAM_EVENT.validate_python(events[-1]).response.incomplete_details.reason == (
        "max_output_tokens")


def test_an_error_after_the_start_sends_error_then_response_failed():
    stream = ResponseStream(request(), "resp_test")
    events = stream.feed(internal()[0]) + stream.feed(Delta("par"))
    events += stream.feed(ApiError(503, "replica lost", type="service_unavailable",
                                   code="replica_lost").to_failure())
    assert stream.done
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    for e in events:
        STREAM_EVENT.validate_python(e)
    assert events[-2]["code"] == "replica_lost" and events[-2]["message"] == "replica lost"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "par"
    assert accumulate(events)["status"] == "failed"


def test_stream_rejects_events_out_of_order():
    stream = ResponseStream(request())
    with pytest.raises(RuntimeError):
        stream.feed(Delta("x"))
    stream.feed(internal()[0])
    with pytest.raises(RuntimeError):
        stream.feed(internal()[0])


def test_collector_raises_the_error_event_and_needs_a_finish():
    collector = response_collector(request())
    collector.feed(internal()[0])
    with pytest.raises(ApiError) as err:
        collector.feed(ApiError(500, "boom", type="server_error").to_failure())
    assert err.value.message == "boom"
    collector = response_collector(request())
    collector.feed(internal()[0])
    with pytest.raises(ApiError) as err:
        collector.response()
    assert err.value.status == 500


def test_sse_framing_names_the_event():
    event = {"type": "response.output_text.delta", "sequence_number": 4, "delta": "x"}
    assert sse_event(event) == (
        b'event: response.output_text.delta\n'
        b'data: {"type":"response.output_text.delta","sequence_number":4,"delta":"x"}\n\n')


def test_sdk_stream_accumulates_to_the_non_streamed_response():
    generation = internal("Let me ", "check.",
                          calls=(("call_a", "get_weather", '{"city": "Oslo"}'),))
    stream = ResponseStream(request(tools=[WEATHER]), "resp_same", created_at=1.0)
    events = [out for e in generation for out in stream.feed(e)]

    def handler(req):
        assert json.loads(req.content)["stream"] is True
        body = b"".join(sse_event(e) for e in events)
        return HTTP.Response(200, content=body, headers={"content-type": "text/event-stream"})

    with sdk_client(handler).responses.stream(model=MODEL, input="hello",
                                              tools=[WEATHER]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds == [e["type"] for e in events]
    assert final.output_text == "Let me check."
    assert final.output[1].arguments == '{"city": "Oslo"}'
    # The collector's non-streamed answer is ``accumulate`` of these same events.
    expected = Response.model_validate(accumulate(events)).model_dump(exclude_none=True)
    got = final.model_dump(exclude_none=True)
    assert got["output"][1].pop("parsed_arguments") == {"city": "Oslo"}  # the SDK's own
    assert got == expected
    assert accumulate(events) == events[-1]["response"]


def test_sdk_create_returns_our_response():
    obj = collect(internal("hi there"))

    def handler(req):
        assert json.loads(req.content)["input"] == "hello"
        return HTTP.Response(200, json=obj)

    r = sdk_client(handler).responses.create(model=MODEL, input="hello")
    assert isinstance(r, Response) and r.output_text == "hi there"
