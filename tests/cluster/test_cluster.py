"""One model, two Ray nodes, one prefix cache: ``serve run`` on a real multi-node cluster.

Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), each with its own SSD
directory and one replica (pinned by a custom resource), routed by the
prefix-affinity router, driven over HTTP by the real ``openai`` client:

- a conversation's next turn goes to the replica whose node holds its prefix;
- a replica whose batch is full is passed over (the guard), and the replica that
  gets the turn instead fetches the prefix from the other node, with exactly the
  tokens of a cold prefill.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import ray
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from ray.cluster_utils import Cluster

from bench.devserver import ServerProcess, free_port, write_config
from serve_app.cache.manager_stats import CacheStats
from serve_app.cache.merge import fields_of_kind
from serve_app.cluster.directory_service import DIRECTORY_NAME, NAMESPACE
from serve_app.cluster.replicas import FORGET_AFTER_S, REPORT_INTERVAL_S
from serve_app.serving.engine_events import EngineStats
from tests.support.clients import chat, openai_client
from tests.support.servers import running, wait_for
from tests.support.threads import Threads

MODEL = "tiny-hybrid"
SLOT = "serve_app_test_replica_slot"  # one per node: one replica per node


@pytest.fixture(scope="module")
def cluster_server(tmp_path_factory, model_home):
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray_cluster_serve")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {SLOT: 1}, "include_dashboard": False,
        "_system_config": {"metrics_report_interval_ms": 500}})
    cluster.add_node(num_cpus=2, resources={SLOT: 1})
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        cluster.wait_for_nodes()
        port = free_port()
        model = {"name": MODEL, "source": "embedded:tiny-hybrid", "context_length": 512,
                 "max_batch_size": 2, "max_queued_requests": 8, "max_tokens": 256,
                 "num_replicas": 2, "max_replicas_per_node": 1, "resources": {SLOT: 1},
                 # A tiny load cost: these tests follow prefixes; the guard alone spreads.
                 "routing": {"mode": "prefix", "load_cost_tokens": 1},
                 "cache": {"block_size": 16}}
        config = write_config(tmp / "serve.yaml", port, [model], cache_store={
            "ssd_dir": str(tmp / "kv" / "{node_id}"), "directory": "on"})
        proc = ServerProcess.serve_run(config, port, tmp / "serve.log",
                                       env={"SERVE_APP_HOME": str(model_home)},
                                       address=cluster.address)
        with running(proc, [MODEL], timeout=400):
            yield proc
    finally:
        ray.shutdown()
        cluster.shutdown()


def counters(server) -> dict[tuple[str, tuple], float]:
    """Every serve_app counter sample of GET /metrics, summed over Ray's own labels."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            keep = tuple(sorted((k, v) for k, v in s.labels.items()
                                if k in ("model", "reason", "tier")))
            out[(s.name, keep)] = out.get((s.name, keep), 0.0) + s.value
    return out


def count(snapshot: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, keep), v in snapshot.items()
               if n == f"ray_serve_app_{name}_total" and want <= set(keep))


def wait_counts(server, before: dict, check, timeout: float = 60.0) -> dict:
    """Metrics reach Prometheus' export a second or two late: poll until ``check``."""
    deadline = time.monotonic() + timeout
    while True:
        now = counters(server)
        delta = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in now}
        if check(delta) or time.monotonic() > deadline:
            return delta
        time.sleep(0.5)


def routing_counts(delta: dict) -> str:
    """The routing, fetch and hit counters that moved, one per line (whole, where a
    failing assertion would print a dict cut short)."""
    return "\n".join(f"{name}{dict(labels)} = {v}" for (name, labels), v in sorted(delta.items())
                     if v and any(w in name for w in ("routing", "remote", "hit_tokens")))


def first_turn(i: int, tag: str) -> list[dict]:
    # Distinct from the first block on (the tokenizer is character-level): no two
    # conversations share a block.
    return [{"role": "system", "content": f"{i}-{tag}: answer briefly and well. " * 3},
            {"role": "user", "content": "What is the first question?"}]


def settle(timeout: float = 30.0) -> None:
    """Wait until the block directory has stopped changing (stores report every 0.5 s),
    then for the routers' copies (they follow every 0.25 s)."""
    directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    deadline = time.monotonic() + timeout
    last, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        version = ray.get(directory.changes_since.remote(1 << 62)).version
        if version != last:
            last, quiet_since = version, time.monotonic()
        elif time.monotonic() - quiet_since > 1.5:
            break
        time.sleep(0.25)
    time.sleep(0.75)


