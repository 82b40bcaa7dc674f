"""A thinking model through ``serve run`` on all three APIs, with the real ``openai`` and
``anthropic`` clients (issue 41).

``tiny-hybrid-mtp`` has Qwen3.5's template: its generation prompt opens the thought, so
its random-weight output is all thought until the profile's budget (8 tokens) closes it
with the model's own end marker; the answer follows. At temperature 0 one prompt is one
generation, so the chat completion, the Anthropic message (thinking enabled with the same
budget) and the Responses answer (no effort: the profile's budget) carry the same thought
and the same answer, streamed or not; without thinking (Anthropic's default) the model
renders with thinking off, as a chat request with ``enable_thinking: false`` does.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import anthropic
import openai
import pytest

from tests.support.clients import anthropic_client, openai_client
from tests.support.servers import serving

THINKER = "tiny-hybrid-mtp"
BUDGET = 8
MAX_TOKENS = 24
PROMPT = "Think, then answer."
GREEDY = {"temperature": 0}  # the anthropic SDK's create() takes no temperature any more
MODELS = [{"name": THINKER, "source": f"embedded:{THINKER}", "context_length": 2048,
           "max_batch_size": 4, "max_tokens": 256, "cache": {"block_size": 16},
           "reasoning": {"budget_tokens": BUDGET}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home):
    with serving(tmp_path_factory.mktemp("thinking"), MODELS, model_home) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic_client(server)


def user(content: str = PROMPT) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def chat(client) -> dict[str, Any]:
    """The chat completion of ``PROMPT``: thought, answer and usage (the reference)."""
    r = client.chat.completions.create(model=THINKER, messages=user(), max_tokens=MAX_TOKENS,
                                       temperature=0)
    message = r.choices[0].message
    return {"thought": getattr(message, "reasoning_content", None),
            "text": message.content or "", "usage": r.usage}


def test_chat_streamed_and_not_agree_and_the_budget_closes_the_thought(client, chat):
    assert chat["thought"], "the template opens the thought: the output starts in it"
    assert chat["usage"].completion_tokens_details.reasoning_tokens == BUDGET + 1  # + marker
    assert chat["usage"].completion_tokens <= MAX_TOKENS
    assert "<think>" not in chat["text"] and "</think>" not in chat["text"]
    assert "</think>" not in chat["thought"]
    thought, text, usage = [], [], None
    for chunk in client.chat.completions.create(
            model=THINKER, messages=user(), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            thought.append(getattr(choice.delta, "reasoning_content", None) or "")
            text.append(choice.delta.content or "")
    assert "".join(thought) == chat["thought"] and "".join(text) == chat["text"]
    assert usage is not None and usage.completion_tokens == chat["usage"].completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == BUDGET + 1


def blocks_of(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_anthropic_thinking_block_then_text_as_the_chat_answer(claude, chat):
    ask = {"model": THINKER, "max_tokens": MAX_TOKENS, "extra_body": GREEDY, "messages": user(),
           "thinking": {"type": "enabled", "budget_tokens": BUDGET}}
    message = claude.messages.create(**ask)
    expected = [("thinking", chat["thought"])] + ([("text", chat["text"])] if chat["text"]
                                                  else [])
    assert blocks_of(message) == expected
    assert message.content[0].signature
    assert message.usage.output_tokens == chat["usage"].completion_tokens
    with claude.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert blocks_of(streamed) == expected
    assert streamed.content[0].signature == message.content[0].signature
    assert streamed.usage.output_tokens == message.usage.output_tokens


def test_anthropic_history_thinking_verifies_and_a_tampered_block_is_400(claude):
    ask = {"model": THINKER, "max_tokens": MAX_TOKENS, "extra_body": GREEDY,
           "thinking": {"type": "enabled", "budget_tokens": BUDGET}}
    first = claude.messages.create(messages=user(), **ask)
    turn = [b.model_dump(exclude_none=True) for b in first.content]
    if len(turn) == 1:  # the answer was empty: the history still needs a text block
        turn.append({"type": "text", "text": "ok"})
    again = claude.messages.create(
        messages=[*user(), {"role": "assistant", "content": turn}, *user("And then?")], **ask)
    assert again.content[0].type == "thinking"
    tampered = copy.deepcopy(turn)
    tampered[0]["thinking"] += " (edited)"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            messages=[*user(), {"role": "assistant", "content": tampered}, *user("And then?")],
            **ask)
    assert err.value.status_code == 400
    assert "messages.1.content.0.signature" in str(err.value)


def test_anthropic_without_thinking_answers_with_thinking_off(claude, client):
    message = claude.messages.create(model=THINKER, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                     messages=user())
    assert all(b.type == "text" for b in message.content)
    off = client.chat.completions.create(
        model=THINKER, messages=user(), max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert "".join(b.text for b in message.content) == (off.choices[0].message.content or "")
    assert message.usage.output_tokens == off.usage.completion_tokens


def reasoning_and_text(response) -> tuple[str, str]:
    kinds = [o.type for o in response.output]
    assert kinds[0] == "reasoning" and set(kinds[1:]) <= {"message"}, kinds
    return "".join(c.text for c in response.output[0].content), response.output_text


def test_responses_reasoning_item_then_message_streamed_as_not(client, chat):
    ask = {"model": THINKER, "input": PROMPT, "max_output_tokens": MAX_TOKENS,
           "temperature": 0}
    r = client.responses.create(**ask)
    assert reasoning_and_text(r) == (chat["thought"], chat["text"])
    assert r.output[0].id.startswith("rs_") and r.output[0].encrypted_content is None
    assert r.usage.output_tokens_details.reasoning_tokens == BUDGET + 1
    assert r.usage.output_tokens == chat["usage"].completion_tokens
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    # Cut by max_output_tokens the stream ends with response.incomplete (the SDK's
    # get_final_response wants response.completed): its response is the final one.
    assert kinds[-1] == ("response.incomplete" if r.status == "incomplete"
                         else "response.completed")
    streamed = events[-1].response
    assert reasoning_and_text(streamed) == (chat["thought"], chat["text"])
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta"
                                                                     if chat["text"] else
                                                                     "response.completed")
    assert streamed.usage.output_tokens_details.reasoning_tokens == BUDGET + 1


def test_responses_encrypted_reasoning_sent_back_verifies_and_a_forged_one_is_400(client):
    ask = {"model": THINKER, "max_output_tokens": MAX_TOKENS, "temperature": 0,
           "include": ["reasoning.encrypted_content"]}
    first = client.responses.create(input=user(), **ask)
    assert first.output[0].encrypted_content
    history = [*user(), *(o.model_dump(exclude_none=True) for o in first.output)]
    again = client.responses.create(input=[*history, *user("And then?")], **ask)
    assert again.output[0].type == "reasoning"
    forged = copy.deepcopy(history)
    sealed = json.loads(base64.urlsafe_b64decode(forged[1]["encrypted_content"] + "=="))
    sealed["text"] += " (edited)"  # a well-formed content whose signature cannot match
    forged[1]["encrypted_content"] = base64.urlsafe_b64encode(
        json.dumps(sealed).encode()).decode()
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input=[*forged, *user("And then?")], **ask)
    assert "input[1].encrypted_content" in str(err.value)
    none = client.responses.create(input=user(), reasoning={"effort": "none"}, **ask)
    assert [o.type for o in none.output] in ([], ["message"])
    assert none.usage.output_tokens_details.reasoning_tokens == 0
