"""A thinking model's output through the model service: thought and answer apart, the
budget closing the thought with the model's own marker, the answer's grammar after it,
thinking off by the template. The oracle is plain greedy generation of the same prompt
(and of the prompt continued by the thought and its marker)."""

from __future__ import annotations

import asyncio
import json

import mlx_lm
import pytest

from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.events import Delta, Finish, Reasoning
from serve_app.serving.request import ChatCompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import generated

THINKER = "tiny-hybrid-mtp"  # Qwen3.5's template: the generation prompt opens the thought
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def thinker(home):
    path = materialize(THINKER, home)
    model, tokenizer = mlx_lm.load(str(path))
    services: list[ModelService] = []

    def service(**profile) -> ModelService:
        services.append(ModelService(
            ModelProfile(name="m", source=f"embedded:{THINKER}", cache={"enabled": False},
                         **profile), model, tokenizer, path, None))
        return services[-1]

    yield service, tokenizer
    for s in services:
        s.shutdown()


def answer(service: ModelService, request: ChatCompletionRequest) -> dict:
    async def go():
        prepared = service.prepare(request)
        thought, text, finish = [], [], None
        async for events in service.stream(prepared):
            for e in events:
                if isinstance(e, Reasoning):
                    thought.append(e.text)
                elif isinstance(e, Delta):
                    text.append(e.text)
                elif isinstance(e, Finish):
                    finish = e
        return {"thought": "".join(thought), "text": "".join(text), "finish": finish,
                "prompt": prepared.prompt, "thinking": prepared.thinking}

    return asyncio.run(go())


def request(n: int = 24, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=n, temperature=0,
                                 **extra)


def test_the_budget_ends_the_thought_and_the_answer_is_the_continuation(thinker):
    service_of, tokenizer = thinker
    service = service_of(reasoning={"budget_tokens": 6})
    got = answer(service, request(24))
    end = tokenizer.think_end_id
    assert got["thinking"].in_thought and got["prompt"][-2] == tokenizer.think_start_id
    plain = service_of()
    thought = generated(plain, got["prompt"], 6)
    assert end not in thought  # the model did not close it by itself: the budget did
    rest = generated(plain, got["prompt"] + thought + [end], 24 - 7)
    eos = service.eos_ids
    assert got["thought"] == tokenizer.decode(thought).strip("\n")
    assert got["text"] == tokenizer.decode([t for t in rest if t not in eos]).lstrip("\n")
    finish = got["finish"]
    assert finish.reasoning_tokens == 7  # six of thought and the closing marker
    assert finish.completion_tokens == 7 + len(rest)
    assert "<think>" not in got["text"] and "</think>" not in got["text"]


def test_an_effort_is_the_profiles_budget_and_a_request_budget_wins(thinker):
    service_of, _ = thinker
    service = service_of(reasoning={"effort_budgets": {"low": 3, "high": 9}})
    assert answer(service, request(20, reasoning_effort="low"))["finish"].reasoning_tokens == 4
    assert answer(service, request(20, reasoning_effort="high"))["finish"].reasoning_tokens == 10
    req = request(20, reasoning_effort="high")
    req._thinking_budget = 2
    assert answer(service, req)["finish"].reasoning_tokens == 3


def test_without_a_budget_a_thought_never_closed_is_all_thought(thinker):
    service_of, tokenizer = thinker
    service = service_of()
    got = answer(service, request(12))
    tokens = generated(service, got["prompt"], 12)
    assert tokenizer.think_end_id not in tokens
    assert got["text"] == "" and got["finish"].reasoning_tokens == 12
    assert got["thought"] == tokenizer.decode(
        [t for t in tokens if t not in service.eos_ids]).strip("\n")


def test_thinking_off_renders_a_closed_thought_and_answers_plainly(thinker):
    service_of, tokenizer = thinker
    service = service_of()
    for req in (request(10, chat_template_kwargs={"enable_thinking": False}),
                request(10, reasoning_effort="none")):
        got = answer(service, req)
        assert not got["thinking"].in_thought
        assert got["prompt"][-4:-2] == [tokenizer.think_start_id, tokenizer.think_end_id] or \
            tokenizer.think_end_id in got["prompt"][-6:]
        tokens = generated(service, got["prompt"], 10)
        assert got["thought"] == "" and got["finish"].reasoning_tokens == 0
        assert got["text"] == tokenizer.decode([t for t in tokens if t not in service.eos_ids])


def test_a_json_answer_follows_a_free_thought(thinker):
    service_of, tokenizer = thinker
    service = service_of(reasoning={"budget_tokens": 5})
    schema = {"type": "object", "properties": {"pick": {"enum": ["tea", "coffee"]}},
              "required": ["pick"], "additionalProperties": False}
    got = answer(service, request(60, response_format={
        "type": "json_schema", "json_schema": {"name": "choice", "schema": schema}}))
    assert got["finish"].reasoning_tokens == 6 and got["finish"].finish_reason == "stop"
    # the thought is the model's free greedy text, not JSON the grammar forced
    free = generated(service_of(), got["prompt"], 5)
    assert got["thought"] == tokenizer.decode(free).strip("\n")
    assert json.loads(got["text"])["pick"] in ("tea", "coffee")


def test_a_model_whose_template_does_not_open_the_thought_answers_as_before(home):
    path = materialize("tiny-hybrid", home)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-hybrid",
                                        cache={"enabled": False}), model, tokenizer, path, None)
    try:
        got = answer(service, request(16))
        assert got["thinking"] is not None and not got["thinking"].in_thought
        tokens = generated(service, got["prompt"], 16)
        assert tokens[0] != tokenizer.think_start_id
        assert got["thought"] == "" and got["finish"].reasoning_tokens == 0
        assert got["text"] == tokenizer.decode([t for t in tokens if t not in service.eos_ids])
    finally:
        service.shutdown()
