"""A thinking model's thought on the Anthropic Messages and Responses APIs (issue 41).

No model and no server: typed replica events are fed to each API's stream, whose events
and non-streamed bodies the real SDKs must parse (a ``thinking`` block then the text; a
``reasoning`` item then the message); requests are translated into the chat request
(budget, effort, thinking off) and thoughts sent back in history are verified with the
server's signature (a forged or altered one is a 400 naming it).
"""

from __future__ import annotations

import base64
import json
import stat
from typing import Any

import anthropic
import anthropic._base_client as anthropic_base
import openai
import openai._base_client as openai_base
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from serve_app.api.anthropic_api import MessageStream, message_collector
from serve_app.api.anthropic_request import parse_messages_request, to_chat_input
from serve_app.api.http import chat_request
from serve_app.api.responses_api import ResponseStream, accumulate, response_collector
from serve_app.api.responses_request import parse_request, signed_thoughts, to_chat_request
from serve_app.api.sse import sse_event
from serve_app.api.thinking_signature import (
    KEY_ENV,
    KEY_FILE,
    SignedThought,
    ThoughtSigner,
    load_key,
    opened,
    signed_block,
)
from serve_app.serving.events import Delta, Event, Finish, Reasoning, Start
from serve_app.serving.request import ApiError

MODEL = "tiny-hybrid-mtp"
SIGNER = ThoughtSigner(b"unit-test-key")
A_HTTP = getattr(anthropic_base, "httpx2", None) or anthropic_base.httpx
O_HTTP = getattr(openai_base, "httpx2", None) or openai_base.httpx
ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)


def generation(thought: tuple[str, ...] = ("Let me ", "think."), answer: tuple[str, ...] = (
        "Hi", " there"), reason: str = "stop", reasoning_tokens: int = 5) -> list[Event]:
    """A thinking model's events: start, the thought, the answer, finish."""
    return [Start(30, 16), *(Reasoning(t) for t in thought), *(Delta(t) for t in answer),
            Finish(reason, 30, 12, 16, 0.1, reasoning_tokens=reasoning_tokens)]


# ---- signatures ---------------------------------------------------------------------------


def test_a_signature_verifies_its_thought_only_with_its_key():
    signature = SIGNER.signature(MODEL, "a thought")
    SIGNER.verify(signed_block("p", "a thought", signature))
    for text, signer in (("a thought!", SIGNER), ("a thought", ThoughtSigner(b"other"))):
        with pytest.raises(ApiError) as err:
            signer.verify(signed_block("messages.1.content.0.signature", text, signature))
        assert err.value.status == 400 and err.value.param == "messages.1.content.0.signature"
        assert err.value.message.startswith("messages.1.content.0.signature: ")


def test_a_signature_names_its_model_and_verifies_for_any_model_served():
    thought = signed_block("p", "t", SIGNER.signature("other-model", "t"))
    assert thought.model == "other-model"
    SIGNER.verify(thought)
    with pytest.raises(ApiError):  # the model is signed too
        SIGNER.verify(SignedThought("p", "t", MODEL, thought.mac))


def test_encrypted_content_carries_the_thought_and_verifies():
    blob = SIGNER.encrypted_content(MODEL, "deep thought")
    thought = opened("input[1].encrypted_content", blob)
    assert thought.text == "deep thought"
    SIGNER.verify(thought)
    with pytest.raises(ApiError):
        ThoughtSigner(b"other").verify(thought)


@pytest.mark.parametrize("value", ["", "xyz", "sig", "e30", "!!!"])
def test_what_is_not_our_signature_is_a_400_naming_the_field(value):
    for read in (lambda: signed_block("x.signature", "t", value),
                 lambda: opened("x.signature", value)):
        with pytest.raises(ApiError) as err:
            read()
        assert err.value.status == 400 and err.value.param == "x.signature"


def test_the_key_comes_from_the_environment_else_from_a_key_file_made_once(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert load_key(tmp_path) == b"from-env"
    monkeypatch.delenv(KEY_ENV)
    key = load_key(tmp_path)
    path = tmp_path / KEY_FILE
    assert len(key) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(tmp_path) == key  # a restart keeps verifying
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]


