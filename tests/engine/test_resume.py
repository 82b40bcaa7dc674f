"""A request continued by another replica after the tokens a lost one had sent: through
the model service (real engine, real models, no Ray), the events the client would have
had from the lost replica followed by the resumed request's are the undisturbed answer's,
at every point the answer can be cut (each ``Tokens`` event), and the resumed tokens are
the very tokens of the undisturbed run: greedy on every tiny variant, seeded, under a
grammar, through a thought and its budget, inside a tool call, with stop strings, from a
warm prefix cache."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.api.resume import with_resume
from serve_app.config.profile import ModelProfile
from serve_app.serving.events import (
    Delta,
    Event,
    Failure,
    Finish,
    Reasoning,
    Start,
    Tokens,
    ToolCall,
)
from serve_app.serving.request import ApiError, ChatCompletionRequest, CompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import Script, make_services
from tests.support.formats import DENSES, HYBRIDS, load
from tests.support.images import image_part
from tests.support.servers import wait_for

THINKER = "tiny-hybrid-mtp"  # its template opens a thought
MESSAGES = [{"role": "user", "content": "Tell me about the sea, then the sky."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}


def chat(n: int = 24, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=n,
                                 **{"temperature": 0, **extra})


def batches(service: ModelService, request, processors: tuple | None = None
            ) -> list[list[Event]]:
    """The replica's event batches for ``request``, as it yields them."""
    async def go() -> list[list[Event]]:
        prepared = await asyncio.to_thread(service.prepare, request)
        return [b async for b in service.stream(prepared, processors)]

    return asyncio.run(go())


def ids(of: list[list[Event]]) -> list[int]:
    return [i for b in of for e in b if isinstance(e, Tokens) for i in e.ids]


def output(of: list[list[Event]]) -> list[Event]:
    """What the client gets of ``of``: no ``Start``, no ``Tokens``."""
    return [e for b in of for e in b if not isinstance(e, Start | Tokens)]


def answer(events: list[Event]) -> dict:
    """The answer as a client reads it: text, thought, calls and the finish's counts."""
    finish = events[-1]
    assert isinstance(finish, Finish), events[-3:]
    return {"text": "".join(e.text for e in events if isinstance(e, Delta)),
            "thought": "".join(e.text for e in events if isinstance(e, Reasoning)),
            "calls": [(c.name, c.arguments) for c in events if isinstance(c, ToolCall)],
            "finish": (finish.finish_reason, finish.prompt_tokens, finish.completion_tokens,
                       finish.reasoning_tokens, finish.stop_sequence)}


def resumed(service: ModelService, request, tokens: list[int],
            processors: tuple | None = None) -> list[list[Event]]:
    """The batches of ``request`` sent again after ``tokens``; its first is ``[Start]``."""
    got = batches(service, with_resume(request, tuple(tokens)), processors)
    assert isinstance(got[0][0], Start), got[0]
    return got


def check_every_cut(service: ModelService, request, processors=lambda: None) -> list[int]:
    """The undisturbed run, then a resume at each of its ``Tokens`` (where a replica lost
    mid-answer leaves the client): what the client gets is the same answer, the resumed
    tokens the same tokens. ``processors``: fresh ones for each run (None: the service's).
    The undisturbed run's token ids."""
    whole = batches(service, request, processors())
    tokens, full = ids(whole), answer(output(whole))
    cuts = [j for j, b in enumerate(whole) if any(isinstance(e, Tokens) for e in b)]
    assert tokens and cuts
    for j in cuts[:-1] if len(cuts) > 1 else []:
        sent = ids(whole[: j + 1])
        again = resumed(service, request, sent, processors())
        assert ids(again) == tokens[len(sent):], (j, len(sent))
        assert answer(output(whole[: j + 1]) + output(again)) == full, (j, len(sent))
    return tokens


def check_token_cuts(service: ModelService, request, cuts: list[int],
                     processors=lambda: None) -> list[int]:
    """Resumed after each of ``cuts`` tokens (wherever the batches fell): the same
    tokens follow."""
    tokens = ids(batches(service, request, processors()))
    for k in cuts:
        if 0 < k < len(tokens):
            assert ids(resumed(service, request, tokens[:k], processors())) == tokens[k:], k
    return tokens


# ---- greedy, on every weight format, and at every cut ----------------------------------


