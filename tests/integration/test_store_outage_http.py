"""The cache store fails under a real ``serve run``: never a failed request.

The node's cache-store actor is SIGKILLed (Ray restarts it) and then frozen (SIGSTOP)
while HTTP requests run: every request answers 200 with exactly the tokens of a cold
prefill (never a 503 ``replica_lost``), the store-error counter moves, ``/v1/stats``
answers, and once the store is back the cache restores again.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.support.servers import serving, wait_for
from tests.support.threads import Threads

MODEL = "tiny-dense"
BS = 16
MODELS = [{"name": MODEL, "source": "embedded:tiny-dense", "max_tokens": 8,
           "cache": {"block_size": BS}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("outage")
    with serving(tmp, MODELS, model_home,
                 cache_store={"ssd_dir": str(tmp / "kv"), "call_timeout_s": 1.0,
                              "breaker_failures": 2, "breaker_cool_down_s": 2.0}) as proc:
        yield proc


def prompt(seed: int) -> list[int]:
    return [5 + (seed * 31 + i * 7) % 240 for i in range(3 * BS + 5)]


def complete(server, tokens: list[int]) -> tuple[int, dict]:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": tokens, "max_tokens": 8, "temperature": 0})
    return r.status_code, r.json()


def stats(server) -> dict:
    r = httpx.get(f"{server.base_url}/v1/stats", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["models"][MODEL]


def errors(server) -> int:
    return sum(stats(server)["cache"]["store_errors_by_kind"].values())


def many(server, prompts: list[list[int]], fault=None) -> list[tuple[int, dict]]:
    """Requests at once; ``fault()`` strikes once the engine runs one of them (or all have
    ended already)."""
    out: dict[int, tuple[int, dict]] = {}

    def one(i: int) -> None:
        out[i] = complete(server, prompts[i])

    threads = Threads()
    for i in range(len(prompts)):
        threads.start(one, i)
    if fault is not None:
        wait_for(lambda: stats(server)["engine"]["in_flight"] > 0
                 or not any(t.is_alive() for t in threads.threads),
                 "the requests in flight", 60, interval=0.01)
        fault()
    threads.join(180)
    return [out[i] for i in range(len(prompts))]


def cached_again(server, tokens: list[int], deadline_s: float = 90.0) -> dict:
    def restored() -> dict | None:
        status, body = complete(server, tokens)
        assert status == 200, body
        return body if body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 else None

    return wait_for(restored, lambda: f"a restore again: {stats(server)['cache']}",
                    deadline_s, interval=0.3)


def text(body: dict) -> str:
    return body["choices"][0]["text"]


def test_a_killed_then_frozen_store_never_fails_a_request(server):
    p = prompt(1)
    status, cold = complete(server, p)
    assert status == 200
    assert text(cached_again(server, p)) == text(cold)  # the cache works, same tokens
    pid = stats(server)["cache_store"]["pid"]

    # Killed (SIGKILL: Ray restarts the detached actor) while requests run.
    prompts = [p, prompt(2), p, prompt(3), p]
    outs = many(server, prompts, fault=lambda: os.kill(pid, signal.SIGKILL))
    outs += many(server, [p, prompt(4)])
    for status, body in outs:
        assert status == 200, body
    assert all(text(b) == text(cold) for (_, b), q in zip(outs, [*prompts, p, prompt(4)],
                                                           strict=True) if q == p)
    again = cached_again(server, p)  # a store answers again: the cache restores again
    assert text(again) == text(cold)
    new_pid = stats(server)["cache_store"]["pid"]
    assert new_pid != pid
    # The restarted store was told again which model this node serves.
    wait_for(lambda: stats(server)["cache_store"]["served_models"] == [MODEL],
             lambda: f"the model told again: {stats(server)['cache_store']}", 30, 0.2)

    # Frozen while requests run: each waits at most the call timeout, then goes cold.
    before = errors(server)
    q = prompt(5)
    status, q_cold = complete(server, q)
    assert status == 200
    try:
        outs = many(server, [p, q, p, q], fault=lambda: os.kill(new_pid, signal.SIGSTOP))
        outs += many(server, [p, q])
        for status, body in outs:
            assert status == 200, body
        for (_, body), tokens in zip(outs, [p, q, p, q, p, q], strict=True):
            assert text(body) == text(cold if tokens == p else q_cold)
        frozen = stats(server)  # /v1/stats answers while the store is still frozen
        assert "unavailable" in frozen["cache_store"]
        assert sum(frozen["cache"]["store_errors_by_kind"].values()) > before
        assert frozen["cache"]["misses_by_reason"].get("store_unavailable", 0) > 0
    finally:
        os.kill(new_pid, signal.SIGCONT)
    status, cold6 = complete(server, prompt(6))
    assert status == 200
    assert text(cached_again(server, prompt(6))) == text(cold6)