# ---- Anthropic: the request --------------------------------------------------------------


def anthropic_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
            **extra}


def test_thinking_enabled_sets_the_budget_and_leaves_thinking_on():
    chat = to_chat_input(parse_messages_request(anthropic_body(
        thinking={"type": "enabled", "budget_tokens": 8})))
    assert chat.thinking and chat.thinking_budget == 8
    request = chat_request(chat, MODEL, False)
    assert request._thinking_budget == 8 and request.template_kwargs() == {}


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
def test_without_thinking_the_model_renders_with_thinking_off(thinking):
    extra = {} if thinking is None else {"thinking": thinking}
    chat = to_chat_input(parse_messages_request(anthropic_body(**extra)))
    assert not chat.thinking
    request = chat_request(chat, MODEL, False)
    assert request._thinking_budget is None
    assert request.template_kwargs() == {"enable_thinking": False}


def test_adaptive_thinking_thinks_within_the_profiles_budget():
    chat = to_chat_input(parse_messages_request(anthropic_body(thinking={"type": "adaptive"})))
    assert chat.thinking and chat.thinking_budget is None


@pytest.mark.parametrize("thinking, words", [
    ({"type": "enabled", "budget_tokens": 64}, "less than max_tokens"),
    ({"type": "enabled", "budget_tokens": 100}, "less than max_tokens"),
    ({"type": "enabled", "budget_tokens": "8"}, "valid integer"),
    ({"type": "enabled", "budget_tokens": 0}, "greater than or equal to 1"),
    ({"type": "enabled", "budget_tokens": 1.5}, "valid integer"),
    ({"type": "enabled"}, "required"),
])
def test_a_bad_budget_is_a_400_naming_thinking_budget_tokens(thinking, words):
    with pytest.raises(ApiError) as err:
        parse_messages_request(anthropic_body(thinking=thinking))
    assert err.value.status == 400 and err.value.param == "thinking.budget_tokens"
    assert err.value.message.startswith("thinking.budget_tokens: ")
    assert words in err.value.message, err.value.message


