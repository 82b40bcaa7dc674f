"""A hardened request path: every bad input is a 400 (or 413/429/504) in the API's own
shape, before any expensive work, and the server keeps serving.

One server of its own (``serve run``): a prefix-routed model with two replicas (the
ingress templates its requests, the router picks a replica) and a one-replica model
with one batch slot, each with a tiny queue, and a 3-second request timeout. Tests
that need no server check the router's fallback, the grammar limits and the prompt
bound's arithmetic.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from types import SimpleNamespace

import httpx
import llguidance
import pytest

from bench.devserver import ServerProcess, free_port, write_config
from serve_app.cache.hashing import salted_root
from serve_app.cache.match import Tier
from serve_app.cluster.routing import REASONS, PrefixAffinityRouter, ReplicaInfo
from serve_app.metrics.table import Recorder
from serve_app.serving.prepare import PreparedRequest
from serve_app.serving.request import (
    MESSAGE_OVERHEAD_CHARS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_size,
)
from serve_app.serving.structured import (
    GRAMMAR_LIMITS,
    StructuredOutputError,
    compile_response_format,
)
from tests.support.servers import running

ROUTED = "limits-routed"
SLOW = "limits-slow"
MAX_MESSAGES = 8
TIMEOUT_S = 3.0
MODELS = [
    {"name": ROUTED, "source": "embedded:tiny-dense", "context_length": 4096,
     "num_replicas": 2, "routing": {"mode": "prefix"}, "max_batch_size": 1,
     "max_queued_requests": 0, "max_tokens": 4000, "max_messages": MAX_MESSAGES,
     "cache": {"block_size": 16}},
    # Default max_messages (4096); one slot and two queued requests.
    {"name": SLOW, "source": "embedded:tiny-dense", "context_length": 4096,
     "max_batch_size": 1, "max_queued_requests": 2, "max_tokens": 4000,
     "cache": {"enabled": False}},
]
# Never satisfiable: compiling it fails, in the prepare stage (a 400 when it runs).
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "bad",
                                                     "schema": {"type": "nonsense"}}}
# An allOf of four 8-way anyOfs (2.8 KB): 2 s to compile under llguidance's defaults.
PATHOLOGICAL = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
    "type": "integer"}}, "required": [f"a{j}_{i}"]} for i in range(8)]} for j in range(4)]}


@pytest.fixture(scope="module")
def limited(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("limits")
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, MODELS,
                          ingress={"num_cpus": 0, "request_timeout_s": TIMEOUT_S},
                          cache_store={"ssd_dir": str(tmp / "kv")})
    with running(ServerProcess.serve_run(config, port, tmp / "serve.log",
                                     env={"SERVE_APP_HOME": str(model_home)}),
                 [ROUTED, SLOW]) as server:
        yield server


def post(server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("timeout", 120)
    return httpx.post(f"{server.base_url}{path}", content=content,
                      headers={"Content-Type": "application/json", "x-api-key": "k",
                               "anthropic-version": "2023-06-01"}, **kw)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def chat(model: str, content: str = "hello", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **extra}


def messages_body(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}], **extra}


def stats(server, model: str) -> dict:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"][model]


def post_admitted(server, path: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    """``post``, again after each 429 (a replica still busy with a stream just closed:
    Serve may route there before it has seen the cancellation)."""
    deadline = time.monotonic() + timeout
    while True:
        r = post(server, path, body)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def assert_serving(server, model: str) -> None:
    r = post_admitted(server, "/v1/chat/completions", chat(model, uuid.uuid4().hex))
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1


def wait_idle(server, model: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server, model)
        if s["engine"]["in_flight"] == 0:
            return s
        assert time.monotonic() < deadline, s["engine"]
        time.sleep(0.1)


class Held:
    """Streams of ``max_tokens`` 4000 held open (each admitted: its headers came), closed
    on exit, so the model's slot and queue stay full meanwhile."""

    def __init__(self, server, model: str, n: int) -> None:
        self.server, self.model, self.n = server, model, n
        self.ready = threading.Barrier(n + 1)
        self.stop = threading.Event()
        self.statuses: list[int] = []

    def _hold(self) -> None:
        body = {**chat(self.model, uuid.uuid4().hex), "max_tokens": 4000, "stream": True}
        for _ in range(50):  # Serve's router may pick a busy replica: its engine says 429
            with httpx.stream("POST", f"{self.server.base_url}/v1/chat/completions",
                              json=body, timeout=120) as r:
                if r.status_code == 429 and self.model == ROUTED:
                    time.sleep(0.1)
                    continue
                self.statuses.append(r.status_code)
                self.ready.wait(60)
                self.stop.wait(120)
                return

    def __enter__(self) -> Held:
        self.threads = [threading.Thread(target=self._hold) for _ in range(self.n)]
        for t in self.threads:
            t.start()
            time.sleep(0.3)  # in order: the first takes the slot
        self.ready.wait(60)
        assert self.statuses == [200] * self.n, self.statuses
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