def test_next_turns_go_to_the_replica_holding_their_prefix(cluster_server):
    client = openai_client(cluster_server, "x")
    before = counters(cluster_server)
    conversations: list[list[dict]] = [first_turn(i, "Affinity") for i in range(4)]
    replies: dict[int, str] = {}

    def first(i: int) -> None:
        replies[i] = chat(client, MODEL, conversations[i], 8).choices[0].message.content

    # Two at a time: the second of a pair goes to the other replica (the first is busy),
    # so both nodes hold conversations.
    for pair in ((0, 1), (2, 3)):
        threads = Threads()
        for i in pair:
            threads.start(first, i)
        threads.join(240)
    settle()
    for i, messages in enumerate(conversations):
        messages += [{"role": "assistant", "content": replies[i]},
                     {"role": "user", "content": "And the second one?"}]
        r = chat(client, MODEL, messages, 8)
        assert r.usage.prompt_tokens_details.cached_tokens >= 48, i

    delta = wait_counts(cluster_server, before,
                        lambda d: count(d, "routing_decisions", reason="prefix") >= 4
                        and count(d, "prefix_cache_hit_tokens", tier="hot") >= 4 * 48)
    shown = routing_counts(delta)
    assert count(delta, "routing_decisions", reason="prefix") == 4, shown
    # First turns go to the least loaded replica: ``no_prefix``, or ``unranked`` while the
    # router has no replica's cache layout yet (Serve hands it routing stats every 2 s, so
    # right after a start it may have none). (>=: the readiness probe's decision may reach
    # the export after ``before``.)
    assert (count(delta, "routing_decisions", reason="no_prefix")
            + count(delta, "routing_decisions", reason="unranked")) >= 4, shown
    assert count(delta, "routing_decisions", reason="load_fallback") == 0, shown
    # Every second turn was served where its first turn's blocks are: nothing fetched.
    assert count(delta, "remote_fetch_blocks") == 0
    assert count(delta, "prefix_cache_hit_tokens", tier="hot") >= 4 * 48
    assert count(delta, "prefix_cache_hit_tokens", tier="remote") == 0


def test_a_full_replica_is_passed_over_and_the_other_fetches_the_prefix_exactly(
        cluster_server):
    client = openai_client(cluster_server, "x")
    # A long prefix: prefilling it costs more than fetching it, even for this tiny model
    # (a replica skips fetches that cost more than they save: measured, not assumed).
    messages = first_turn(0, "Guard" * 8)
    reply = chat(client, MODEL, messages, 8).choices[0].message.content
    messages += [{"role": "assistant", "content": reply}]
    settle()
    before = counters(cluster_server)
    # Two long streams sharing the prefix fill its replica's batch (max_batch_size 2).
    streams = [client.chat.completions.create(
        model=MODEL, messages=messages + [{"role": "user", "content": f"A long story {k}."}],
        max_tokens=200, temperature=0, stream=True) for k in range(2)]
    try:
        for s in streams:
            next(iter(s))
        turn = messages + [{"role": "user", "content": "And the second one?"}]
        warm = chat(client, MODEL, turn, 12)
    finally:
        for s in streams:
            s.close()
    cold = chat(client, MODEL, turn, 12, salt=f"cold-{uuid.uuid4()}")
    delta = wait_counts(cluster_server, before,
                        lambda d: count(d, "remote_fetch_blocks") > 0
                        and count(d, "routing_decisions", reason="load_fallback") >= 1)
    shown = routing_counts(delta)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.usage.prompt_tokens_details.cached_tokens >= 48, shown
    assert count(delta, "routing_decisions", reason="prefix") >= 2, shown  # the two streams
    assert count(delta, "routing_decisions", reason="load_fallback") == 1, shown  # the turn
    assert count(delta, "remote_fetch_blocks") >= 3
    assert count(delta, "prefix_cache_hit_tokens", tier="remote") >= 48
    assert count(delta, "remote_fetch_failures") == 0


def model_stats(server) -> dict:
    with urllib.request.urlopen(f"{server.base_url}/v1/stats", timeout=60) as r:
        return json.loads(r.read())["models"][MODEL]


def quiet_stats(server, timeout: float = 60.0) -> dict:
    """The model's stats once every replica is in them and nothing moves: two reads a
    report period apart agree on what each replica finished, none in flight."""
    seen: dict = {"stats": None, "done": None}

    def quiet() -> dict | None:
        s = model_stats(server)
        done = {(r["node_id"], r["pid"]): r["stats"]["engine"]["finished"]
                for r in s["replicas"]}
        agree = done == seen["done"]
        seen.update(stats=s, done=done)
        return s if s["replicas_complete"] and s["engine"]["in_flight"] == 0 and agree else None

    return wait_for(quiet, lambda: f"quiet stats: {seen['stats']['replicas_note']}, "
                    f"{seen['done']}", timeout, interval=REPORT_INTERVAL_S * 1.5)


