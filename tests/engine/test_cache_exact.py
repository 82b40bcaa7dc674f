"""Exactness of hot-tier restores, in-process (real engine, real store, no Ray).

At temperature 0 a restored request must produce exactly the tokens of the
same request with caching disabled: after a multi-turn conversation, after a
forced walkback, with a corrupt checkpoint, and when a prompt diverges in the
middle of a block.
"""

from __future__ import annotations

import asyncio

import mlx_lm
import numpy as np
import pytest

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.match import Drop
from serve_app.cache.payload import Tensor
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.request import ChatCompletionRequest, CompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import BS, chat, make_services, run


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def services(request, tmp_path_factory):
    warm, cold, client = make_services(request.param, tmp_path_factory.mktemp("m"))
    yield warm, cold, client
    warm.shutdown()
    cold.shutdown()


@pytest.fixture(scope="module")
def hybrid_services(tmp_path_factory):
    """Walkbacks need recurrent checkpoints, which only the hybrid model has."""
    warm, cold, client = make_services("tiny-hybrid", tmp_path_factory.mktemp("h"))
    assert warm.layout.hybrid
    yield warm, cold, client
    warm.shutdown()
    cold.shutdown()


@pytest.fixture(params=["tiny-dense", "tiny-hybrid"])
def fresh_services(request, tmp_path):
    """Services of their own: a store that no other test has captured into."""
    warm, cold, client = make_services(request.param, tmp_path)
    yield warm, cold, client
    warm.shutdown()
    cold.shutdown()


