"""/v1/stats over every replica of a model, without Ray: the store's board of reports,
the merge into the model's totals, and that every field of a replica's stats declares how
it combines (summed, maxed, by key, the answering replica's), never summed by accident.

The real path (two replicas on two Ray nodes, reports through the cache stores) is
``test_cluster::test_stats_list_every_replica_and_total_them``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, fields, is_dataclass, replace

import pytest

from serve_app.cache.manager_stats import CacheStats
from serve_app.cache.merge import KINDS, MERGE, fields_of_kind, merge, merged
from serve_app.cluster.replicas import (
    FORGET_AFTER_S,
    Gathered,
    ReplicaBoard,
    ReplicaReport,
    model_view,
)
from serve_app.metrics.table import MetricsPump, Recorder
from serve_app.serving.engine_events import EngineStats
from serve_app.serving.replica_stats import (
    CacheView,
    NormalizationStats,
    PhaseTimes,
    ReplicaProcess,
    ReplicaStats,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica_stats(pid: int, node: str, *, finished: int, hit: int, missed: int,
                  peak: int = 1, hot: int | None = None, prepare_s: float = 0.001,
                  rule: int = 0) -> ReplicaStats:
    """A replica's full stats, as ``ModelReplica.stats`` answers them."""
    engine = EngineStats(submitted=finished, finished=finished, in_flight=1,
                         running_batch_size=1, peak_batch_size=peak,
                         prompt_tokens=hit + missed, generated_tokens=3 * finished,
                         step_seconds=0.5, captured_tokens=100,
                         captured_checkpoint_bytes=1000 * pid)
    cache = CacheStats(True, None, 16, lookups=finished, hit_tokens=hit, missed_tokens=missed,
                       ssd_read_seconds=0.25,
                       hit_tokens_by_tier={"hot": hit} if hot is None else {
                           "hot": hot, "ssd": hit - hot},
                       misses_by_reason={"new_prefix": 1},
                       last_miss_reason=f"new prefix (pid {pid})",
                       recent_cache_busts=[{"pid": pid}])
    phases = PhaseTimes({"prepare": prepare_s * finished, "plan": 0.002 * finished},
                        {"prepare": finished, "plan": finished})
    return ReplicaStats(
        "m", engine, cache, CacheView(None, {"bandwidth_bytes_per_s": pid}), phases,
        NormalizationStats(["claude_code_billing_header"],
                           {"claude_code_billing_header": rule}),
        ReplicaProcess(pid, node, "t", prepare_runs=finished),
        {"bytes": 4096, "budget": 1 << 30, "blocks": 7,
         "publisher": {"dropped": pid, "unacknowledged": 0}, "breaker": {"open": False}})


def report(stats: ReplicaStats, age: float = 0.0, model: str = "m") -> ReplicaReport:
    r = stats.replica
    assert r is not None
    return ReplicaReport(model, r.node_id, r.pid, stats.own(), age)


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
    assert [(r.pid, r.stats.engine.finished, r.age_s) for r in got] == [
        (11, 5, 0.25), (12, 2, 0.75)]
    assert {r.model for r in board.reports()} == {"m", "other"}
    # 12 and 13 stop reporting; 11 goes on
    clock.now += FORGET_AFTER_S - 0.5
    board.put(report(replica_stats(11, "n1", finished=6, hit=0, missed=10)))
    clock.now += 0.5
    assert [r.pid for r in board.reports("m")] == [11]
    assert board.reports("other") == []


def test_totals_sum_counters_and_keep_settings_of_the_answering_replica():
    answered = replica_stats(11, "n1", finished=3, hit=32, missed=10, peak=2, prepare_s=0.001)
    b = replica_stats(22, "n2", finished=1, hit=16, missed=30, peak=1, hot=6,
                      prepare_s=0.005, rule=2)
    stale_self = report(replica_stats(11, "n1", finished=1, hit=0, missed=9), age=0.8)
    mine = answered.to_json()
    view = model_view(answered, Gathered((stale_self, report(b, age=0.6))),
                      expected=2).to_json()

    assert view["replicas_complete"] is True and view["replicas_note"] is None
    assert view["replicas_expected"] == 2
    listed = [(r["node_id"], r["pid"], r["answered"], r["age_s"]) for r in view["replicas"]]
    assert listed == [("n1", 11, True, 0.0), ("n2", 22, False, 0.6)]  # its own report dropped
    assert view["replicas"][0]["stats"]["engine"] == mine["engine"]  # fresh, not stale
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
        assert cache[key] == mine["cache"][key], key
    assert view["phases"]["requests"] == 4 and view["phases"]["counts"]["prepare"] == 4
    # each phase's mean: its summed seconds over its summed count
    assert view["phases"]["mean_ms"] == {"prepare": 2.0, "plan": 2.0}
    assert view["normalization"] == {"rules": ["claude_code_billing_header"],
                                     "requests_by_rule": {"claude_code_billing_header": 2}}
    # Per process or per node: the answering replica's, never summed.
    assert view["replica"] == mine["replica"]
    assert view["cache_store"] == mine["cache_store"]
    assert view["model"] == "m"


