"""Claude Code as it really connects, through the real ``anthropic`` client and ``serve run``.

Claude Code (2.1.36 and later) sends a system block whose ``cch`` changes on every
request, calls ``/v1/messages?beta=true`` with ``anthropic-beta`` headers (the SDK's
``client.beta.messages``), keeps ``thinking`` blocks in assistant history, marks
``cache_control`` with a ``ttl`` and sends ``metadata``. A six-turn session shaped like
it must reuse the cache; a prompt with a changing stamp that no rule knows shows up in
the cache-bust diagnostics.
"""

from __future__ import annotations

import json
import random
import urllib.request

import anthropic
import httpx
import pytest

from serve_app.api.thinking_signature import ThoughtSigner, load_key
from tests.support.clients import anthropic_client, openai_client
from tests.support.servers import DENSE, HYBRID, wait_for

BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14"]
IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."
SYSTEM = ("You are an interactive CLI tool that helps users with software engineering tasks. "
          "Use the instructions below and the tools available to you to assist the user. "
          "Be concise. Prefer editing files to creating them. Run the tests after a change. "
          * 3)
TOOLS = [
    {"name": name, "description": description, "input_schema": {
        "type": "object", "properties": {arg: {"type": "string", "maxLength": 12}},
        "required": [arg], "additionalProperties": False}}
    for name, description, arg in [
        ("Bash", "Run a shell command", "command"), ("Read", "Read a file", "path"),
        ("Edit", "Edit a file", "path"), ("Glob", "Find files", "pattern"),
        ("Grep", "Search files", "pattern"), ("TodoWrite", "Write the todo list", "todo")]
]
TOOLS[-1]["cache_control"] = {"type": "ephemeral"}


def billing_block(rng: random.Random) -> dict:
    cch = "".join(rng.choice("0123456789abcdef") for _ in range(5))
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.e4f; "
                                    f"cc_entrypoint=cli; cch={cch};"}


def system(rng: random.Random) -> list[dict]:
    return [billing_block(rng), {"type": "text", "text": IDENTITY},
            {"type": "text", "text": SYSTEM,
             "cache_control": {"type": "ephemeral", "ttl": "1h"}}]


@pytest.fixture(scope="module")
def signed(model_home):
    """A thinking block's signature as the server makes it (its key file is in the home the
    test server shares): thinking blocks sent back in history must verify."""
    signer = ThoughtSigner(load_key(model_home))
    return lambda model, text: signer.signature(model, text)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic_client(server, timeout=120)


def stats(server, model: str) -> dict:
    with urllib.request.urlopen(f"{server.base_url}/v1/stats", timeout=60) as r:
        return json.loads(r.read())["models"][model]


def cached_fraction(usage) -> float:
    return usage.cache_read_input_tokens / (usage.input_tokens + usage.cache_read_input_tokens)


def test_a_claude_code_session_with_the_rotating_block_reuses_the_cache(server, claude, signed):
    rng = random.Random(7)
    before = stats(server, HYBRID)["normalization"]["requests_by_rule"]
    messages: list[dict] = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>cwd: /repo</system-reminder>"},
        {"type": "text", "text": "Find why the tests fail."}]}]
    fractions = []
    for turn in range(6):
        reply = claude.beta.messages.create(
            model=HYBRID, max_tokens=24, system=system(rng), tools=TOOLS,
            messages=messages, betas=BETAS, metadata={"user_id": "user_1_account_2_session_3"},
            tool_choice={"type": "any"} if turn % 2 == 0 else {"type": "auto"},
            thinking={"type": "enabled", "budget_tokens": 16})  # below max_tokens
        fractions.append(cached_fraction(reply.usage))
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        uses = [b for b in content if b["type"] == "tool_use"]
        if turn == 2:  # thinking on: history keeps thinking blocks, as Claude Code sends it
            content = [{"type": "thinking", "thinking": "Look at the logs.",
                        "signature": signed(HYBRID, "Look at the logs.")},
                       {"type": "redacted_thinking", "data": "opaque"}, *content]
        messages.append({"role": "assistant", "content": content or "ok"})
        results = [{"type": "tool_result", "tool_use_id": u["id"],
                    "content": f"output of {u['name']} #{turn}"} for u in uses]
        messages.append({"role": "user", "content": [
            *results, {"type": "text", "text": f"Turn {turn + 1}: keep going."}]})
    # Every turn after the first restores the conversation so far, although every request
    # carried another billing block (0.00 before the block was dropped).
    later = sum(fractions[1:]) / 5
    print("cached fraction per turn:", [round(f, 3) for f in fractions])
    assert later >= 0.8, fractions
    after = stats(server, HYBRID)["normalization"]["requests_by_rule"]
    assert after["claude_code_billing_header"] - before["claude_code_billing_header"] == 6


