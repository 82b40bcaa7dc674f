"""A hardened request path without a server: the prefix router's fallback when Serve has
no stats or it raises, what the prompt bound counts, the grammar limits that refuse a
pathological schema and the bounded prepare stage (the live 400/413/429/504 answers are
tests/integration/test_request_limits.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from types import SimpleNamespace

import llguidance
import pytest

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

# An allOf of four 8-way anyOfs (2.8 KB): 2 s to compile under llguidance's defaults.
PATHOLOGICAL = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
    "type": "integer"}}, "required": [f"a{j}_{i}"]} for i in range(8)]} for j in range(4)]}


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
    router.model, router.load_cost_tokens, router.routers = "m", 512.0, 1
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
