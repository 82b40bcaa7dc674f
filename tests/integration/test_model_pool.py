"""The model pool over real HTTP (``serve run``, the ``openai`` client): three embedded
models with ``memory.max_loaded_models: 2``, one pinned and one with ``idle_unload_s``.

All three answer in turn while at most two are loaded (the pinned one always); the least
recently used idle model makes room; an unloaded model's conversation comes back from
the SSD tier exactly; the idle one unloads on its timer and answers again; an unload
frees at least the weights' bytes of the replica's resident memory; a model that is
serving a request is never unloaded (a long stream while the pool churns), and when
nothing can make room the request gets 503 ``model_capacity`` with Retry-After.

The tests share one server and run in any order: each first asks for the models it
needs loaded (the pool's state at start is recorded when the server is up, before any
test), and reads counters as deltas or after causing what they count."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from bench.devserver import ServerProcess
from tests.support.clients import chat, openai_client
from tests.support.servers import serving, wait_for
from tests.support.threads import Threads

PINNED = "pool-pinned"  # tiny-dense, never unloaded
IDLE = "pool-idle"  # tiny-hybrid, unloaded after IDLE_S without requests
THIRD = "pool-third"  # tiny-hybrid-q4, not loaded at start (no room under the cap)
IDLE_S = 5
BS = 16
MODELS = [
    {"name": PINNED, "source": "embedded:tiny-dense", "pinned": True,
     "context_length": 4096, "max_tokens": 4000, "cache": {"block_size": BS}},
    {"name": IDLE, "source": "embedded:tiny-hybrid", "idle_unload_s": IDLE_S,
     "context_length": 1024, "cache": {"block_size": BS}},
    {"name": THIRD, "source": "embedded:tiny-hybrid-q4", "context_length": 4096,
     "max_tokens": 4000, "cache": {"block_size": BS}},
]


@pytest.fixture(scope="module")
def started(tmp_path_factory, model_home) -> Iterator[tuple[ServerProcess, dict]]:
    """The server, and its ``/v1/models`` statuses and ``/v1/stats`` once it was up (before
    any test asked anything)."""
    tmp = tmp_path_factory.mktemp("pool_server")
    # Ready through /v1/stats (generate=False): a completion would load the third model.
    with serving(tmp, MODELS, model_home, generate=False,
                 cache_store={"ssd_dir": str(tmp / "kv")},
                 memory={"max_loaded_models": 2}) as proc:
        yield proc, {"statuses": statuses(proc), "stats": stats(proc)}


@pytest.fixture(scope="module")
def server(started) -> ServerProcess:
    return started[0]


def client(server: ServerProcess) -> OpenAI:
    return openai_client(server, "k")


def statuses(server: ServerProcess) -> dict[str, str]:
    r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    r.raise_for_status()
    return {m["id"]: m["status"] for m in r.json()["data"]}


def stats(server: ServerProcess) -> dict:
    r = httpx.get(f"{server.base_url}/v1/stats", timeout=60)
    r.raise_for_status()
    return r.json()


def ask(server: ServerProcess, model: str, messages: list[dict],
        max_tokens: int = 8) -> ChatCompletion:
    return chat(client(server), model, messages, max_tokens)


def hello(model: str) -> list[dict]:
    return [{"role": "user", "content": f"Hello {model}, a short answer please."}]


def loaded(server: ServerProcess) -> set[str]:
    return {name for name, status in statuses(server).items() if status == "loaded"}


class Watch:
    """``/v1/models`` sampled on a thread: the most models ever loaded at once, and
    whether the pinned one was ever not loaded."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.most, self.pinned_out = server, 0, []
        self._stop = threading.Event()
        self._thread = Threads()

    def __enter__(self) -> Watch:
        self._thread.start(self._run)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)  # the sampler's own failure, if any, fails the test

    def _run(self) -> None:
        while not self._stop.is_set():
            now = statuses(self.server)
            in_memory = [n for n, s in now.items() if s != "unloaded"]
            self.most = max(self.most, len(in_memory))
            if now[PINNED] != "loaded":
                self.pinned_out.append(now)
            time.sleep(0.05)


