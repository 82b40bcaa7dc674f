"""/v1/stats over every replica of a model, without Ray: the store's board of reports,
the merge into the model's totals, and that every key of a replica's stats is classed
(summed, maxed, the answering replica's or recomputed), never summed by accident.

The real path (two replicas on two Ray nodes, reports through the cache stores) is
``test_cluster::test_stats_list_every_replica_and_total_them``.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from dataclasses import fields

import pytest

from serve_app.cluster.replicas import (
    CACHE_ANSWERING,
    CACHE_DERIVED,
    CACHE_SUMS,
    CACHE_SUMS_BY_KEY,
    ENGINE_MAX,
    ENGINE_SUMS,
    FORGET_AFTER_S,
    Gathered,
    ReplicaBoard,
    ReplicaReport,
    model_view,
    own_stats,
)
from serve_app.metrics.table import MetricsPump, Recorder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica_stats(pid: int, node: str, *, finished: int, hit: int, missed: int,
                  peak: int = 1, hot: int | None = None, prepare_ms: float = 1.0,
                  rule: int = 0) -> dict:
    """A replica's full stats, shaped as ``ModelReplica.stats`` answers them."""
    return {
        "model": "m",
        "engine": {"submitted": finished, "finished": finished, "in_flight": 1,
                   "running_batch_size": 1, "peak_batch_size": peak,
                   "prompt_tokens": hit + missed, "generated_tokens": 3 * finished,
                   "step_seconds": 0.5, "captured_tokens": 100,
                   "captured_checkpoint_bytes": 1000 * pid},
        "cache": {"enabled": True, "disabled_reason": None, "block_size": 16,
                  "checkpoint_interval": None, "lookups": finished, "hit_tokens": hit,
                  "missed_tokens": missed, "ssd_read_seconds": 0.25,
                  "hit_tokens_by_tier": {"hot": hit} if hot is None else {"hot": hot,
                                                                           "ssd": hit - hot},
                  "misses_by_reason": {"new_prefix": 1},
                  "last_miss_reason": f"new prefix (pid {pid})",
                  "recent_cache_busts": [{"pid": pid}],
                  "remote_fetch_policy": {"bandwidth_bytes_per_s": pid},
                  "hit_rate": round(hit / (hit + missed), 4) if hit + missed else None,
                  "checkpoint_bytes_per_1k_tokens": 10_000 * pid},
        "phases": {"requests": finished, "counts": {"prepare": finished, "plan": finished},
                   "mean_ms": {"prepare": prepare_ms, "plan": 2.0}},
        "normalization": {"rules": ["claude_code_billing_header"],
                          "requests_by_rule": {"claude_code_billing_header": rule}},
        "cache_store": {"bytes": 4096, "budget": 1 << 30, "blocks": 7,
                        "publisher": {"dropped": pid, "unacknowledged": 0},
                        "breaker": {"open": False}},
        "replica": {"pid": pid, "node_id": node, "user_code_thread": "t", "preparing": 0,
                    "prepare_runs": finished},
    }


def report(stats: dict, age: float = 0.0, model: str = "m") -> ReplicaReport:
    r = stats["replica"]
    return ReplicaReport(model, r["node_id"], r["pid"], own_stats(stats), age)


def test_the_board_keeps_each_replicas_latest_report_and_forgets_silent_ones():
    clock = Clock()
    board = ReplicaBoard(clock=clock)
    a = replica_stats(11, "n1", finished=1, hit=0, missed=10)
    board.put(report(a))
    board.put(report(replica_stats(12, "n1", finished=2, hit=0, missed=10)))
    board.put(report(replica_stats(13, "n1", finished=2, hit=0, missed=10), model="other"))
    clock.now += 0.5
    board.put(report(replica_stats(11, "n1", finished=5, hit=0, missed=10)))  # replaces
    clock.now += 0.25
    got = board.reports("m")
    assert [(r.pid, r.stats["engine"]["finished"], r.age_s) for r in got] == [
        (11, 5, 0.25), (12, 2, 0.75)]
    assert {r.model for r in board.reports()} == {"m", "other"}
    # 12 and 13 stop reporting; 11 goes on
    clock.now += FORGET_AFTER_S - 0.5
    board.put(report(replica_stats(11, "n1", finished=6, hit=0, missed=10)))
    clock.now += 0.5
    assert [r.pid for r in board.reports("m")] == [11]
    assert board.reports("other") == []