@pytest.mark.parametrize("name", DENSES + HYBRIDS)
def test_a_greedy_answer_resumed_is_the_same_tokens(name, home):
    *_, cold = load(name, home)
    tokens = check_token_cuts(cold, chat(16), [1, 7, 15])
    assert len(tokens) == 16


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_cut_anywhere_gives_the_client_the_same_answer(name, home):
    *_, cold = load(name, home)
    cold.profile = cold.profile.model_copy(update={"stream_interval_ms": 0.0})
    check_every_cut(cold, chat(40))
    check_every_cut(cold, CompletionRequest(model="m", prompt="Once upon a time",
                                            max_tokens=30, temperature=0))


def test_a_warm_replica_restores_the_prompt_and_prefills_the_tokens(home, tmp_path):
    warm, cold, _ = make_services("tiny-hybrid", tmp_path)
    try:
        request = chat(30)
        tokens = ids(batches(cold, request))
        batches(warm, chat(1))  # the prompt's blocks are in its cache now
        again = resumed(warm, request, tokens[:20])
        assert again[0][0].cached_tokens > 0  # restored, then the 20 tokens prefilled
        assert ids(again) == tokens[20:]
    finally:
        warm.shutdown()
        cold.shutdown()


# ---- sampling: a seed resumes at its position, unseeded goes on validly -----------------


def test_a_seeded_answer_resumes_on_the_same_tokens(home):
    *_, cold = load("tiny-dense", home)
    request = chat(30, temperature=0.9, seed=1234)
    tokens = check_token_cuts(cold, request, [1, 12, 29])
    assert ids(batches(cold, chat(30, temperature=0.9, seed=1235))) != tokens


def test_an_unseeded_answer_resumed_is_a_whole_answer(home):
    *_, cold = load("tiny-dense", home)
    request = chat(30, temperature=0.9)
    tokens = ids(batches(cold, request))
    again = resumed(cold, request, tokens[:10])
    assert len(ids(again)) == 20
    finish = output(again)[-1]
    assert isinstance(finish, Finish) and finish.completion_tokens == 30


# ---- stop strings, grammars, thoughts and tool calls resume in their state -------------


