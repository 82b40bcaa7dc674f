"""A cache store that dies or freezes mid-run never fails a request, on a real Ray.

A model service talks to a real cache-store actor through ``RayCacheClient`` (as a
replica does). The store is killed (``ray.kill``) or frozen (SIGSTOP of its process)
while requests run: every request still completes, with exactly the tokens of a cold
prefill, the store-error counter moves, and once a store answers again (a replacement
the client creates, or the thawed one) requests restore from the cache again.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import mlx_lm
import pytest
import ray

from serve_app.cache.client import CircuitBreaker
from serve_app.config.profile import CacheStoreProfile, ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.request import CompletionRequest
from serve_app.serving.service import ModelService
from serve_app.store.actor import get_or_create_actor
from serve_app.store.client import RayCacheClient
from tests.support.engine import run
from tests.support.servers import wait_for

BS = 16
TIMEOUT_S = 1.0
COOL_DOWN_S = 1.0
CONFIG = CacheStoreProfile(hot_budget=1 << 26, ssd=False, directory="off")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = materialize("tiny-dense", tmp_path_factory.mktemp("m"))
    loaded, tokenizer = mlx_lm.load(str(path))
    return loaded, tokenizer, path


@pytest.fixture
def served(local_ray, model):
    """A warm service on the node's real store actor (recreated by the client when it
    dies, as a replica does) and a cold one without a cache."""
    loaded, tokenizer, path = model
    actor = get_or_create_actor(CONFIG, timeout=60)
    client = RayCacheClient(actor, timeout=TIMEOUT_S,
                            reconnect=lambda: get_or_create_actor(CONFIG, timeout=60),
                            breaker=CircuitBreaker(2, COOL_DOWN_S))
    warm = ModelService(ModelProfile(name="warm", source="embedded:tiny-dense",
                                     cache={"block_size": BS}), loaded, tokenizer, path, client)
    cold = ModelService(ModelProfile(name="cold", source="embedded:tiny-dense",
                                     cache={"enabled": False}), loaded, tokenizer, path, None)
    client.activate("warm", warm.cache.identity, warm.layout.digest, timeout=60)
    try:
        yield warm, cold, client
    finally:
        client.close()  # no replacement for the store killed next
        warm.shutdown()
        cold.shutdown()
        ray.kill(client.actor, no_restart=True)


def prompt(seed: int) -> list[int]:
    return [5 + (seed * 31 + i * 7) % 240 for i in range(3 * BS + 5)]


def ask(service: ModelService, tokens: list[int]) -> dict:
    return run(service, CompletionRequest(model="m", prompt=tokens, max_tokens=6,
                                          temperature=0))


def ask_many(service: ModelService, prompts: list[list[int]], fault=None) -> list[dict]:
    """Requests at once, each on its own event loop (as concurrent as the engine allows);
    ``fault()`` strikes once the engine runs one of them (or all have ended already)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(ask, service, p) for p in prompts]
        if fault is not None:
            wait_for(lambda: service.engine.stats.in_flight > 0
                     or all(f.done() for f in futures), "the requests in flight", 60, 0.005)
            fault()
        return [f.result(timeout=120) for f in futures]


def errors(service: ModelService) -> int:
    return sum(service.cache_stats.store_errors_by_kind.values())


def cached_again(service: ModelService, tokens: list[int], deadline_s: float = 60.0) -> dict:
    """Ask until the cache restores again (the store is back), at most ``deadline_s``."""
    def restored() -> dict | None:
        out = ask(service, tokens)
        return out if out["cached"] > 0 else None

    return wait_for(restored, lambda: f"a restore again: {service.cache_stats.summary()}",
                    deadline_s, interval=0.2)


def test_a_killed_store_is_a_cold_prefill_then_is_replaced(served):
    warm, cold, client = served
    p = prompt(1)
    first = ask(warm, p)
    assert ask(warm, p)["cached"] >= 3 * BS  # the store works
    old = client.actor
    prompts = [p, prompt(2), prompt(3), p, prompt(9), prompt(10)]
    outs = ask_many(warm, prompts, fault=lambda: ray.kill(old, no_restart=True))
    outs += ask_many(warm, [p, prompt(11)])  # and right after: the store is dead
    prompts += [p, prompt(11)]
    for tokens, out in zip(prompts, outs, strict=True):
        assert out["text"] == ask(cold, tokens)["text"]
        assert out["finish_reason"] in ("stop", "length")
    assert outs[0]["text"] == first["text"]
    assert errors(warm) > 0
    summary = warm.cache_stats.summary()
    assert summary["misses_by_reason"].get("store_unavailable", 0) > 0
    # The client finds a replacement store (created by this "replica"); the cache
    # works again: the first request fills it, the next one restores from it.
    again = cached_again(warm, p)
    assert again["text"] == first["text"]
    assert client.actor is not old and client.reconnects >= 1
    stats = run_stats(warm)
    assert "unavailable" not in stats["cache_store"]


def run_stats(service: ModelService) -> dict:
    import asyncio

    return asyncio.run(service.stats())


def test_a_frozen_store_is_a_cold_prefill_and_never_blocks_the_engine(served):
    warm, cold, client = served
    p = prompt(4)
    first = ask(warm, p)
    assert ask(warm, p)["cached"] >= 3 * BS
    pid = ray.get(client.actor.pid.remote(), timeout=30)
    try:
        prompts = [p, prompt(5), prompt(6), p, prompt(7), prompt(8)]
        # Frozen mid-run (some lookups may have been answered already), then more. All
        # of them end while the store stays frozen: none waited on it past its call
        # timeout (a wait without one would never return), the engine never on the store.
        outs = ask_many(warm, prompts, fault=lambda: os.kill(pid, signal.SIGSTOP))
        outs += ask_many(warm, [p, prompt(12)])
        prompts += [p, prompt(12)]
        for tokens, out in zip(prompts, outs, strict=True):
            assert out["text"] == ask(cold, tokens)["text"]
        assert outs[-2]["cached"] == 0  # p again, with the store frozen: cold
        kinds = warm.cache_stats.store_errors_by_kind
        assert kinds["timeout"] >= 1, kinds  # they were cut by the call timeout
        # Stats answer too, the store still frozen: it shows as unavailable.
        stats = run_stats(warm)
        assert "unavailable" in stats["cache_store"]
        # Blocks captured meanwhile were dropped and counted, not waited for.
        assert stats["cache_store"]["publisher"]["dropped"] > 0 or client._queue.qsize() > 0
    finally:
        os.kill(pid, signal.SIGCONT)
    # Thawed: after the breaker's cool-down the cache restores again, same tokens.
    again = cached_again(warm, p)
    assert again["text"] == first["text"]


def test_an_engine_publish_never_waits_on_a_frozen_store(served):
    """The engine thread hands captured blocks over with ``wait=False``: with the
    publisher stuck behind a frozen store and the queue full, a publish returns at
    once and the block is counted as dropped."""
    warm, _, client = served
    pid = ray.get(client.actor.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        from tests.support.blocks import block

        before = client.dropped
        asked_to_wait: list[bool] = []  # each put into the publish queue: may it wait?
        real_put = client._queue.put

        def put(item, block=True, timeout=None):
            asked_to_wait.append(block)
            return real_put(item, block=block, timeout=timeout)

        client._queue.put = put
        try:
            for i in range(400):  # more than the queue holds
                warm.cache.publish(block(i))
        finally:
            del client._queue.put
        assert asked_to_wait and not any(asked_to_wait), "a publish waited for room"
        assert client.dropped > before
    finally:
        os.kill(pid, signal.SIGCONT)