def by_replica(stats: dict) -> dict[tuple[str, int], dict]:
    return {(r["node_id"], r["pid"]): r for r in stats["replicas"]}


STATS_ROUNDS = 10


def stats_round(client: OpenAI, tag: str) -> list[int]:
    """Two conversations' first turns, streamed side by side, then each one's next turn:
    the cached tokens of the four answers."""
    conversations = [first_turn(i, tag) for i in range(2)]
    cached = []
    streams = []
    for messages in conversations:
        streams.append(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200 - 150 * len(streams),
            temperature=0, stream=True, stream_options={"include_usage": True}))
        next(iter(streams[-1]))
    for s in streams:
        usage = [c.usage for c in s if c.usage is not None][-1]
        cached.append(usage.prompt_tokens_details.cached_tokens)
    for messages in conversations:  # each next turn: its prefix is cached (hit tokens)
        turn = messages + [{"role": "assistant", "content": "Fine."},
                           {"role": "user", "content": "And then?"}]
        cached.append(chat(client, MODEL, turn, 8).usage.prompt_tokens_details.cached_tokens)
    return cached


def wait_finished(server, before: dict, finished: int, timeout: float = 30.0) -> dict:
    """The model's stats once ``finished`` more requests than ``before`` are counted
    (replicas report every second), or the last read at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        after = model_stats(server)
        if after["engine"]["finished"] - before["engine"]["finished"] >= finished or (
                time.monotonic() > deadline):
            return after
        time.sleep(0.25)


def test_stats_list_every_replica_and_total_them(cluster_server):
    """/v1/stats lands on one replica; it lists both (one per node, each with its age)
    and its totals count every request's hit tokens, whichever replica served it."""
    client = openai_client(cluster_server, "x")
    before = quiet_stats(cluster_server)
    replicas = before["replicas"]
    assert before["replicas_expected"] == 2 and before["replicas_note"] is None
    assert len({r["pid"] for r in replicas}) == 2
    assert len({r["node_id"] for r in replicas}) == 2  # one replica per node
    assert [r["answered"] for r in replicas] == [True, False]
    assert replicas[0]["age_s"] == 0 and 0 <= replicas[1]["age_s"] < FORGET_AFTER_S
    assert before["replica"]["pid"] == replicas[0]["pid"]  # top level: the answering one's

    # The second conversation of a round starts while the first is being served, so the
    # router usually sends it to the other replica (same prefill cost, one request less
    # ongoing); should the first have ended already, the tie is broken at random. Rounds
    # go on until both replicas have served (at most STATS_ROUNDS: a chance below 0.1%
    # of never, were the router a coin).
    cached: list[int] = []
    sent = 0
    for round_ in range(STATS_ROUNDS):
        cached += stats_round(client, f"Stats{round_}")
        sent += 4
        after = wait_finished(cluster_server, before, sent)
        old, new = by_replica(before), by_replica(after)
        served = {key: new[key]["stats"]["engine"]["finished"]
                  - old[key]["stats"]["engine"]["finished"] for key in new}
        if all(served.values()):
            break
    assert set(old) == set(new)
    assert sorted(served.values())[0] >= 1 and sum(served.values()) == sent, served
    assert sum(cached) >= sent // 2 * 48, cached
    assert after["replicas_complete"], after["replicas_note"]
    assert after["engine"]["finished"] - before["engine"]["finished"] == sent
    assert after["cache"]["lookups"] - before["cache"]["lookups"] == sent
    # The totals are every replica's: all the hit tokens the responses reported.
    assert after["cache"]["hit_tokens"] - before["cache"]["hit_tokens"] == sum(cached)
    # ... and the totals are the sum of the replicas listed, counter by counter.
    listed = [r["stats"] for r in after["replicas"]]
    for key in fields_of_kind(EngineStats, "sum"):
        assert after["engine"][key] == pytest.approx(sum(s["engine"][key] for s in listed)), key
    for key in fields_of_kind(CacheStats, "sum"):
        assert after["cache"][key] == pytest.approx(sum(s["cache"][key] for s in listed)), key
    tiers = {t for s in listed for t in s["cache"]["hit_tokens_by_tier"]}
    assert after["cache"]["hit_tokens_by_tier"] == {
        t: sum(s["cache"]["hit_tokens_by_tier"].get(t, 0) for s in listed) for t in tiers}
    assert after["engine"]["peak_batch_size"] == max(s["engine"]["peak_batch_size"]
                                                     for s in listed)