def test_a_stop_string_held_back_across_the_cut_still_stops(home):
    *_, cold = load("tiny-dense", home)
    cold.profile = cold.profile.model_copy(update={"stream_interval_ms": 0.0})
    text = answer(output(batches(cold, chat(40))))["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    request = chat(40, stop=[stop])
    check_every_cut(cold, request)
    got = answer(output(batches(cold, request)))
    assert got["finish"][0] == "stop" and got["finish"][4] == stop


def test_a_json_schema_answer_resumed_mid_object_is_the_same_document(home):
    *_, cold = load("tiny-dense", home)
    cold.profile = cold.profile.model_copy(update={"stream_interval_ms": 0.0})
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for temperature, seed in ((0, None), (1.0, 3)):
        request = chat(60, response_format=fmt, temperature=temperature, seed=seed)
        tokens = check_every_cut(cold, request)
        check_token_cuts(cold, request, list(range(1, len(tokens))))
        doc = json.loads(answer(output(batches(cold, request)))["text"])
        assert set(doc) == {"name", "age"}


def thinker(home, **profile) -> ModelService:
    path, model, tokenizer, _ = load(THINKER, home)
    return ModelService(ModelProfile(name="m", source=f"embedded:{THINKER}",
                                     cache={"enabled": False}, stream_interval_ms=0.0,
                                     **profile), model, tokenizer, path, None)


def test_a_thought_and_its_budget_resume_where_they_were(home):
    service = thinker(home, reasoning={"budget_tokens": 6})
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        for request in (chat(24), chat(60, response_format=fmt)):
            tokens = check_every_cut(service, request)
            # every cut: in the thought, at its forced close, in the answer's grammar
            check_token_cuts(service, request, list(range(1, len(tokens))))
            got = answer(output(batches(service, request)))
            assert got["finish"][3] == 7 and got["thought"]  # 6 and the closing marker
    finally:
        service.shutdown()


def test_a_tool_call_cut_in_its_arguments_comes_out_whole_once(home):
    *_, cold = load("tiny-dense", home)
    cold.profile = cold.profile.model_copy(update={"stream_interval_ms": 0.0})
    script = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Oslo", "days": 2}}\n</tool_call>')
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}}
    request = chat(200, tools=[weather])
    scripted = cold.tokenizer.encode(script, add_special_tokens=False)
    eos = next(iter(cold.eos_ids))
    original = cold.constraints

    def processors() -> tuple:
        return (Script(scripted, eos),)

    def constraints(prepared) -> tuple:  # the script, told where a resume begins
        made = processors()
        if prepared.resume:
            made[0].begin_at(len(prepared.prompt))
        return made

    cold.constraints = constraints  # type: ignore[method-assign]
    try:
        check_every_cut(cold, request)
        check_token_cuts(cold, request, list(range(1, len(scripted), 3)))
        got = answer(output(batches(cold, request)))
    finally:
        cold.constraints = original  # type: ignore[method-assign]
    assert got["text"] == "Let me look." and got["finish"][0] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in got["calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 2})]


# ---- what cannot resume --------------------------------------------------------------


def test_tokens_that_leave_nothing_to_generate_are_refused(home):
    *_, cold = load("tiny-dense", home)
    with pytest.raises(ApiError) as info:
        cold.prepare(with_resume(chat(4), (5, 6, 7, 8)))
    assert info.value.status == 400 and info.value.code == "invalid_resume"
    with pytest.raises(ApiError) as info:
        cold.prepare(with_resume(chat(8), (5, -1)))
    assert info.value.code == "invalid_resume"


def test_tokens_that_cross_a_stop_string_are_refused_and_free_the_engine(home):
    """The replay finds the answer would have stopped inside the tokens (tokens no replica
    of this request sent): 400, and the request, submitted already, leaves the engine."""
    *_, cold = load("tiny-dense", home)
    whole = batches(cold, chat(30))
    text, tokens = answer(output(whole))["text"], ids(whole)
    stop = text[2:5]
    assert len(stop) == 3
    got = batches(cold, with_resume(chat(30, stop=[stop]), tuple(tokens[:-1])))
    (failure,) = [e for b in got for e in b]
    assert isinstance(failure, Failure) and failure.status == 400
    assert failure.code == "invalid_resume" and "stop string" in failure.message
    wait_for(lambda: cold.engine.snapshot().in_flight == 0, "the request to leave the engine",
             10, interval=0.01)


def test_every_batch_with_output_carries_its_tokens(home):
    *_, cold = load("tiny-dense", home)
    for b in batches(cold, chat(24)):
        kinds = [type(e) for e in b]
        if Delta in kinds or Reasoning in kinds:
            assert Tokens in kinds, kinds
        if Finish in kinds or Failure in kinds:
            assert kinds[-1] in (Finish, Failure)  # the end stays last


# ---- speculative decoding and images --------------------------------------------------


@pytest.mark.parametrize("name,spec", [
    ("tiny-dense", {"method": "ngram", "num_draft_tokens": 4, "adaptive": False}),
    ("tiny-hybrid-mtp", {"method": "mtp", "adaptive": False})])
def test_a_speculating_replica_resumes_on_the_same_tokens(name, spec, home):
    path, model, tokenizer, _ = load(name, home)
    service = ModelService(ModelProfile(name="m", source=f"embedded:{name}", speculative=spec,
                                        cache={"enabled": False}), model, tokenizer, path)
    try:
        looping = CompletionRequest(model="m", prompt="a b c a b c a b c a b", max_tokens=24,
                                    temperature=0)
        check_token_cuts(service, looping, [1, 9, 17])
        seeded = CompletionRequest(model="m", prompt="a b c a b c a b c a b", max_tokens=24,
                                   temperature=0.8, seed=5)
        check_token_cuts(service, seeded, [2, 13])
        assert service.engine.snapshot().drafted_tokens > 0
    finally:
        service.shutdown()


@pytest.mark.parametrize("name", ["tiny-vl", "tiny-qwen25-vl-q4"])
def test_an_image_conversation_resumes_on_the_same_tokens(name, home):
    *_, cold = load(name, home)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             image_part(3)]}]
    request = ChatCompletionRequest(model="m", messages=messages, max_tokens=16,
                                    temperature=0,
                                    chat_template_kwargs={"enable_thinking": False})
    check_token_cuts(cold, request, [1, 8, 15])
