"""Tails: partial blocks captured where conversations branch (in-process, no Ray).

A tail is keyed by its parent block and its own tokens and holds their KV (and,
for hybrid models, the recurrent state at its end). Reuse becomes exact to the
token at the end of the system prompt, the start of the last message, the end
of the prompt and the end of the generation; every restore matches a cold
prefill.
"""

from __future__ import annotations

import mlx_lm
import pytest

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.prefix import common_prefix
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.request import ChatCompletionRequest, CompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import generated, run

BS = 16
MODELS = ["tiny-dense", "tiny-hybrid-bf16"]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    home = tmp_path_factory.mktemp("tails")
    out = {}
    for name in MODELS:
        path = materialize(name, home)
        model, tokenizer = mlx_lm.load(str(path))
        warm = ModelService(ModelProfile(name="warm", source=f"embedded:{name}",
                                         cache={"block_size": BS}), model, tokenizer, path,
                            LocalCacheClient(TieredStore(1 << 30)))
        cold = ModelService(ModelProfile(name="cold", source=f"embedded:{name}",
                                         cache={"enabled": False}), model, tokenizer, path)
        out[name] = (warm, cold)
    yield out
    for warm, cold in out.values():
        warm.shutdown()
        cold.shutdown()


def chat(messages: list[dict], n: int = 10) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, max_tokens=n, temperature=0)


SYSTEM = "You are a careful assistant for tail tests. Answer briefly. " * 2


@pytest.mark.parametrize("name", MODELS)
def test_a_new_session_restores_exactly_to_the_end_of_the_system_prompt(services, name):
    warm, cold = services[name]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Alpha?"}]
    run(warm, chat(first))
    second = [first[0], {"role": "user", "content": "Beta, something else?"}]
    prompt = warm.prompt_tokens(chat(second))
    # The system prompt and the next message's header are shared: the deepest point.
    system_end = max(warm.branch_points(chat(second), prompt))
    assert system_end % BS  # inside a block: only a tail can restore exactly there
    b = run(warm, chat(second))
    assert b["cached"] == system_end
    assert b["text"] == run(cold, chat(second))["text"]


@pytest.mark.parametrize("name", MODELS)
def test_a_changed_last_message_restores_to_its_start(services, name):
    warm, cold = services[name]
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "First question about tails."},
               {"role": "assistant", "content": "A first answer."}]
    one = history + [{"role": "user", "content": "Second question, version one?"}]
    two = history + [{"role": "user", "content": "Another one entirely?"}]
    run(warm, chat(one))
    prompt = warm.prompt_tokens(chat(two))
    last_start = max(warm.branch_points(chat(two), prompt))
    # An attention-only model goes on to the exact common prefix (here: the same,
    # both last messages start differently), cutting the stored tail or block there.
    shared = common_prefix(warm.prompt_tokens(chat(one)), prompt)
    assert shared >= last_start
    b = run(warm, chat(two))
    assert b["cached"] == (last_start if warm.layout.hybrid else shared)
    assert b["text"] == run(cold, chat(two))["text"]


@pytest.mark.parametrize("name", MODELS)
def test_the_next_turn_restores_to_the_end_of_the_generation(services, name):
    warm, cold = services[name]
    prompt = [7 + (i * 11) % 230 for i in range(2 * BS + 5)]
    run(warm, CompletionRequest(model="m", prompt=prompt, max_tokens=20, temperature=0))
    output = generated(cold, prompt, 20)  # the same greedy tokens
    follow = prompt + output + [9, 10, 11, 12]
    req = CompletionRequest(model="m", prompt=follow, max_tokens=10, temperature=0)
    b = run(warm, req)
    assert b["cached"] == len(prompt) + 20  # inside a block: the generation's tail
    assert b["text"] == run(cold, req)["text"]
    # ... and a request restored from a tail captures the next blocks right (aligned).
    again = follow + generated(cold, follow, 10) + [13, 14]
    req = CompletionRequest(model="m", prompt=again, max_tokens=10, temperature=0)
    c = run(warm, req)
    assert c["cached"] == len(follow) + 10
    assert c["text"] == run(cold, req)["text"]


@pytest.mark.parametrize("name", MODELS)
def test_a_tail_is_used_only_when_its_tokens_are_a_prefix_of_the_rest(services, name):
    warm, cold = services[name]
    prompt = [5 + (i * 13) % 230 for i in range(3 * BS + 9)]
    run(warm, CompletionRequest(model="m", prompt=prompt, max_tokens=4, temperature=0))
    # Diverging inside the tail's tokens: the tail (prompt end, 8 tokens) cannot be used
    # whole; an attention-only model cuts it to the 4 tokens it shares.
    other = prompt[: 3 * BS + 4] + [200, 201, 202, 203, 204]
    req = CompletionRequest(model="m", prompt=other, max_tokens=10, temperature=0)
    b = run(warm, req)
    assert b["cached"] == 3 * BS + (0 if warm.layout.hybrid else 4)
    assert b["text"] == run(cold, req)["text"]