def test_at_start_the_pinned_and_the_next_model_are_loaded(started):
    _, at_start = started
    assert at_start["statuses"] == {PINNED: "loaded", IDLE: "loaded", THIRD: "unloaded"}
    pool = at_start["stats"]["pool"]
    assert pool["max_loaded_models"] == 2 and pool["loaded"] == [PINNED, IDLE]
    assert pool["models"][PINNED]["pinned"] and pool["models"][IDLE]["idle_unload_s"] == IDLE_S
    # An unloaded model's replica answers /v1/stats without its model.
    third = at_start["stats"]["models"][THIRD]
    assert third["replica"]["status"] == "unloaded" and "engine" not in third


def test_all_three_answer_in_turn_with_at_most_two_loaded(server):
    before = stats(server)["pool"]["models"]
    with Watch(server) as watch:
        for model in (THIRD, IDLE, PINNED, THIRD, PINNED, IDLE):
            reply = ask(server, model, hello(model))
            assert reply.choices[0].message.content is not None
            now = loaded(server)
            assert model in now and PINNED in now and len(now) <= 2, (model, now)
    assert watch.most <= 2 and not watch.pinned_out
    pool = stats(server)["pool"]["models"]

    def more(model: str, *keys: str) -> int:
        now, then = pool[model], before[model]
        for key in keys:
            now, then = now[key], then[key]
        return now - then

    # The unpinned two made room for each other, the least recently used first: THIRD
    # for IDLE twice (its 2nd and 6th requests), IDLE for THIRD once (the 4th).
    assert more(THIRD, "unloads", "capacity") >= 2 and more(IDLE, "unloads", "capacity") >= 1
    assert pool[PINNED]["unloads"] == {"capacity": 0, "idle": 0, "admin": 0}
    assert more(THIRD, "loads") >= 1


def test_a_reloaded_model_restores_its_conversation_from_ssd_exactly(server):
    messages = [{"role": "system", "content": "You are the pool's SSD restore test. " * 12},
                {"role": "user", "content": "Tell me about the third model."}]
    first = ask(server, THIRD, messages, max_tokens=16)
    prompt = first.usage.prompt_tokens
    # The other unpinned model takes THIRD's place; THIRD's blocks leave RAM for SSD.
    ask(server, IDLE, hello(IDLE))
    assert statuses(server)[THIRD] == "unloaded"
    again = ask(server, THIRD, messages, max_tokens=16)
    assert again.usage.prompt_tokens_details.cached_tokens > prompt // 2
    assert again.choices[0].message.content == first.choices[0].message.content
    cache = stats(server)["models"][THIRD]["cache"]
    assert cache["hit_tokens_by_tier"].get("ssd", 0) > prompt // 2
    assert cache["restore_failures"] == 0 and cache["incompatible_payloads"] == 0


def test_the_idle_model_unloads_after_its_timeout_and_answers_again(server):
    ask(server, IDLE, hello(IDLE))
    assert statuses(server)[IDLE] == "loaded"
    before = stats(server)["pool"]["models"][IDLE]["unloads"]["idle"]
    wait_for(lambda: statuses(server)[IDLE] == "unloaded",
             lambda: f"{IDLE} unloaded on its idle timer: {stats(server)['pool']}", IDLE_S + 10)
    waited = stats(server)["pool"]["models"][IDLE]
    assert waited["unloads"]["idle"] == before + 1 and waited["idle_s"] >= IDLE_S
    reply = ask(server, IDLE, hello(IDLE))
    assert reply.choices[0].message.content is not None
    assert statuses(server)[IDLE] == "loaded"


def test_an_unload_frees_at_least_the_weights(server):
    ask(server, THIRD, hello(THIRD))  # loaded (IDLE makes room)
    ask(server, THIRD, hello(THIRD))
    before = stats(server)["models"][THIRD]["replica"]
    assert before["status"] == "loaded"
    weights = before["memory"]["planned"]["weights_bytes"]
    ask(server, IDLE, hello(IDLE))  # THIRD makes room
    after = stats(server)["models"][THIRD]["replica"]
    assert after["status"] == "unloaded" and after["pid"] == before["pid"]
    freed = before["memory"]["process_rss_bytes"] - after["memory"]["process_rss_bytes"]
    print(f"unload freed {freed} bytes of resident memory; weights {weights}")
    assert freed >= weights, (freed, weights)


