"""Typed replica events (``serve_app.serving.events``) and their OpenAI consumer, in-process."""

from __future__ import annotations

import pickle

import pytest

from serve_app.api.http import _merge_deltas
from serve_app.api.openai_api import CHAT, COMPLETION, CompletionStream, completion_collector
from serve_app.serving.events import (
    Delta,
    Failure,
    Finish,
    Reasoning,
    Start,
    TokenLogprob,
    ToolCall,
)
from serve_app.serving.request import ApiError

A = TokenLogprob("a", -0.5, (97,), (TokenLogprob("a", -0.5, (97,)), TokenLogprob("b", -1.0, (98,))))
B = TokenLogprob("bc", -0.25, (98, 99), (TokenLogprob("bc", -0.25, (98, 99)),))
CALL = ToolCall("call_1", "get_time", '{"zone": "CET"}')


def generation() -> list:
    return [Start(5, 2), Delta("a", (A,)), Delta("bc", (B,)), CALL,
            Finish("tool_calls", 5, 3, 2, 0.1, None)]


def test_events_and_errors_survive_pickling():
    """They cross Ray from a replica to the ingress."""
    for event in [*generation(), Failure(429, "busy", "rate_limit_error", None, "queue_full",
                                         {"Retry-After": "1"})]:
        assert pickle.loads(pickle.dumps(event)) == event
    err = pickle.loads(pickle.dumps(ApiError(503, "gone", type="service_unavailable",
                                             code="replica_lost", headers={"Retry-After": "2"})))
    assert (err.status, err.message, err.type, err.code, err.headers) == (
        503, "gone", "service_unavailable", "replica_lost", {"Retry-After": "2"})
    assert ApiError.from_failure(err.to_failure()).body() == err.body()


def test_deltas_of_a_batch_merge_with_their_logprobs():
    merged = _merge_deltas([Start(1), Delta("x"), Delta("y"), CALL, Delta("a", (A,)),
                            Delta("bc", (B,))])
    assert merged == [Start(1), Delta("xy"), CALL, Delta("abc", (A, B))]
    assert _merge_deltas([Reasoning("p"), Reasoning("q"), Delta("x")]) == [
        Reasoning("pq"), Delta("x")]
    assert _merge_deltas([Delta("x"), Delta("y", (B,))]) == [Delta("xy", (B,))]


def test_chat_chunks_and_the_collected_answer_come_from_the_same_events():
    stream = CompletionStream(CHAT, "m", include_usage=True)
    chunks = [c for e in generation() for c in stream.feed(e)]
    assert stream.done and stream.id.startswith("chatcmpl-")
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 6
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["logprobs"]["content"][0] == {
        "token": "a", "logprob": -0.5, "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                         {"token": "b", "logprob": -1.0, "bytes": [98]}]}
    assert chunks[3]["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]}
    assert chunks[4]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[5]["choices"] == [] and chunks[5]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0}}

    collector = completion_collector(CHAT, "m")
    for e in generation():
        collector.feed(e)
    answer = collector.response()
    assert answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "abc", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]}
    assert choice["logprobs"]["content"] == [
        c["choices"][0]["logprobs"]["content"][0] for c in chunks[1:3]]
    assert answer["usage"] == chunks[5]["usage"]


def test_completion_logprobs_offsets_run_across_chunks():
    stream = CompletionStream(COMPLETION, "m")
    chunks = [c for e in generation()[:3] for c in stream.feed(e)]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "bc"]  # no role chunk
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1]]
    assert chunks[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.5, "b": -1.0}]
    collector = completion_collector(COMPLETION, "m")
    for e in [*generation()[:3], Finish("length", 5, 2, 2)]:
        collector.feed(e)
    answer = collector.response()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert answer["choices"][0]["text"] == "abc"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["logprobs"] == {
        "tokens": ["a", "bc"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"a": -0.5, "b": -1.0}, {"bc": -0.25}], "text_offset": [0, 1]}


def test_a_failure_is_an_error_chunk_or_raises_when_collected():
    failure = ApiError(503, "gone", type="service_unavailable", code="replica_lost").to_failure()
    stream = CompletionStream(CHAT, "m")
    stream.feed(Start(1))
    assert stream.feed(failure) == [{"error": {"message": "gone", "type": "service_unavailable",
                                               "param": None, "code": "replica_lost"}}]
    assert stream.done
    collector = completion_collector(CHAT, "m")
    collector.feed(Start(1))
    with pytest.raises(ApiError) as info:
        collector.feed(failure)
    assert info.value.status == 503 and collector.done
    unfinished = completion_collector(COMPLETION, "m")
    unfinished.feed(Start(1))
    with pytest.raises(ApiError) as info:
        unfinished.response()
    assert info.value.status == 500


THOUGHT = [Start(5), Reasoning("Let me"), Reasoning(" see."), Delta("Paris"),
           Finish("stop", 5, 9, 0, 0.1, None, reasoning_tokens=6)]


@pytest.mark.parametrize("field,names", [("reasoning_content", ["reasoning_content"]),
                                         ("reasoning", ["reasoning"]),
                                         ("both", ["reasoning_content", "reasoning"])])
def test_a_thought_goes_out_apart_from_the_answer_in_the_profiles_field(field, names):
    stream = CompletionStream(CHAT, "m", include_usage=True, reasoning_field=field)
    chunks = [c for e in THOUGHT for c in stream.feed(e)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[1] == dict.fromkeys(names, "Let me") and deltas[2] == dict.fromkeys(names,
                                                                                     " see.")
    assert deltas[3] == {"content": "Paris"}
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    collector = completion_collector(CHAT, "m", field)
    for e in THOUGHT:
        collector.feed(e)
    message = collector.response()["choices"][0]["message"]
    assert message["content"] == "Paris"
    assert all(message[n] == "Let me see." for n in names)
    assert collector.response()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_an_answer_without_a_thought_has_no_thought_field():
    collector = completion_collector(CHAT, "m")
    for e in generation():
        collector.feed(e)
    assert "reasoning_content" not in collector.response()["choices"][0]["message"]


def test_a_completion_never_carries_a_thought_field():
    stream = CompletionStream(COMPLETION, "m")
    assert [c for e in THOUGHT[:3] for c in stream.feed(e)] == []
