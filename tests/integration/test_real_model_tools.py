"""Tool calling on a real model whose own chat template has none: SmolLM2-135M-Instruct.

The embedded ``smollm2-135m`` brings ``chat_template: smollm2-tools`` and ``tool_call_format:
json_tools`` by default (its GGUF's template defines no tool calls), so the profile here sets
neither. One server, the real ``openai`` and ``anthropic`` clients, every agent API: OpenAI
chat (forced by name, "required", "auto"), Anthropic ``tool_use``, Responses
``function_call``, and a forced call cut by the token limit in each (streamed and not).
``<tool_call>`` is five ordinary tokens in SmolLM2's vocabulary, not one special token.

The model decodes ~10 tokens a second here: one short tool, one conversation whose prompt
(~200 tokens, mostly the tool section of the system prompt) the prefix cache keeps, and
small ``max_tokens``. Greedy: the profile's default temperature is 0 (this Anthropic SDK
takes none).
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from serve_app.config.chat_templates import SMOLLM2_SYSTEM
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.tools import tool_support
from tests.support.clients import anthropic_client, openai_client
from tests.support.servers import serving

MODEL = "smollm2-135m"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
DESCRIPTION = "Get the current weather in a city"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                            "parameters": PARAMETERS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CUT_AT = 20  # tokens: inside the arguments (the call takes ~30, its start marker five)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home):
    materialize(MODEL, model_home)  # before the clock of wait_ready starts
    tmp = tmp_path_factory.mktemp("real_tools")
    models = [{"name": MODEL, "source": f"embedded:{MODEL}", "context_length": 2048,
               "max_tokens": 256, "cache": {"block_size": 16}}]
    with serving(tmp, models, model_home, timeout=300,
                 cache_store={"ssd_dir": str(tmp / "kv")}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server, timeout=180)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic_client(server, timeout=180)


def test_the_template_renders_plain_chats_as_smollm2s_own(model_home):
    """Without tools the builtin template renders exactly as SmolLM2's own (its default
    system prompt included), so plain chats are served as before; with tools the system
    prompt gains the tool section, and the markers are several ordinary tokens."""
    from mlx_lm.utils import load_tokenizer

    path = materialize(MODEL, model_home)
    own = load_tokenizer(path)
    served = load_tokenizer(path, ModelProfile(name="s", source=f"embedded:{MODEL}")
                            .tokenizer_config())
    assert not own.has_tool_calling and tool_support(served).parser == "json_tools"
    chats = [ASK, [{"role": "system", "content": "Be brief."}, *ASK,
                   {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Ok"}]]
    for chat in chats:
        for generation in (True, False):
            assert served.apply_chat_template(chat, tokenize=False,
                                              add_generation_prompt=generation) == \
                own.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)
    text = served.apply_chat_template(ASK, tools=[WEATHER], tokenize=False,
                                      add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}\n\n# Tools\n")
    assert json.dumps(WEATHER) in text
    assert len(served.encode("<tool_call>", add_special_tokens=False)) == 5


def _weather_call(name: str, arguments: str) -> dict:
    assert name == "get_weather"
    value = json.loads(arguments)
    jsonschema.validate(value, PARAMETERS)
    return value


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
def test_a_forced_call_parses_and_its_result_goes_back(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice=NAMED, temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id and _weather_call(call.function.name, call.function.arguments)
    assert not choice.message.content  # no markup left as text
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                        tool_choice="none", temperature=0, max_tokens=12)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 16


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
def test_required_streams_one_call(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=48, stream=True, parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish, text = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        text += delta.content or ""
        for d in delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and text == "" and len(calls) == 1
    _weather_call(calls[0]["name"], calls[0]["arguments"])


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
def test_auto_is_text_or_a_well_formed_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice="auto", temperature=0, max_tokens=16)
    choice = r.choices[0]
    assert "<tool_call>" not in (choice.message.content or "")
    if choice.message.tool_calls:
        for call in choice.message.tool_calls:
            _weather_call(call.function.name, call.function.arguments)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
def test_anthropic_tool_use(claude):
    tool = {"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}
    message = claude.messages.create(model=MODEL, max_tokens=48, messages=ASK, tools=[tool],
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    blocks = [b for b in message.content if b.type == "tool_use"]
    assert len(blocks) == 1 and blocks[0].name == "get_weather" and blocks[0].id
    jsonschema.validate(blocks[0].input, PARAMETERS)


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
def test_responses_function_call(client):
    tool = {"type": "function", "name": "get_weather", "description": DESCRIPTION,
            "parameters": PARAMETERS}
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=[tool], tool_choice="required", temperature=0,
                                max_output_tokens=48, parallel_tool_calls=False)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id and calls[0].status == "completed"
    _weather_call(calls[0].name, calls[0].arguments)


# ---- a forced call cut off by max_tokens ------------------------------------------------


def _cut_arguments(arguments: str) -> None:
    """Arguments as far as they got: the start of the call's JSON, never markup."""
    assert arguments.startswith('{"') and "<" not in arguments, arguments
    assert '{"city": "'.startswith(arguments[:10]) and not arguments.endswith("}"), arguments


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
@pytest.mark.parametrize("stream", [False, True])
def test_openai_cut_call_is_a_call_with_finish_reason_length(client, stream):
    kwargs = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED,
              "temperature": 0, "max_tokens": CUT_AT}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length" and not choice.message.content
        (call,) = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    else:
        finish, text, name, arguments = None, "", "", ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            text += delta.content or ""
            for d in delta.tool_calls or ():
                name += d.function.name or ""
                arguments += d.function.arguments or ""
        assert finish == "length" and text == ""
    assert name == "get_weather"
    _cut_arguments(arguments)


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_cut_call_is_a_tool_use_with_stop_reason_max_tokens(claude, stream):
    tool = {"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}
    kwargs = {"model": MODEL, "max_tokens": CUT_AT, "messages": ASK, "tools": [tool],
              "tool_choice": {"type": "tool", "name": "get_weather"}}
    if stream:
        with claude.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather"
    assert isinstance(message.content[0].input, dict)
    assert set(message.content[0].input) <= {"city"}


@pytest.mark.slow  # served by the real embedded model, SmolLM2-135M
@pytest.mark.parametrize("stream", [False, True])
def test_responses_cut_call_is_an_incomplete_function_call(client, stream):
    tool = {"type": "function", "name": "get_weather", "description": DESCRIPTION,
            "parameters": PARAMETERS}
    kwargs = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [tool],
              "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0,
              "max_output_tokens": CUT_AT}
    if stream:  # the SDK's stream helper wants response.completed: the events, then
        events = list(client.responses.create(**kwargs, stream=True))
        assert [e.type for e in events if e.type.startswith("response.function_call")] == [
            "response.function_call_arguments.delta", "response.function_call_arguments.done"]
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = client.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (call,) = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather",
                                                   "incomplete")
    _cut_arguments(call.arguments)