def test_the_beta_endpoint_headers_and_request_fields_are_accepted(server, claude):
    rng = random.Random(8)
    message = claude.beta.messages.create(
        model=DENSE, max_tokens=4, system=system(rng), betas=BETAS,
        metadata={"user_id": "u1"}, messages=[{"role": "user", "content": "hi"}])
    assert message.type == "message" and message.usage.output_tokens >= 1
    # The raw request, as Claude Code sends it: the query string and the header.
    r = httpx.post(f"{server.base_url}/v1/messages?beta=true", timeout=60,
                   headers={"anthropic-beta": ",".join(BETAS), "anthropic-version": "2023-06-01",
                            "x-api-key": "unused"},
                   json={"model": DENSE, "max_tokens": 2, "system": system(rng),
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_thinking_blocks_in_history_render_the_same_on_every_turn(claude, signed):
    rng = random.Random(9)
    history = [{"role": "user", "content": "Plan the change."},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "first idea",
                    "signature": signed(DENSE, "first idea")},
                   {"type": "text", "text": "Here is the plan."}]},
               {"role": "user", "content": "Do it."}]
    first = claude.messages.create(model=DENSE, max_tokens=4, system=system(rng),
                                   messages=history)
    # The same history, its thinking now redacted: the same prompt, wholly cached.
    history[1]["content"][0] = {"type": "redacted_thinking", "data": "opaque"}
    second = claude.messages.create(model=DENSE, max_tokens=4, system=system(rng),
                                    messages=history)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert total == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= total - 16  # all but the last block


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "Read"}])
def test_forced_tool_choices_give_a_valid_tool_use(claude, choice):
    message = claude.beta.messages.create(
        model=HYBRID, max_tokens=120, system=system(random.Random(10)), tools=TOOLS,
        tool_choice=choice, betas=BETAS, messages=[{"role": "user", "content": "Go."}])
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        if choice["type"] == "tool":
            assert use.name == "Read"
        schema = next(t for t in TOOLS if t["name"] == use.name)["input_schema"]
        assert set(use.input) == set(schema["required"])


def test_an_image_to_a_model_without_vision_is_a_clear_400(claude):
    """Images reach a vision model (tests/integration/test_vision_http.py); a text model
    refuses them, naming itself."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.beta.messages.create(model=DENSE, max_tokens=4, betas=BETAS, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    assert err.value.status_code == 400
    assert f"model {DENSE!r} does not take images" in str(err.value)
    assert err.value.body["error"]["type"] == "invalid_request_error"


def test_a_stamp_no_rule_knows_shows_up_as_a_cache_bust(server):
    client = openai_client(server)
    header = "Session started at 2026-12-01T10:00:0"
    for second in range(4):
        client.chat.completions.create(
            model=HYBRID, max_tokens=2, temperature=0, extra_body={"cache_salt": "bust-test"},
            messages=[{"role": "system", "content": f"{header}{second}Z\n{SYSTEM}"},
                      {"role": "user", "content": "What changed?"}])
    cache = stats(server, HYBRID)["cache"]
    busts = [b for b in cache["recent_cache_busts"]
             if b["matching_after"] >= len(SYSTEM) - 16]
    assert len(busts) >= 3, cache["recent_cache_busts"]
    positions = {b["position"] for b in busts}
    assert len(positions) == 1 and 0 < positions.pop() < 64  # where the stamp's digit is
    assert all(b["differing_tokens"] == b["differing_cached_tokens"] == 1 for b in busts)
    assert cache["cache_busts_by_position"]["0-63"] >= 3


def test_the_normalized_counter_reaches_metrics(server, claude):
    def count() -> float:
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        line = next((x for x in text.splitlines()
                     if x.startswith("ray_serve_app_normalized_requests_total")
                     and f'model="{DENSE}"' in x and "claude_code_billing_header" in x), "")
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    before = count()
    claude.messages.create(model=DENSE, max_tokens=1, system=system(random.Random(11)),
                           messages=[{"role": "user", "content": "hi"}])
    wait_for(lambda: count() >= before + 1, "the normalized request in /metrics", 60, 2)
