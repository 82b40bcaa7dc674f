"""The OpenAI Responses API (``POST /v1/responses``) through ``serve run``.

The real ``openai`` client (``client.responses.create`` / ``.stream``) over HTTP
against the session's server. The embedded models have random weights: function
calls and JSON come out right because the grammar forces them (a forced
``tool_choice``, ``text.format`` json_schema); text is noise but deterministic at
temperature 0.
"""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.support.clients import openai_client
from tests.support.servers import DENSE, HYBRID

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False},
           "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "Time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                       "required": ["zone"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
PICK = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "count"], "additionalProperties": False}
BLOCK = 16  # the test models' cache block size


def instructions(repeat: int = 6) -> str:
    """A long system prompt of its own (a fresh tag first: nothing cached matches it)."""
    rules = "You are a careful coding agent. Follow the rules. " * repeat
    return f"[{uuid.uuid4().hex[:8]}] {rules}"


def chat_tool(tool: dict) -> dict:
    """A flat Responses function tool in chat's shape."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server)


def calls_of(response) -> list:
    return [o for o in response.output if o.type == "function_call"]


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_string_input_and_the_same_instructions_again_are_cached(client, model):
    system = instructions()
    r = client.responses.create(model=model, input="Hello there", instructions=system,
                                max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.instructions == system and r.max_output_tokens == 8 and r.store is False
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == message.content[0].text
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 8 and message.status == "incomplete"
    else:
        assert r.status == "completed" and r.usage.output_tokens <= 8
    assert r.usage.input_tokens > 100 and r.usage.input_tokens_details.cached_tokens < BLOCK
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    again = client.responses.create(model=model, input="Something else entirely",
                                    instructions=system, max_output_tokens=4, temperature=0)
    # The instructions' tokens (all but the last block boundary) come from the cache.
    assert again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 2 * BLOCK


def test_items_render_as_the_equivalent_chat_conversation(client):
    """Message items (developer role, text parts, the assistant's own output_text) are the
    same prompt as the chat conversation: the same token count, the same greedy answer."""
    system = instructions()
    items = [{"role": "developer", "content": "Answer in one line."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "What is "},
                          {"type": "input_text", "text": "a prefix cache?"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "A store of computed prompts."}]},
             {"role": "user", "content": "And a block?"}]
    r = client.responses.create(model=HYBRID, instructions=system, input=items,
                                max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=HYBRID, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What is a prefix cache?"},
        {"role": "assistant", "content": "A store of computed prompts."},
        {"role": "user", "content": "And a block?"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - BLOCK
    assert r.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_a_forced_function_call_and_its_output_round_trip(client, model):
    system = instructions(1)  # the tool's definition is long: the dense model has 1024 tokens
    history: list = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.responses.create(
        model=model, instructions=system, input=history, tools=[WEATHER], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    assert first.status == "completed", first
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    (call,) = calls_of(first)
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The model's own output items go back as they came, then the function's output.
    history += first.output
    history.append({"type": "function_call_output", "call_id": call.call_id,
                    "output": "12 degrees, rain"})
    second = client.responses.create(model=model, instructions=system, input=history,
                                     tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - BLOCK
    # The same tokens as the chat conversation a chat client would send.
    chat = client.chat.completions.create(
        model=model, tools=[chat_tool(WEATHER)], max_tokens=6, temperature=0, messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": first.output_text or None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "12 degrees, rain"}])
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - BLOCK


def test_the_models_own_text_answer_round_trip_reuses_the_cache(client):
    system = instructions()
    history: list = [{"role": "user", "content": "Tell me a story."}]
    first = client.responses.create(model=DENSE, instructions=system, input=history,
                                    max_output_tokens=12, temperature=0)
    history += first.output
    history.append({"role": "user", "content": "Go on."})
    second = client.responses.create(model=DENSE, instructions=system, input=history,
                                     max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + 4
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - BLOCK


def test_required_tool_choice_gives_one_valid_call(client):
    r = client.responses.create(model=HYBRID, input="Weather or time?", tools=[WEATHER, TIME],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=300, temperature=0)
    assert r.status == "completed" and r.parallel_tool_calls is False
    (call,) = calls_of(r)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_json_schema_text_format_validates(client, model):
    fmt = {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}
    kwargs = dict(model=model, input="Pick a color.", text={"format": fmt},
                  max_output_tokens=120, temperature=0.9)
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PICK)
    with client.responses.stream(**kwargs) as s:
        final = s.get_final_response()
    jsonschema.validate(json.loads(final.output_text), PICK)


def test_stream_events_in_order_and_the_final_response(client):
    fmt = {"type": "json_schema", "name": "pick", "schema": PICK}
    kwargs = dict(model=HYBRID, input="Pick one.", instructions=instructions(),
                  text={"format": fmt}, max_output_tokens=120, temperature=0)
    with client.responses.stream(**kwargs) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        final.output_text)
    assert final.status == "completed" and final.id == events[0].response.id
    jsonschema.validate(json.loads(final.output_text), PICK)
    # Non-streamed, the same generation (temperature 0), now from the cache.
    again = client.responses.create(**kwargs)
    assert again.output_text == final.output_text
    assert again.usage.input_tokens == final.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_function_call(client):
    with client.responses.stream(model=DENSE, input="Time in Paris?", tools=[WEATHER, TIME],
                                 tool_choice={"type": "function", "name": "get_time"},
                                 max_output_tokens=100, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    (call,) = calls_of(final)
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME["parameters"])


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(client.responses.create(model=DENSE, input="Say a lot.", max_output_tokens=3,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 3 and final.output[0].status == "incomplete"
    assert events[-2].type == "response.output_item.done"


def _submitted(server) -> int:
    stats = httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()
    return stats["models"][DENSE]["engine"]["submitted"]


def test_bad_input_is_400_naming_the_field_and_reaches_no_engine(client, server):
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather",
            "arguments": '{"city": "Oslo", "unit": "c"}'}
    cases = [
        (dict(input="x", previous_response_id="resp_123"), "previous_response_id"),
        (dict(input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]),  # nothing is stored here
         "input[0].content[0].image_url"),
        (dict(input=[{"role": "user", "content": "x"},
                     {"type": "function_call_output", "call_id": "nope", "output": "r"}]),
         "input[1].call_id"),
        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
        (dict(input=[call, {"type": "function_call_output", "call_id": "c1", "output": "r"}],
              tools=[{**WEATHER, "parameters": {"type": "object", "properties": "city"}}]),
         "tools[0].parameters.properties"),
        (dict(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
         "tool_choice.name"),
        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
        # Over the character bound: refused before any tokenizing.
        (dict(input="x " * 20000), "input"),
        # Under it but over the context once tokenized (the replica's check).
        (dict(input=" ".join(f"w{i}" for i in range(3000))), "input"),
        # A schema the grammar cannot compile (the replica's check).
        (dict(input="x", text={"format": {"type": "json_schema", "name": "bad",
                                          "schema": {"type": "nonsense"}}}),
         "text.format.schema"),
    ]
    before = _submitted(server)
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=DENSE, max_output_tokens=4, **kwargs)
        body = err.value.body
        assert body["param"] == param, (param, body)
        assert body["type"] == "invalid_request_error" and body["message"], body
        assert set(body) == {"message", "type", "param", "code"}
    assert _submitted(server) == before
    with pytest.raises(openai.BadRequestError) as err:  # and the streamed form, before the 200
        client.responses.create(model=DENSE, input="x", previous_response_id="resp_1",
                                stream=True)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": DENSE, "input": "x",
                                                            "store": True, "max_output_tokens": 1},
                   timeout=60)
    assert r.status_code == 200 and r.json()["store"] is False  # served, not stored