def test_nothing_in_flight_is_unloaded_and_a_full_pool_answers_503(server):
    """A long stream on the unpinned loaded model: a request for the third model finds
    no room (the pinned one and a busy one) and gets 503 ``model_capacity``; the stream
    ends whole. Then a long stream on the pinned model while the other two churn."""
    ask(server, THIRD, hello(THIRD))  # PINNED and THIRD loaded, IDLE unloaded
    long = [{"role": "user", "content": "Write a very long story."}]
    stream = client(server).chat.completions.create(
        model=THIRD, messages=long, max_tokens=600, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].delta is not None
    with pytest.raises(openai.APIStatusError) as info:
        ask(server, IDLE, hello(IDLE))
    assert info.value.status_code == 503
    body = info.value.response.json()["error"]
    assert body["code"] == "model_capacity" and IDLE in body["message"]
    assert int(info.value.response.headers["Retry-After"]) >= 1
    finish, n = drain(chunks)
    assert finish == "length" and n >= 590
    assert statuses(server)[THIRD] == "loaded"

    # The pinned model streams while the other two take turns in the second slot.
    stream = client(server).chat.completions.create(
        model=PINNED, messages=long, max_tokens=2000, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)
    for model in (IDLE, THIRD, IDLE):
        ask(server, model, hello(model))
    finish, n = drain(chunks)
    assert finish == "length" and n >= 1990


def drain(chunks) -> tuple[str | None, int]:
    """Read a stream to its end: its finish reason and its completion tokens."""
    finish, n = None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finish = choice.finish_reason
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return finish, n


def test_pool_metrics(server):
    """Each replica exports its model's pool metrics (its metrics pump, every second)."""
    # What the metrics count, caused here: THIRD loaded (IDLE or nothing makes room), then
    # unloaded for IDLE (capacity), then IDLE unloaded on its idle timer.
    ask(server, THIRD, hello(THIRD))
    ask(server, IDLE, hello(IDLE))
    wait_for(lambda: statuses(server)[IDLE] == "unloaded", f"{IDLE} unloaded when idle",
             IDLE_S + 10)
    mismatched: dict = {}

    def exported() -> dict[tuple, float] | None:
        # The ingress's counts, read again each time: an idle timer may unload a model
        # between two reads.
        pool = stats(server)["pool"]["models"]
        assert pool[THIRD]["loads"] >= 1 and pool[IDLE]["unloads"]["idle"] >= 1
        assert pool[THIRD]["unloads"]["capacity"] >= 1
        want = {("ray_serve_app_model_loaded", PINNED): 1.0,
                ("ray_serve_app_model_loads_total", THIRD): pool[THIRD]["loads"],
                ("ray_serve_app_model_unloads_total", IDLE, "idle"):
                    pool[IDLE]["unloads"]["idle"],
                ("ray_serve_app_model_unloads_total", THIRD, "capacity"):
                    pool[THIRD]["unloads"]["capacity"],
                ("ray_serve_app_model_loads_total", PINNED): 0}
        samples = metric_lines(server)
        mismatched.clear()
        mismatched.update({k: (v, samples.get(k)) for k, v in want.items()
                           if samples.get(k) != v})
        return None if mismatched else samples

    # The pumps publish every second, Ray exports every few.
    samples = wait_for(exported, lambda: f"the pool's metrics: {mismatched}", 60, interval=1)
    assert samples[("ray_serve_app_model_load_seconds_total", THIRD)] > 0


def metric_lines(server: ServerProcess) -> dict[tuple, float]:
    """The pool's series in ``/metrics``, by (name, model[, reason])."""
    out: dict[tuple, float] = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=60).text.splitlines():
        if not line.startswith("ray_serve_app_model_"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if "=" in p)
        key = (name, pairs.get("model", "").strip('"'))
        if "reason" in pairs:
            key += (pairs["reason"].strip('"'),)
        out[key] = out.get(key, 0) + float(value)
    return out