def test_totals_sum_counters_and_keep_settings_of_the_answering_replica():
    answered = replica_stats(11, "n1", finished=3, hit=32, missed=10, peak=2, prepare_ms=1.0)
    b = replica_stats(22, "n2", finished=1, hit=16, missed=30, peak=1, hot=6,
                      prepare_ms=5.0, rule=2)
    stale_self = report(replica_stats(11, "n1", finished=1, hit=0, missed=9), age=0.8)
    view = model_view(copy.deepcopy(answered),
                      Gathered((stale_self, report(b, age=0.6))), expected=2)

    assert view["replicas_complete"] is True and view["replicas_note"] is None
    assert view["replicas_expected"] == 2
    listed = [(r["node_id"], r["pid"], r["answered"], r["age_s"]) for r in view["replicas"]]
    assert listed == [("n1", 11, True, 0.0), ("n2", 22, False, 0.6)]  # its own report dropped
    assert view["replicas"][0]["stats"]["engine"] == answered["engine"]  # fresh, not stale
    # A replica's entry holds its own sections only: not the node store's.
    assert view["replicas"][1]["stats"]["cache_store"] == {
        "publisher": {"dropped": 22, "unacknowledged": 0}, "breaker": {"open": False}}

    engine, cache = view["engine"], view["cache"]
    assert engine["finished"] == 4 and engine["generated_tokens"] == 12
    assert engine["in_flight"] == 2 and engine["running_batch_size"] == 2  # model-wide now
    assert engine["peak_batch_size"] == 2  # the largest batch one replica ran, not 3
    assert engine["step_seconds"] == pytest.approx(1.0)
    assert cache["hit_tokens"] == 48 and cache["missed_tokens"] == 40
    assert cache["hit_rate"] == round(48 / 88, 4)  # recomputed, not summed nor averaged
    assert cache["hit_tokens_by_tier"] == {"hot": 38, "ssd": 10}
    assert cache["misses_by_reason"] == {"new_prefix": 2}
    assert cache["ssd_read_seconds"] == pytest.approx(0.5)
    assert cache["checkpoint_bytes_per_1k_tokens"] == round((11_000 + 22_000) * 1000 / 200)
    for key in ("block_size", "enabled", "last_miss_reason", "recent_cache_busts",
                "remote_fetch_policy"):
        assert cache[key] == answered["cache"][key], key
    assert view["phases"]["requests"] == 4 and view["phases"]["counts"]["prepare"] == 4
    assert view["phases"]["mean_ms"] == {"prepare": 2.0, "plan": 2.0}  # weighted by count
    assert view["normalization"] == {"rules": ["claude_code_billing_header"],
                                     "requests_by_rule": {"claude_code_billing_header": 2}}
    # Per process or per node: the answering replica's, never summed.
    assert view["replica"] == answered["replica"]
    assert view["cache_store"] == answered["cache_store"]
    assert view["model"] == "m"


def test_one_replica_is_its_own_totals():
    answered = replica_stats(11, "n1", finished=3, hit=32, missed=10)
    view = model_view(copy.deepcopy(answered), Gathered(), expected=1)
    for key in ("engine", "cache", "phases", "normalization", "cache_store", "replica"):
        assert view[key] == answered[key], key
    assert view["replicas_complete"] is True
    assert [r["pid"] for r in view["replicas"]] == [11]


def test_missing_replicas_are_said():
    answered = replica_stats(11, "n1", finished=3, hit=32, missed=10)
    off = model_view(copy.deepcopy(answered), Gathered(not_asked="the cache is off"), 2)
    assert off["replicas_complete"] is False and off["replicas_note"] == "the cache is off"
    assert off["engine"]["finished"] == 3
    frozen = model_view(copy.deepcopy(answered), Gathered(unreachable=("n2",)), 2)
    assert frozen["replicas_complete"] is False and "n2" in frozen["replicas_note"]
    starting = model_view(copy.deepcopy(answered), Gathered(), 3)
    assert starting["replicas_note"].startswith("1 of 3 replicas")


def test_every_key_of_a_replicas_engine_and_cache_stats_is_classed(tmp_path):
    """A new counter or setting in EngineStats or CacheStats must be named in
    serve_app.cluster.replicas (summed, maxed, or the answering replica's): read from a real
    service's stats."""
    from tests.test_cache_exact import chat, make_services, run

    warm, cold, _ = make_services("tiny-dense", tmp_path)
    try:
        run(warm, chat([{"role": "user", "content": "one two three four " * 6}], n=2))
        stats = asyncio.run(warm.stats())
    finally:
        warm.shutdown()
        cold.shutdown()
    from serve_app.cache.manager_stats import CacheStats
    from serve_app.serving.engine_events import EngineStats

    engine_keys = set(ENGINE_SUMS) | set(ENGINE_MAX)
    cache_keys = set(CACHE_SUMS) | set(CACHE_SUMS_BY_KEY) | set(CACHE_ANSWERING) | set(
        CACHE_DERIVED)
    assert set(stats["engine"]) == engine_keys == {f.name for f in fields(EngineStats)}
    assert set(stats["cache"]) == cache_keys
    assert {f.name for f in fields(CacheStats)} <= cache_keys
    # Two copies of one replica: every counter doubles, nothing else moves.
    twin = copy.deepcopy(stats)
    twin["replica"] = {**stats.get("replica", {}), "pid": 2, "node_id": "n"}
    answered = {**copy.deepcopy(stats), "replica": {"pid": 1, "node_id": "n"}}
    view = model_view(answered, Gathered((report(twin),)), expected=2)
    for key in ENGINE_SUMS:
        assert view["engine"][key] == pytest.approx(2 * stats["engine"][key]), key
    for key in CACHE_SUMS:
        assert view["cache"][key] == pytest.approx(2 * stats["cache"][key]), key
    for key in CACHE_SUMS_BY_KEY:
        assert view["cache"][key] == {k: 2 * v for k, v in stats["cache"][key].items()}, key
    for key in (*ENGINE_MAX, *CACHE_ANSWERING):
        section = "engine" if key in ENGINE_MAX else "cache"
        assert view[section][key] == stats[section][key], key
    assert view["cache"]["hit_rate"] == stats["cache"]["hit_rate"]
    assert view["phases"]["mean_ms"] == pytest.approx(stats["phases"]["mean_ms"], abs=1e-3)


def test_the_metrics_pump_runs_the_report_after_each_publish():
    ran = threading.Event()

    def boom():
        raise RuntimeError("publishing failed: the report still runs")

    pump = MetricsPump(Recorder(), boom, interval=0.05, also=ran.set).start()
    try:
        assert ran.wait(5)
    finally:
        pump.stop()
