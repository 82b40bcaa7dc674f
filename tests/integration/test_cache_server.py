"""The prefix cache through the live server: openai client, real Ray actor."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.support.clients import chat, model_stats, openai_client
from tests.support.servers import DENSE, HYBRID

BS = 16  # the test profile's block size


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server, "key-one")


@pytest.mark.parametrize("model", [HYBRID, DENSE])
def test_five_turn_conversation_hits_every_turn(client, server, model):
    messages = [{"role": "system", "content": f"System prompt for {model}. " * 3}]
    previous_prompt = 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: what next?"})
        reply = chat(client, model, messages)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= (previous_prompt // BS) * BS > 0
        assert cached < reply.usage.prompt_tokens
        previous_prompt = reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    s = model_stats(server, model)
    assert s["cache"]["enabled"] and s["cache"]["hit_tokens"] > 0
    assert s["cache_store"]["bytes"] <= s["cache_store"]["budget_bytes"]
    assert s["cache_store"]["pinned_blocks"] == 0  # every restore released its pins


def test_streaming_reports_cached_tokens_and_matches(client):
    messages = [{"role": "user", "content": "Streaming cache check, please. " * 3}]
    first = chat(client, HYBRID, messages)
    chunks = list(client.chat.completions.create(
        model=HYBRID, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= BS
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content


def test_cache_salt_isolates(client):
    messages = [{"role": "user", "content": "Tenant isolation test message. " * 3}]
    chat(client, HYBRID, messages, extra_body={"cache_salt": "tenant-a"})
    other = chat(client, HYBRID, messages, extra_body={"cache_salt": "tenant-b"})
    again = chat(client, HYBRID, messages, extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.choices[0].message.content == again.choices[0].message.content


def test_api_keys_isolate_when_the_profile_says_so(client, server):
    messages = [{"role": "user", "content": "API key isolation check. " * 3}]
    chat(client, DENSE, messages)
    stranger = openai_client(server, "key-two")
    assert chat(stranger, DENSE, messages).usage.prompt_tokens_details.cached_tokens == 0
    assert chat(client, DENSE, messages).usage.prompt_tokens_details.cached_tokens > 0


def test_a_body_cannot_choose_the_api_key_salt(client, server):
    # The key digest comes from the Authorization header only; no body field reaches it.
    messages = [{"role": "user", "content": "Body salt check, key one's prefix. " * 3}]
    chat(client, DENSE, messages)  # cached under key-one's salt
    digest = hashlib.sha256(b"key-one").hexdigest()

    def anonymous(**fields) -> int:  # no Authorization header
        body = {"model": DENSE, "messages": messages, "max_tokens": 4, "temperature": 0,
                **fields}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    # Not key-one's blocks: at most the chat template's opening, which this attention-only
    # model shares (exact common prefix) with earlier prompts under the unsalted root.
    assert anonymous(x_api_key_digest=digest) < BS
    assert anonymous(cache_salt=f"|key:{digest}") == 0  # nor through a crafted cache_salt
    assert anonymous(x_api_key_digest="another") > 0  # ignored: the unsalted blocks again


def test_models_never_share_blocks(client):
    messages = [{"role": "user", "content": "Same words, another model. " * 3}]
    chat(client, HYBRID, messages)
    assert chat(client, HYBRID, messages).usage.prompt_tokens_details.cached_tokens > 0
    # Not the hybrid's blocks: at most the chat template's opening, which the dense model
    # shares (exact common prefix) with its own earlier prompts.
    assert chat(client, DENSE, messages).usage.prompt_tokens_details.cached_tokens < BS


def test_concurrent_conversations_share_a_system_prompt(client):
    system = {"role": "system", "content": "Shared agent instructions, long enough. " * 4}
    warmup = chat(client, HYBRID, [system, {"role": "user", "content": "warm up"}])
    shared_blocks = (warmup.usage.prompt_tokens - 20) // BS * BS

    def conversation(i: int) -> int:
        reply = chat(client, HYBRID, [system, {"role": "user", "content": f"user {i} asks"}])
        return reply.usage.prompt_tokens_details.cached_tokens

    with ThreadPoolExecutor(4) as pool:
        cached = list(pool.map(conversation, range(4), timeout=300))
    assert all(c >= shared_blocks > 0 for c in cached), cached


def test_stats_explain_the_last_miss(client, server):
    chat(client, HYBRID, [{"role": "user", "content": "A brand new prefix nobody sent. " * 3}])
    reason = model_stats(server, HYBRID)["cache"]["last_miss_reason"]
    assert reason == "new prefix"
