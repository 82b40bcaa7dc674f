"""A replica lost mid-answer, over HTTP with the real clients (issue 45): two replicas of a
model; the one serving a stream really dies (its process is killed) after it has sent some
tokens; the stream goes on from the other replica, and the client reads one unbroken
answer: the undisturbed run's text and usage, token for token at temperature 0 and with a
seed, for chat, completions, Anthropic's Messages and OpenAI's Responses, streamed, and
a whole answer too. ``serve_app_resumed_requests`` counts them.

The loss is real (SIGKILL of the replica's process: Ray sees the actor die); only its
moment is chosen from inside, ``SERVE_APP_TEST_DIE_AFTER_TOKENS=N:PATH``: the replica that
has sent N tokens of a request and claims the armed file PATH kills itself. A kill timed
from outside could not land inside a stream that lasts a second.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench.node_loss import RESUMED_REQUESTS, metric_sum
from serve_app.deploy.replica import DIE_ENV
from tests.support.clients import anthropic_client, model_stats, openai_client
from tests.support.servers import serving, wait_for

MODEL = "m"
AFTER = 8  # tokens a replica sends before it dies
N = 60
MODELS = [{"name": MODEL, "source": "embedded:tiny-dense", "num_replicas": 2,
           "max_batch_size": 4, "cache": {"block_size": 16}}]
PROMPT = "Tell me a long story about the sea and the ships on it, please."


@pytest.fixture(scope="module")
def lossy(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("resume")
    arm = tmp / "armed"
    with serving(tmp, MODELS, model_home, env={DIE_ENV: f"{AFTER}:{arm}"},
                 cache_store={"ssd_dir": str(tmp / "kv")}) as server:
        yield server, arm


def replicas_up(server) -> bool:
    """Both replicas report, each within the last few seconds (a dead one's report
    ages; its replacement's is fresh once it has loaded the model)."""
    replicas = model_stats(server, MODEL).get("replicas") or []
    return len([r for r in replicas if r["age_s"] < 5]) >= 2


def resumed_count(server) -> float:
    """Requests continued elsewhere (``/metrics``; the server serves one model)."""
    return metric_sum(httpx.get(f"{server.base_url}/metrics", timeout=30).text,
                      RESUMED_REQUESTS)


def with_a_loss(server, arm: Path, ask: Callable[[], dict]) -> None:
    """``ask`` undisturbed, then with the replica serving it dying after ``AFTER`` tokens:
    the same answer, and one more resumed request counted."""
    wait_for(lambda: replicas_up(server), "both replicas up", 240, interval=1)
    reference = ask()
    assert reference["tokens"] > AFTER + 4, reference  # the loss lands mid-answer
    before = resumed_count(server)
    arm.write_text("armed")
    try:
        got = ask()
    finally:
        armed_still = arm.exists()
        if armed_still:
            arm.unlink()
    assert not armed_still, "no replica died: the loss never happened"
    assert got == reference
    wait_for(lambda: resumed_count(server) >= before + 1, "the resumed request counted", 30)


def chat_stream(client, **extra) -> dict:
    text, usage = "", None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N,
            stream=True, stream_options={"include_usage": True}, **extra):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return {"text": text, "tokens": usage.completion_tokens}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 77}])
def test_a_chat_stream_survives_its_replica(lossy, sampling):
    server, arm = lossy
    client = openai_client(server)
    with_a_loss(server, arm, lambda: chat_stream(client, **sampling))


def test_a_completion_stream_survives_its_replica(lossy):
    server, arm = lossy
    client = openai_client(server)

    def ask() -> dict:
        text, n = "", 0
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return {"text": text, "tokens": n}

    with_a_loss(server, arm, ask)


def test_an_anthropic_stream_survives_its_replica(lossy):
    server, arm = lossy
    client = anthropic_client(server)

    def ask() -> dict:
        text, n, stop = "", 0, None
        for event in client.messages.create(model=MODEL, max_tokens=N,
                                            extra_body={"temperature": 0},
                                            messages=[{"role": "user", "content": PROMPT}],
                                            stream=True):
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
            elif event.type == "message_delta":
                n, stop = event.usage.output_tokens, event.delta.stop_reason
        return {"text": text, "tokens": n, "stop": stop}

    with_a_loss(server, arm, ask)


def test_a_responses_stream_survives_its_replica(lossy):
    server, arm = lossy
    client = openai_client(server)

    def ask() -> dict:
        text, n = "", 0
        for event in client.responses.create(model=MODEL, input=PROMPT, temperature=0,
                                             max_output_tokens=N, stream=True):
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                n = event.response.usage.output_tokens
                assert event.response.output_text == text
        return {"text": text, "tokens": n}

    with_a_loss(server, arm, ask)


def test_a_whole_answer_survives_its_replica(lossy):
    """Not streamed: the replica sends it in one reply, so nothing was sent; the request
    goes again (from its prompt) and the client gets the undisturbed answer."""
    server, arm = lossy
    client = openai_client(server)

    def ask() -> dict:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N,
            temperature=0)
        return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens}

    wait_for(lambda: replicas_up(server), "both replicas up", 240, interval=1)
    reference = ask()
    arm.write_text("armed")
    try:
        assert ask() == reference
    finally:
        died = not arm.exists()
        if not died:
            os.remove(arm)
    assert died, "no replica died: the loss never happened"
