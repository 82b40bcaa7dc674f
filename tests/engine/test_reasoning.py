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


async def served(service: ModelService, prepared) -> dict:
    """One prepared request to its end: its thought, its answer text, its ``Finish``."""
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


def answer(service: ModelService, request: ChatCompletionRequest) -> dict:
    return asyncio.run(served(service, service.prepare(request)))


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


def cached_thinker(home, **profile) -> ModelService:
    from serve_app.cache.client import LocalCacheClient
    from serve_app.cache.tiers import TieredStore

    path = materialize(THINKER, home)
    model, tokenizer = mlx_lm.load(str(path))
    return ModelService(ModelProfile(name="m", source=f"embedded:{THINKER}",
                                     cache={"block_size": 16}, **profile),
                        model, tokenizer, path, LocalCacheClient(TieredStore(1 << 30)))


def conversation(service: ModelService, turns: int, ahead: bool) -> list[dict]:
    """``turns`` turns of one chat, each answer sent back as a client sends it (content
    only: the template drops its thought); after each, the next turn's prefix prefilled
    ahead (or, ``ahead`` False, not)."""
    messages = [{"role": "system", "content": "You think first. " * 6}]
    out = []

    async def go():
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question number {turn}?"})
            req = ChatCompletionRequest(model="m", messages=list(messages), max_tokens=20,
                                        temperature=0)
            prepared = service.prepare(req)
            if not ahead:
                prepared.history = None
            got = await served(service, prepared)
            await service.ahead.idle()
            finish = got["finish"]
            out.append({"prompt": len(prepared.prompt), "cached": finish.cached_tokens,
                        "history": history_end(service.tokenizer, messages),
                        "text": got["text"], "thought": got["thought"],
                        "reasoning": finish.reasoning_tokens})
            messages.append({"role": "assistant", "content": got["text"]})

    asyncio.run(go())
    return out


def history_end(tokenizer, messages: list[dict]) -> int:
    """Where the last user message's text starts in the prompt: the rendered prompts of
    two different texts share exactly what comes before it."""
    a, b = (tokenizer.apply_chat_template([*messages[:-1], {"role": "user", "content": t}],
                                          add_generation_prompt=True) for t in ("x", "y"))
    return next(i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q)


def test_the_next_turn_restores_its_whole_history_though_the_template_drops_thoughts(home):
    """Qwen3.5's template renders earlier turns without their thought: without the prefill
    ahead a turn restores only up to the previous answer's start; with it, everything
    before its new user message. Both give a cold prefill's tokens."""
    service = cached_thinker(home, reasoning={"budget_tokens": 6})
    cold = cached_thinker(home, reasoning={"budget_tokens": 6, "prefill_next_turn": False})
    try:
        with_ahead = conversation(service, 4, ahead=True)
        stats = service.thinking
        assert stats.ahead["done"] == 4 and stats.ahead_prefilled_tokens > 0
        assert stats.thought_tokens == sum(t["reasoning"] for t in with_ahead) == 4 * 7
        without = conversation(cold, 4, ahead=True)  # its profile turns it off
        assert cold.thinking.ahead["done"] == 0
        for turn, (a, b) in enumerate(zip(with_ahead, without, strict=True)):
            assert (a["text"], a["thought"]) == (b["text"], b["thought"]), turn
            if turn == 0:
                continue
            # everything before the new user message's text is restored (but the last token:
            # a capture at a prompt's end holds the state before its last token)
            assert a["cached"] >= a["history"] - 1, (turn, a)
            # without: only up to the previous answer's start (its thought left the prompt)
            assert b["cached"] < a["cached"] - 20, (turn, a, b)
        nocache = conversation_cold(home, [t["text"] for t in with_ahead])
        assert [t["text"] for t in with_ahead] == nocache
    finally:
        service.shutdown()
        cold.shutdown()