def test_multi_turn_restores_and_matches_cold(fresh_services):
    """The store's bytes are what was captured less what was evicted: counted from a store
    of its own (another test's repeated captures would count twice)."""
    warm, cold, _ = fresh_services
    messages = [{"role": "system", "content": "You are terse. " * 6}]
    previous_prompt = 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more"})
        a, b = run(warm, chat(messages)), run(cold, chat(messages))
        assert a["text"] == b["text"]
        assert a["completion_tokens"] == b["completion_tokens"]
        if turn:
            assert a["cached"] >= (previous_prompt // BS) * BS > 0
            assert a["cached"] < len(a["prompt"])
        previous_prompt = len(a["prompt"])
        messages.append({"role": "assistant", "content": a["text"]})
    stats = asyncio.run(warm.stats())
    assert stats["cache"]["hit_tokens"] > 0
    assert stats["engine"]["captured_blocks"] > 0
    assert stats["cache_store"]["bytes"] == stats["engine"]["captured_bytes"] - \
        stats["cache_store"]["evicted_bytes"]


def test_retry_restores_all_but_the_last_token(services):
    warm, cold, _ = services
    prompt = list(range(1, 3 * BS + 1))  # exactly three blocks
    req = CompletionRequest(model="m", prompt=prompt, max_tokens=12, temperature=0)
    first = run(warm, req)
    again = run(warm, req)
    # Two full blocks and the tail captured at the prompt's end: one token is computed.
    assert again["cached"] == 3 * BS - 1
    assert first["text"] == again["text"] == run(cold, req)["text"]


def test_prompt_diverging_mid_block(services):
    warm, cold, _ = services
    base = [7 + (i * 13) % 200 for i in range(5 * BS)]
    run(warm, CompletionRequest(model="m", prompt=base, max_tokens=4, temperature=0))
    split = 2 * BS + BS // 2  # in the middle of the third block
    other = base[:split] + [(t + 1) % 250 for t in base[split:]]
    req = CompletionRequest(model="m", prompt=other, max_tokens=16, temperature=0)
    a = run(warm, req)
    # An attention-only model cuts the stored third block to the tokens it shares;
    # a hybrid one restores to the block boundary, where its checkpoint is.
    restored = 2 * BS if warm.layout.hybrid else split
    assert a["cached"] == restored
    assert a["text"] == run(cold, req)["text"]
    assert warm.cache_stats.last_miss_reason == f"diverged at token {restored}"


def cached_prompt(warm: ModelService, prompt: list[int]):
    """Serve ``prompt`` once so its blocks are cached; return the request and block ids."""
    req = CompletionRequest(model="m", prompt=prompt, max_tokens=16, temperature=0)
    run(warm, req)
    return req, chain(salted_root(warm.cache.root, None), prompt, BS)


def test_forced_walkback_drops_one_block_and_stays_exact(hybrid_services):
    warm, cold, client = hybrid_services
    prompt = [3 + (i * 7) % 240 for i in range(4 * BS + 3)]
    _, ids = cached_prompt(warm, prompt)
    client.store.drop(Drop.CHECKPOINT, "", ids[3])  # the newest boundary
    # Other last tokens: the tail captured at the first prompt's end does not apply.
    other = prompt[:-3] + [9, 8, 7]
    req = CompletionRequest(model="m", prompt=other, max_tokens=16, temperature=0)
    before = warm.cache_stats.walkbacks
    a = run(warm, req)
    assert warm.cache_stats.walkbacks == before + 1
    assert a["cached"] == 3 * BS
    assert a["text"] == run(cold, req)["text"]


def test_corrupt_checkpoint_is_rejected_and_walked_back(hybrid_services):
    warm, cold, client = hybrid_services
    req, ids = cached_prompt(warm, [11 + (i * 5) % 230 for i in range(3 * BS + 1)])
    payload = client.store.hot.entry(ids[2]).handle
    layer = next(iter(payload.state))
    first, *rest = payload.state[layer]
    payload.state[layer] = (Tensor(np.full_like(first.data, np.nan), first.dtype), *rest)
    rejects = warm.cache_stats.checkpoint_rejects
    a = run(warm, req)
    assert warm.cache_stats.checkpoint_rejects == rejects + 1
    assert a["cached"] == 2 * BS
    assert a["text"] == run(cold, req)["text"]


def test_salts_isolate(services):
    warm, _, _ = services
    messages = [{"role": "user", "content": "salted " * 10}]
    run(warm, ChatCompletionRequest(model="m", messages=messages, max_tokens=2,
                                    cache_salt="tenant-a"))
    other = run(warm, ChatCompletionRequest(model="m", messages=messages, max_tokens=2,
                                            cache_salt="tenant-b"))
    same = run(warm, ChatCompletionRequest(model="m", messages=messages, max_tokens=2,
                                           cache_salt="tenant-a"))
    assert other["cached"] == 0 and same["cached"] > 0


def test_disabled_cache_says_why(services):
    _, cold, _ = services
    stats = asyncio.run(cold.stats())
    assert stats["cache"]["enabled"] is False
    assert stats["cache"]["disabled_reason"] == "caching disabled in the profile"
    assert stats["engine"]["captured_blocks"] == 0


class SlowAnswer(LocalCacheClient):
    """The store grants the lease, then the answer comes back only when ``answer`` is set
    (as an actor reply can be late): a client that hangs up meanwhile must not leave it
    pinned."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(store)
        self.granted = asyncio.Event()
        self.answer = asyncio.Event()

    async def _match(self, q):
        found = self.store.match(q)
        self.granted.set()
        await self.answer.wait()
        return found


def test_disconnect_during_lookup_leaks_no_lease(tmp_path):
    path = materialize("tiny-dense", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    store = TieredStore(1 << 30)
    client = SlowAnswer(store)
    service = ModelService(ModelProfile(name="warm", source="embedded:tiny-dense",
                                        cache={"block_size": BS}), model, tokenizer, path,
                           client)
    prompt = [7 + i % 200 for i in range(3 * BS + 2)]
    req = CompletionRequest(model="m", prompt=prompt, max_tokens=2, temperature=0)
    client.answer.set()
    run(service, req)  # its blocks are cached now

    async def hang_up():
        client.granted, client.answer = asyncio.Event(), asyncio.Event()
        stream = service.stream(service.prepare(req))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait_for(client.granted.wait(), 30)  # the answer is on the way
        assert store._leases  # pinned right now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        client.answer.set()  # the late answer arrives after the hang-up
        for _ in range(1000):  # the lookup's own task ends and gives its lease back
            if not store._leases:
                break
            await asyncio.sleep(0.01)

    asyncio.run(hang_up())
    assert not store._leases and store.snapshot()["pinned_blocks"] == 0
    service.shutdown()
