"""Tools, Anthropic Messages, logprobs and structured output through ``serve run``.

The real ``openai`` and ``anthropic`` clients over HTTP against the session's server.
The embedded models have random weights: tool calls and JSON come out right because
the grammar forces them (``tool_choice`` required or named, ``response_format``).
"""

from __future__ import annotations

import json
import math

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.support.clients import anthropic_client, openai_client
from tests.support.servers import DENSE, HYBRID

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["color", "count", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic_client(server)


def ask(content: str) -> list[dict]:
    return [{"role": "system", "content": "You are a tool-using agent. " * 4},
            {"role": "user", "content": content}]


# ---- OpenAI tool calling --------------------------------------------------------------


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_a_forced_tool_call_round_trip(client, model):
    messages = ask("What is the weather in Oslo?")
    r = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    # The result goes back as a tool message; the conversation's prefix is reused.
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"}]
    r2 = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                        temperature=0, max_tokens=8)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= 16


def test_required_tool_calls_stream_in_openai_deltas(client):
    stream = client.chat.completions.create(
        model=HYBRID, messages=ask("Weather or time?"), tools=[WEATHER, TIME],
        tool_choice="required", temperature=0, max_tokens=300, stream=True,
        parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for entry in calls.values():
        assert entry["id"] and entry["name"] in tools
        jsonschema.validate(json.loads(entry["arguments"]), tools[entry["name"]])


def test_tools_render_in_a_canonical_order(client):
    """The same tools with their keys in another order are the same prompt (a cache hit)."""
    shuffled = json.loads(json.dumps(WEATHER), object_pairs_hook=lambda p: dict(reversed(p)))
    assert list(shuffled["function"]) != list(WEATHER["function"])
    one = client.chat.completions.create(model=DENSE, messages=ask("Canonical?"),
                                         tools=[WEATHER], max_tokens=1, temperature=0)
    two = client.chat.completions.create(model=DENSE, messages=ask("Canonical?"),
                                         tools=[shuffled], max_tokens=1, temperature=0)
    assert one.usage.prompt_tokens == two.usage.prompt_tokens
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 16


# ---- structured output --------------------------------------------------------------


@pytest.mark.parametrize("model", [HYBRID, DENSE])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, model, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA,
                                                 "strict": True}}
    kwargs = dict(model=model, messages=ask("Pick a color."), response_format=rf,
                  max_tokens=120, temperature=0.9, seed=7)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kwargs, stream=True) if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


# ---- logprobs ---------------------------------------------------------------------------


def test_chat_logprobs_are_the_samplers(client):
    r = client.chat.completions.create(model=HYBRID, messages=ask("Logprobs?"), max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.bytes and all(0 <= b < 256 for b in entry.bytes)  # the token's own bytes
        assert len(entry.top_logprobs) == 5
        top = entry.top_logprobs
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(top[0].logprob)
        assert entry.token == top[0].token  # greedy: the most likely token
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert sum(math.exp(t.logprob) for t in top) <= 1 + 1e-4
    # Streamed, the same tokens and the same numbers.
    streamed = [e for c in client.chat.completions.create(
        model=HYBRID, messages=ask("Logprobs?"), max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=5, stream=True) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs(client):
    r = client.completions.create(model=DENSE, prompt="Once upon a time", max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # A dict by token text: two byte tokens that both decode to U+FFFD share a key
        # (the later one's value wins), so the chosen (greedy) token's is at least as high.
        assert 1 <= len(top) <= 3 and logprob >= max(top.values()) - 1e-6


# ---- Anthropic Messages ------------------------------------------------------------------


def test_anthropic_messages_text_and_stream(claude):
    kwargs = dict(model=HYBRID, max_tokens=8, system="You answer briefly. " * 3,
                  messages=[{"role": "user", "content": "Hello there"}],
                  extra_body={"temperature": 0})
    message = claude.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens == 8 or message.stop_reason == "end_turn"
    with claude.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(events)
    assert final.content[0].text == message.content[0].text  # temperature 0
    # The second time the prompt is read from the cache, and says so.
    assert final.usage.cache_read_input_tokens > 0
    counted = claude.messages.count_tokens(model=HYBRID, system=kwargs["system"],
                                           messages=kwargs["messages"])
    assert counted.input_tokens == (final.usage.input_tokens
                                    + final.usage.cache_read_input_tokens)


def test_anthropic_tool_use_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    with claude.messages.stream(model=DENSE, max_tokens=200, tools=tools, messages=messages,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [e.type for e in s]
        message = s.get_final_message()
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, tools[0]["input_schema"])
    assert "content_block_delta" in kinds
    messages += [{"role": "assistant", "content": message.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "12 degrees"}]}]
    reply = claude.messages.create(model=DENSE, max_tokens=6, tools=tools, messages=messages)
    assert reply.usage.cache_read_input_tokens > 0


# ---- bad input: a clear 400 in each API's shape --------------------------------------------


def test_bad_tool_and_schema_requests_are_refused(server, client, claude):
    import openai as openai_module

    with pytest.raises(openai_module.BadRequestError) as err:
        client.chat.completions.create(model=DENSE, messages=ask("x"), tools=[WEATHER],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert "nope" in str(err.value) and err.value.body["param"] == "tool_choice"
    with pytest.raises(openai_module.BadRequestError) as err:
        client.chat.completions.create(
            model=DENSE, messages=ask("x"),
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert err.value.body["param"].startswith("response_format")
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model=DENSE, max_tokens=4, messages=ask("x")[1:],
                               tools=[{"name": "a", "input_schema": {"type": "object"}}],
                               tool_choice={"type": "tool", "name": "zzz"})
    assert "zzz" in str(aerr.value)
    r = httpx.post(f"{server.base_url}/v1/messages", json={"model": DENSE, "messages": []},
                   timeout=30)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/v1/messages", timeout=30,
                   json={"model": "nope", "max_tokens": 1,
                         "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
