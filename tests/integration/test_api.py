"""The OpenAI API against a live ``serve run`` deployment, through real HTTP.

The server is the session's shared one (other files' tests use it too, in any order): a
test reads an engine counter as the change its own requests made, never as a total."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.clients import openai_client
from tests.support.servers import DENSE, HYBRID, LIMITED, wait_for


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server)


def engine_stats(server, model: str) -> dict:
    r = httpx.get(f"{server.base_url}/v1/stats", timeout=30)
    r.raise_for_status()
    return r.json()["models"][model]["engine"]


def wait_idle(server, model: str, timeout: float = 30.0) -> dict:
    """The model's engine stats once nothing is in flight."""
    def idle() -> dict | None:
        stats = engine_stats(server, model)
        return stats if stats["in_flight"] == 0 else None

    return wait_for(idle, f"{model} idle", timeout, interval=0.05)


def chat_ids(client: OpenAI, model: str, content: str, max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return r.choices[0].message.content, r.choices[0].finish_reason


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kw)
    return httpx.post(f"{server.base_url}{path}", content=body, timeout=60, **kw)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# ---- basic endpoints -------------------------------------------------------------


def test_health(server):
    r = httpx.get(f"{server.base_url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [HYBRID, DENSE, LIMITED]
    assert client.models.retrieve(DENSE).id == DENSE
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_chat_non_streaming(client, model):
    # A salt of its own: nothing any other test cached can match it.
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=12,
        temperature=0, extra_body={"cache_salt": f"fresh-{time.monotonic_ns()}"}
    )
    assert r.object == "chat.completion"
    assert r.model == model
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_chat_streaming_with_usage_matches_non_streaming(client, model):
    messages = [{"role": "user", "content": "Stream to me."}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert text == full.choices[0].message.content
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_usage_and_done_marker(server):
    body = {"model": DENSE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all("usage" not in p or p["usage"] is None for p in payloads)


def test_completions_endpoint(client):
    r = client.completions.create(model=DENSE, prompt="Once upon a time", max_tokens=8,
                                  temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(b"Once upon a time")
    chunks = list(client.completions.create(model=DENSE, prompt="Once upon a time",
                                            max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    by_ids = client.completions.create(model=DENSE, prompt=list(b"Once upon a time"),
                                       max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_max_tokens_and_max_completion_tokens(client):
    for kwargs in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        r = client.chat.completions.create(
            model=DENSE, messages=[{"role": "user", "content": "count"}], temperature=0, **kwargs
        )
        assert r.usage.completion_tokens <= 3
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 3


def test_stop_string_truncates_output(client):
    text, _ = chat_ids(client, DENSE, "stop test", 24)
    assert len(text) >= 4
    stop = text[2:4]
    r = client.chat.completions.create(
        model=DENSE, messages=[{"role": "user", "content": "stop test"}], max_tokens=24,
        temperature=0, stop=[stop],
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.find(stop)]
    streamed = client.chat.completions.create(
        model=DENSE, messages=[{"role": "user", "content": "stop test"}], max_tokens=24,
        temperature=0, stop=stop, stream=True,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def run(seed):
        return client.chat.completions.create(
            model=DENSE, messages=[{"role": "user", "content": "sample"}], max_tokens=16,
            temperature=1.0, top_p=0.9, seed=seed,
        ).choices[0].message.content

    assert run(7) == run(7)


# ---- errors -------------------------------------------------------------------------


def test_malformed_json_is_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", b"{not json"), 400)
    assert_openai_error(post(server, "/v1/chat/completions", b"[1, 2]"), 400)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": DENSE, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"},
         "max_tokens"),
        ({"model": DENSE, "messages": "hello"}, "messages"),
        ({"model": DENSE}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": DENSE, "messages": [{"role": "user", "content": "x"}], "temperature": 5},
         "temperature"),
        ({"model": DENSE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
         "max_tokens"),
        ({"model": DENSE, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": DENSE, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
         "stream"),
    ],
)
def test_wrong_types_are_400(server, body, param):
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param)


def test_unknown_model_is_404(client, server):
    err = assert_openai_error(
        post(server, "/v1/chat/completions",
             {"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]}),
        404, "model",
    )
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user",
                                                                    "content": "x"}])


def test_prompt_longer_than_context_is_400_naming_both_lengths(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=DENSE, messages=[{"role": "user", "content": "y" * 1100}], max_tokens=4
        )
    message = info.value.body["message"]
    assert "1024" in message and "1119" in message  # the limit and the prompt's length
    assert info.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "extra,param",
    [({"n": 2}, "n"), ({"top_logprobs": 3}, "top_logprobs"), ({"presence_penalty": 0.5},
     "presence_penalty"), ({"tools": [{"type": "nope", "function": {"name": "f"}}]},
     "tools.0.type"), ({"stream_options": {"include_usage": True}}, "stream_options")],
)
def test_unsupported_options_are_400(server, extra, param):
    body = {"model": DENSE, "messages": [{"role": "user", "content": "x"}], **extra}
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param)


def test_unknown_route_is_openai_404(server):
    r = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert_openai_error(r, 404)


# ---- batching, cancellation, back-pressure ---------------------------------------------


@pytest.mark.parametrize("model", [DENSE, HYBRID])
def test_concurrent_requests_batch_and_match_solo(client, server, model):
    prompts = [f"request {i}: " + "abc" * (i * 3) for i in range(6)]
    max_tokens = 48
    solo = [chat_ids(client, model, p, max_tokens) for p in prompts]
    before = wait_idle(server, model)
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: chat_ids(client, model, p, max_tokens), prompts,
                                 timeout=300))
    assert together == solo
    after = wait_idle(server, model)
    # They ran as one batch: the engine took far fewer decode steps than they made tokens
    # (one at a time, each token is a step of its own), in batches of up to six.
    tokens = after["generated_tokens"] - before["generated_tokens"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert tokens >= 6 and steps <= tokens / 2, (steps, tokens)
    assert after["peak_batch_size"] >= 6


def test_closed_stream_frees_its_slot(client, server):
    before = wait_idle(server, HYBRID)
    stream = client.chat.completions.create(
        model=HYBRID, messages=[{"role": "user", "content": "talk forever"}], max_tokens=250,
        temperature=0, stream=True,
    )
    received = 0
    for _ in stream:
        received += 1
        if received == 4:
            break
    stream.close()
    after = wait_idle(server, HYBRID)
    assert after["in_flight"] == 0
    assert after["cancelled"] == before["cancelled"] + 1
    # Far fewer than 250 tokens were generated for it.
    assert after["generated_tokens"] - before["generated_tokens"] < 150
    # The slot is reusable at once.
    text, _ = chat_ids(client, HYBRID, "next", 4)
    assert isinstance(text, str)


def test_queue_full_is_429_with_retry_after(server):
    before = wait_idle(server, LIMITED)
    body = {"model": LIMITED, "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 3900, "temperature": 0, "stream": True}
    url = f"{server.base_url}/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url, json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep it: dropping it closes the stream
            next(lines)  # the first request holds the only batch slot
            with http.stream("POST", url, json=body) as queued:
                assert queued.status_code == 200  # the one allowed queued request
                r = http.post(url, json={**body, "stream": False})
                err = assert_openai_error(r, 429)
                assert err["code"] == "queue_full"
                assert int(r.headers["retry-after"]) >= 1
    stats = wait_idle(server, LIMITED)
    assert stats["rejected"] >= before["rejected"] + 1


def test_replicas_run_our_code_on_serves_main_loop(server, client):
    """SERVE_REPLICA_ENV reached the replica: no second event-loop thread per chunk."""
    chat_ids(client, HYBRID, "hello", 4)
    stats = httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()["models"]
    for name in (HYBRID, DENSE):
        thread = stats[name]["replica"]["user_code_thread"]
        assert thread == "AsyncIO Thread: default", thread  # Ray's main loop, not Thread-N