# ---- cache_salt ------------------------------------------------------------------------


class _Replica(SimpleNamespace):
    pass


class Counting(Recorder):
    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], float] = {}

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None:
        key = (name, labels.get("reason", ""))
        self.counts[key] = self.counts.get(key, 0) + value


def _router() -> PrefixAffinityRouter:
    """The router's own state without Ray Serve's constructor (it needs a live handle)."""
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router.model, router.load_cost_tokens = "m", 512.0
    router.follower = SimpleNamespace(prefix_by_node=lambda ids: {})
    router.recorder = Counting()
    router.ongoing, router.decided, router.error_logged = {}, OrderedDict(), False
    router.layout = None
    router.suspects = {}
    return router


def _pending(rid: str, prompt: list[int]):
    prepared = PreparedRequest(prompt=prompt, params=None, stops=[], salt=None)
    return SimpleNamespace(args=[prepared], metadata=SimpleNamespace(internal_request_id=rid))


def test_a_router_ranks_on_a_layout_it_saw_when_serve_has_no_stats_for_a_replica():
    """Serve hands a router each replica's stats as it last polled them, and a replica
    it has not polled yet (or whose report was lost) has none: the router ranks on the
    layout another replica (or an earlier poll) gave, the node Serve placed it on and its
    own count of requests; before any report it routes to the least loaded (``unranked``)."""
    router = _router()
    router.load_cost_tokens = 1  # a request costs less than the prefix saves
    prompt = list(range(64))
    bare = [_Replica(replica_id=f"r{i}", node_id=f"n{i}", routing_stats={}) for i in range(2)]
    router.ongoing = {"r0": 1}
    chosen = asyncio.run(router.choose_replicas(bare, _pending("a", prompt)))
    assert [c[0].replica_id for c in chosen] == ["r1", "r0"]
    assert router.recorder.counts == {("serve_app_routing_decisions", "unranked"): 1}

    info = ReplicaInfo("n1", "root", 16, 4).to_stats()
    # one replica reports: its layout is kept
    asyncio.run(router.choose_replicas(
        [bare[0], _Replica(replica_id="r1", node_id="n1", routing_stats=info)],
        _pending("b", prompt)))
    # n0 holds the prompt's blocks; no replica has stats now: r0 is still ranked first,
    # for its prefix, though it runs a request more than r1.
    router.follower = SimpleNamespace(prefix_by_node=lambda block_ids: {"n0": [Tier.HOT] * 3})
    router.recorder = Counting()
    chosen = asyncio.run(router.choose_replicas(bare, _pending("c", prompt)))
    assert [c[0].replica_id for c in chosen] == ["r0", "r1"]
    assert router.recorder.counts == {("serve_app_routing_decisions", "prefix"): 1}