def test_one_replica_is_its_own_totals():
    answered = replica_stats(11, "n1", finished=3, hit=32, missed=10)
    mine = answered.to_json()
    view = model_view(answered, Gathered(), expected=1).to_json()
    for key in ("engine", "cache", "phases", "normalization", "cache_store", "replica"):
        assert view[key] == mine[key], key
    assert view["replicas_complete"] is True
    assert [r["pid"] for r in view["replicas"]] == [11]


def test_missing_replicas_are_said():
    answered = replica_stats(11, "n1", finished=3, hit=32, missed=10)
    off = model_view(answered, Gathered(not_asked="the cache is off"), 2).to_json()
    assert off["replicas_complete"] is False and off["replicas_note"] == "the cache is off"
    assert off["engine"]["finished"] == 3
    frozen = model_view(answered, Gathered(unreachable=("n2",)), 2).to_json()
    assert frozen["replicas_complete"] is False and "n2" in frozen["replicas_note"]
    starting = model_view(answered, Gathered(), 3).to_json()
    assert starting["replicas_note"].startswith("1 of 3 replicas")


def test_an_unloaded_answering_replica_has_no_sections_to_total():
    answered = ReplicaStats("m", replica=ReplicaProcess(11, "n1", status="unloaded"))
    view = model_view(answered, Gathered(), 1).to_json()
    assert "engine" not in view and view["replica"]["status"] == "unloaded"


def test_every_stats_field_declares_how_it_combines():
    """A field added to any stats class (engine, cache, phases, normalization, the report
    itself) must say how replicas combine it: ``merge`` refuses one that does not."""
    classes = [EngineStats, CacheStats, PhaseTimes, NormalizationStats, CacheView,
               ReplicaStats]
    for cls in classes:
        for f in fields(cls):
            assert f.metadata.get(MERGE) in KINDS, f"{cls.__name__}.{f.name}"

    @dataclass
    class Undeclared:
        counted: int = merged("sum", default=0)
        forgotten: int = 0

    with pytest.raises(TypeError, match="Undeclared.forgotten declares no merge kind"):
        merge([Undeclared(1, 2), Undeclared(3, 4)])

    @dataclass
    class Each:
        total: int = merged("sum", default=0)
        most: int = merged("max", default=0)
        by: dict = merged("sum_by_key", default_factory=dict)
        first: str = merged("answering", default="")

    got = merge([Each(1, 5, {"a": 1}, "x"), Each(2, 3, {"a": 2, "b": 1}, "y")])
    assert got == Each(3, 5, {"a": 3, "b": 1}, "x")


def test_two_copies_of_a_real_replica_double_every_counter(tmp_path):
    """Read from a real service's stats: merged with a copy of itself, every summed field
    doubles, every maxed or answering one stays, the derived ones are recomputed."""
    from tests.support.engine import chat, make_services, run

    warm, cold, _ = make_services("tiny-dense", tmp_path)
    try:
        run(warm, chat([{"role": "user", "content": "one two three four " * 6}], n=2))
        asyncio.run(warm.stats())  # the JSON edge works on a real service
        stats = warm.local_stats()
    finally:
        warm.shutdown()
        cold.shutdown()
    one = replace(stats, replica=ReplicaProcess(1, "n"))
    twin = replace(stats, replica=ReplicaProcess(2, "n"))
    view = model_view(one, Gathered((report(twin),)), expected=2).to_json()
    alone = one.to_json()
    for cls, section in ((EngineStats, "engine"), (CacheStats, "cache")):
        for key in fields_of_kind(cls, "sum"):
            assert view[section][key] == pytest.approx(2 * alone[section][key]), key
        for key in fields_of_kind(cls, "sum_by_key"):
            assert view[section][key] == {k: 2 * v for k, v in alone[section][key].items()}
        for key in (*fields_of_kind(cls, "max"), *fields_of_kind(cls, "answering")):
            assert view[section][key] == alone[section][key], key
    assert view["cache"]["hit_rate"] == alone["cache"]["hit_rate"]
    assert view["phases"]["mean_ms"] == pytest.approx(alone["phases"]["mean_ms"], abs=1e-3)
    assert all(is_dataclass(getattr(stats, s)) for s in ("engine", "cache", "phases"))


def test_the_metrics_pump_runs_the_report_after_each_publish():
    ran = threading.Event()

    def boom():
        raise RuntimeError("publishing failed: the report still runs")

    pump = MetricsPump(Recorder(), boom, interval=0.05, also=ran.set).start()
    try:
        assert ran.wait(5)
    finally:
        pump.stop()