def conversation_cold(home, answers: list[str]) -> list[str]:
    """The same conversation on a service without a cache: its answers."""
    path = materialize(THINKER, home)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source=f"embedded:{THINKER}",
                                        cache={"enabled": False},
                                        reasoning={"budget_tokens": 6}),
                           model, tokenizer, path, None)
    try:
        return [t["text"] for t in conversation(service, len(answers), ahead=False)]
    finally:
        service.shutdown()


def test_without_a_budget_a_grammar_holds_from_the_first_token_where_no_thought_is_open(home):
    """Qwen3's template leaves opening a thought to the model: under a JSON schema and
    without a budget the output may not open one (it could take every token)."""
    path = materialize("tiny-hybrid", home)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-hybrid",
                                        cache={"enabled": False}), model, tokenizer, path, None)
    schema = {"type": "object", "properties": {"pick": {"enum": ["tea", "coffee"]}},
              "required": ["pick"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "choice", "schema": schema}}
    try:
        for seed in range(6):
            got = answer(service, ChatCompletionRequest(
                model="m", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed,
                response_format=fmt))
            assert got["finish"].reasoning_tokens == 0 and got["thought"] == ""
            assert json.loads(got["text"])["pick"] in ("tea", "coffee")
    finally:
        service.shutdown()


def test_a_turn_without_a_thought_is_not_prefilled_ahead(home):
    """tiny-hybrid's template opens no thought and the model writes none: the next turn
    renders this one as it was generated, so nothing runs ahead (no extra engine work)."""
    from serve_app.cache.client import LocalCacheClient
    from serve_app.cache.tiers import TieredStore

    path = materialize("tiny-hybrid", home)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-hybrid",
                                        cache={"block_size": 16}), model, tokenizer, path,
                           LocalCacheClient(TieredStore(1 << 30)))
    try:
        turns = conversation(service, 3, ahead=True)
        assert all(t["reasoning"] == 0 for t in turns)
        assert service.thinking.ahead == dict.fromkeys(service.thinking.ahead, 0)
        assert service.engine.snapshot().finished == 3
    finally:
        service.shutdown()


def test_a_caller_that_stops_at_the_finish_still_gets_the_prefill_ahead_and_the_count(home):
    """The ingress stops reading at the ``Finish``: the turn's thought is counted and its
    next prefix prefilled anyway (also with the prefill ahead off: the count)."""
    for ahead in (True, False):
        service = cached_thinker(home, reasoning={"budget_tokens": 4,
                                                  "prefill_next_turn": ahead})

        async def go(service=service):
            prepared = service.prepare(request(10))
            stream = service.stream(prepared)
            async for events in stream:
                if any(isinstance(e, Finish) for e in events):
                    break
            await stream.aclose()
            await service.ahead.idle()

        try:
            asyncio.run(go())
            assert service.thinking.thought_tokens == 5
            assert service.thinking.ahead["done"] == (1 if ahead else 0)
        finally:
            service.shutdown()


def test_markers_in_a_users_text_do_not_open_a_thought(thinker, home):
    """`<think>` written by a user (it tokenizes to the marker) is the conversation's, not
    the generation prompt's: the output starts where the template starts it."""
    path = materialize("tiny-hybrid", home)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-hybrid",
                                        cache={"enabled": False}), model, tokenizer, path, None)
    try:
        for text in ("What does the <think> tag do?", "Explain <think> and </think> <think>"):
            req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": text}],
                                        max_tokens=8, temperature=0)
            got = answer(service, req)
            assert tokenizer.think_start_id in got["prompt"]
            assert not got["thinking"].in_thought and not got["thinking"].prompt_thought
            assert got["finish"].reasoning_tokens == 0 and got["thought"] == ""
    finally:
        service.shutdown()
    service_of, tokenizer = thinker  # Qwen3.5's template opens it, whatever the user wrote
    got = answer(service_of(reasoning={"budget_tokens": 2}), ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "a </think> b"}], max_tokens=6,
        temperature=0))
    assert got["thinking"].in_thought and got["finish"].reasoning_tokens == 3