def test_a_router_that_raises_falls_back_to_the_least_loaded_replica(caplog):
    """Ray never resolves a request whose choose_replicas raises: ours cannot raise."""
    router = _router()
    info = ReplicaInfo("n0", "root", 16, 4).to_stats()
    replicas = [_Replica(replica_id=f"r{i}", node_id="n0", routing_stats=info)
                for i in range(3)]
    router.ongoing = {"r0": 2, "r1": 0, "r2": 1}
    with pytest.raises(UnicodeEncodeError):  # what the unguarded ranking would raise
        salted_root("root", "\ud800")

    def pending(salt: str | None, rid: str):
        prepared = PreparedRequest(prompt=list(range(40)), params=None, stops=[], salt=salt)
        return SimpleNamespace(args=[prepared], metadata=SimpleNamespace(
            internal_request_id=rid))

    for i in range(3):
        chosen = asyncio.run(router.choose_replicas(replicas, pending("\ud800", f"bad{i}")))
        assert [[r.replica_id] for r in (c[0] for c in chosen)] == [["r1"], ["r2"], ["r0"]]
    assert router.recorder.counts == {("serve_app_routing_decisions", "router_error"): 3}
    assert "router_error" in REASONS
    assert sum("prefix routing failed" in r.getMessage() for r in caplog.records) == 1
    # A good request is still ranked (not a fallback).
    chosen = asyncio.run(router.choose_replicas(replicas, pending("fine", "good")))
    assert len(chosen) == 3
    assert ("serve_app_routing_decisions", "no_prefix") in router.recorder.counts


# ---- timeouts ----------------------------------------------------------------------------


# ---- prompt bounds before expensive work ------------------------------------------------


def test_each_message_schemas_and_stops_count_in_the_prompt_bound():
    empty = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": ""}] * 100)
    assert empty.prompt_size() == (100 * MESSAGE_OVERHEAD_CHARS, "characters")
    with pytest.raises(ApiError) as info:
        check_prompt_size(empty, 100 * MESSAGE_OVERHEAD_CHARS - 1, 4096)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as info:
        check_prompt_size(empty, 10**9, 4096, max_messages=99)
    assert info.value.code == "too_many_messages" and info.value.param == "messages"
    base = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": PATHOLOGICAL}}
    shaped = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                   response_format=fmt, stop=["s" * 100, "t" * 50])
    extra = shaped.prompt_size()[0] - base.prompt_size()[0]
    assert extra == len(json.dumps(fmt)) + 150
    completion = CompletionRequest(model="m", prompt="abc", stop="x" * 10)
    assert completion.prompt_size() == (13, "characters")


# ---- admission before templating ---------------------------------------------------------


# ---- numbers and grammars ---------------------------------------------------------------


def with_huge(body: dict, field: str, digits: int = 5000) -> bytes:
    """``body`` with ``field`` set to an integer of ``digits`` digits, as JSON text."""
    return json.dumps({**body, field: "HUGE"}).replace('"HUGE"', "9" * digits).encode()


def test_grammar_limits_are_what_refuses_the_pathological_schema(model_home):
    from mlx_lm.utils import load_tokenizer

    from serve_app.models.embedded import materialize

    tokenizer = load_tokenizer(materialize("tiny-dense", model_home))
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PATHOLOGICAL}}
    with pytest.raises(StructuredOutputError, match="too big"):
        compile_response_format(fmt, tokenizer)
    assert GRAMMAR_LIMITS["max_grammar_size"] < llguidance.LLParserLimits().max_grammar_size
    # An ordinary schema compiles under the same limits.
    ok = {"type": "json_schema", "json_schema": {"name": "ok", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    assert compile_response_format(ok, tokenizer) is not None


def test_the_prepare_stage_admits_a_bounded_number():
    """MAX_PREPARING requests in the stage (waiting or running): the next is refused
    before it is queued; a request leaves when its work ends, or is cancelled unstarted."""
    from serve_app.deploy.stage import MAX_PREPARING, PrepareStage

    async def scenario() -> None:
        stage = PrepareStage()
        gate = threading.Event()
        tasks = [asyncio.ensure_future(stage.run(gate.wait, 30)) for _ in range(MAX_PREPARING)]
        await asyncio.sleep(0.05)
        assert stage.busy == MAX_PREPARING
        with pytest.raises(ApiError) as info:
            stage.admit("m")
        assert info.value.status == 429 and info.value.code == "queue_full"
        assert info.value.headers["Retry-After"] == "1"
        tasks[-1].cancel()  # waiting behind the two workers: cancelled unstarted
        await asyncio.sleep(0.05)
        assert stage.busy == MAX_PREPARING - 1
        stage.admit("m")
        gate.set()
        await asyncio.gather(*tasks[:-1])
        await asyncio.sleep(0.05)
        assert stage.busy == 0 and stage.runs == MAX_PREPARING
        stage.pool.shutdown()

    asyncio.run(scenario())