def history(thinking: str, signature: str) -> list[dict]:
    return [{"role": "user", "content": "Pick A or B"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": thinking, "signature": signature},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "A."}]},
            {"role": "user", "content": "Why?"}]


def test_a_thinking_block_sent_back_is_the_assistant_messages_reasoning_content():
    signature = SIGNER.signature(MODEL, "Weighing A.")
    chat = to_chat_input(parse_messages_request(anthropic_body(
        messages=history("Weighing A.", signature))))
    assert chat.template_messages()[1] == {"role": "assistant", "content": "A.",
                                           "reasoning_content": "Weighing A."}
    (thought,) = chat.thoughts
    assert thought.param == "messages.1.content.0.signature"
    SIGNER.verify(thought)
    assert chat_request(chat, MODEL, False).messages[1].reasoning_content == "Weighing A."


def test_an_altered_or_forged_thinking_block_is_refused():
    signature = SIGNER.signature(MODEL, "Weighing A.")
    chat = to_chat_input(parse_messages_request(anthropic_body(
        messages=history("Weighing B.", signature))))
    with pytest.raises(ApiError) as err:
        SIGNER.verify(chat.thoughts[0])
    assert err.value.param == "messages.1.content.0.signature"
    with pytest.raises(ApiError) as err:
        parse_messages_request(anthropic_body(messages=history("Weighing A.", "forged")))
    assert err.value.status == 400 and err.value.param == "messages.1.content.0.signature"


# ---- Anthropic: the answer ---------------------------------------------------------------


def message_events(events: list[Event], signer: ThoughtSigner | None = SIGNER) -> list[dict]:
    stream = MessageStream(MODEL, "msg_test", signer=signer)
    out = [e for event in events for e in stream.feed(event)]
    assert stream.done
    return out


def message(events: list[Event], signer: ThoughtSigner | None = SIGNER) -> dict:
    collector = message_collector(MODEL, "msg_test", signer=signer)
    for event in events:
        collector.feed(event)
    return collector.response()


def test_the_thought_streams_as_a_signed_thinking_block_before_the_text():
    events = message_events(generation())
    for e in events:
        ANTHROPIC_EVENT.validate_python(e)
    shape = [(e["type"], e.get("delta", e.get("content_block", {})).get("type"))
             for e in events]
    assert shape == [
        ("message_start", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"),
        ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None)]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [e["index"] for e in events[1:6]] == [0] * 5
    assert [e["index"] for e in events[6:10]] == [1] * 4


def test_the_non_streamed_message_has_the_thinking_block_with_a_verifying_signature():
    body = message(generation())
    parsed = Message.model_validate(body)
    thinking, text = parsed.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think."
    assert text.type == "text" and text.text == "Hi there"
    SIGNER.verify(signed_block("p", thinking.thinking, thinking.signature))
    assert body["usage"]["output_tokens"] == 12  # the thought's tokens counted in


def test_without_thinking_asked_a_thought_is_dropped():
    body = message(generation(), signer=None)
    assert [b["type"] for b in body["content"]] == ["text"]
    assert all(e.get("delta", {}).get("type") != "thinking_delta"
               for e in message_events(generation(), signer=None))


def test_a_thought_cut_by_the_token_limit_is_closed_and_signed():
    events = message_events(generation(answer=(), reason="length"))
    assert [e["type"] for e in events][-4:] == ["content_block_delta", "content_block_stop",
                                                "message_delta", "message_stop"]
    body = Message.model_validate(message(generation(answer=(), reason="length")))
    (thinking,) = body.content
    assert body.stop_reason == "max_tokens"
    SIGNER.verify(signed_block("p", thinking.thinking, thinking.signature))


def test_the_sdk_accumulates_the_stream_to_the_non_streamed_message():
    events = message_events(generation())

    def handler(request):
        body = b"".join(sse_event(e) for e in events)
        return A_HTTP.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                                 http_client=A_HTTP.Client(transport=A_HTTP.MockTransport(
                                     handler)))
    with client.messages.stream(**anthropic_body(thinking={
            "type": "enabled", "budget_tokens": 8})) as s:
        final = s.get_final_message()
    expected = Message.model_validate(message(generation()))
    assert final.model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)


# ---- Responses: the request --------------------------------------------------------------


def responses_request(**extra: Any):
    return parse_request({"model": MODEL, "input": "hello", **extra})


@pytest.mark.parametrize("effort, expected", [
    ("low", "low"), ("medium", "medium"), ("high", "high"), ("minimal", "minimal"),
    ("xhigh", "high"), ("none", "none"), (None, None)])
def test_reasoning_effort_reaches_the_chat_request(effort, expected):
    chat = to_chat_request(responses_request(reasoning={"effort": effort, "summary": "auto"}))
    assert chat.reasoning_effort == expected
    off = {"enable_thinking": False} if effort == "none" else {}
    assert chat.template_kwargs() == off


def items_with(reasoning: dict) -> list[dict]:
    return [{"role": "user", "content": "Pick A or B"}, reasoning,
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "A."}]},
            {"role": "user", "content": "Why?"}]


def reasoning_item(**fields: Any) -> dict:
    return {"type": "reasoning", "id": "rs_1", "summary": [], **fields}


@pytest.mark.parametrize("item", [
    reasoning_item(content=[{"type": "reasoning_text", "text": "Weighing A."}]),
    reasoning_item(encrypted_content=SIGNER.encrypted_content(MODEL, "Weighing A.")),
    reasoning_item(content=[{"type": "reasoning_text", "text": "ignored"}],
                   encrypted_content=SIGNER.encrypted_content(MODEL, "Weighing A.")),
])
def test_a_reasoning_item_is_the_next_assistant_messages_reasoning_content(item):
    request = responses_request(input=items_with(item))
    for thought in signed_thoughts(request):
        SIGNER.verify(thought)
    messages = to_chat_request(request).messages
    assert messages[1].role == "assistant" and messages[1].reasoning_content == "Weighing A."
    assert messages[0].reasoning_content is None and messages[2].reasoning_content is None


def test_a_reasoning_item_before_a_function_call_is_that_turns_thought():
    request = responses_request(input=[
        {"role": "user", "content": "Weather?"},
        reasoning_item(content=[{"type": "reasoning_text", "text": "Call it."}]),
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    messages = to_chat_request(request).messages
    assert messages[1].tool_calls and messages[1].reasoning_content == "Call it."


def test_a_forged_encrypted_content_is_refused():
    blob = SIGNER.encrypted_content(MODEL, "Weighing A.")
    fields = json.loads(base64.urlsafe_b64decode(blob + "=="))
    forged = dict(fields, text="Something else.")
    raw = base64.urlsafe_b64encode(json.dumps(forged).encode()).decode()
    request = responses_request(input=items_with(reasoning_item(encrypted_content=raw)))
    (thought,) = signed_thoughts(request)
    with pytest.raises(ApiError) as err:
        SIGNER.verify(thought)
    assert err.value.status == 400 and err.value.param == "input[1].encrypted_content"
    with pytest.raises(ApiError) as err:
        responses_request(input=items_with(reasoning_item(encrypted_content="opaque")))
    assert err.value.param == "input[1].encrypted_content"


# ---- Responses: the answer ---------------------------------------------------------------


def response_events(events: list[Event], **extra: Any) -> list[dict]:
    stream = ResponseStream(responses_request(**extra), "resp_test", created_at=1.0,
                            signer=SIGNER)
    out = [e for event in events for e in stream.feed(event)]
    assert stream.done
    return out


def response(events: list[Event], **extra: Any) -> dict:
    collector = response_collector(responses_request(**extra), "resp_test", signer=SIGNER)
    for event in events:
        collector.feed(event)
    return collector.response()


def test_the_thought_streams_as_a_reasoning_item_before_the_message():
    events = response_events(generation())
    for e in events:
        RESPONSES_EVENT.validate_python(e)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    added, delta = events[2], events[3]
    assert added["item"]["type"] == "reasoning" and added["item"]["id"].startswith("rs_")
    assert delta == {"type": "response.reasoning_text.delta", "sequence_number": 3,
                     "item_id": added["item"]["id"], "output_index": 0, "content_index": 0,
                     "delta": "Let me "}
    assert events[5]["text"] == "Let me think."
    assert events[7]["output_index"] == 1 and events[7]["item"]["type"] == "message"


def test_the_non_streamed_response_has_the_reasoning_item_and_its_token_count():
    body = response(generation())
    parsed = Response.model_validate(body)
    reasoning, answer = parsed.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Let me think.")]
    assert reasoning.encrypted_content is None
    assert parsed.output_text == "Hi there"
    assert parsed.usage.output_tokens_details.reasoning_tokens == 5


def test_encrypted_content_when_include_asks_and_it_verifies():
    body = response(generation(), include=["reasoning.encrypted_content"],
                    reasoning={"effort": "low", "summary": "auto"})
    reasoning = Response.model_validate(body).output[0]
    assert body["reasoning"] == {"effort": "low", "summary": "auto"}
    thought = opened("x", reasoning.encrypted_content)
    assert thought.text == "Let me think." and thought.model == MODEL
    SIGNER.verify(thought)


def test_a_thought_cut_by_the_token_limit_is_an_incomplete_reasoning_item():
    body = Response.model_validate(response(generation(answer=(), reason="length")))
    (reasoning,) = body.output
    assert body.status == "incomplete" and reasoning.status == "incomplete"


def test_the_sdk_accumulates_the_stream_to_the_non_streamed_response():
    events = response_events(generation())

    def handler(req):
        body = b"".join(sse_event(e) for e in events)
        return O_HTTP.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                           http_client=O_HTTP.Client(transport=O_HTTP.MockTransport(handler)))
    with client.responses.stream(model=MODEL, input="hello") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds == [e["type"] for e in events]
    expected = Response.model_validate(accumulate(events)).model_dump(exclude_none=True)
    assert final.model_dump(exclude_none=True) == expected
    assert accumulate(events) == events[-1]["response"]
