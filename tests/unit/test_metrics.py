"""Metric definitions, docs and dashboards agree; stats become the right samples (no Ray)."""

from __future__ import annotations

import asyncio
import re

import pytest

from dashboards.generate import DASHBOARDS, build, panel_queries, render
from serve_app.cache.manager_stats import CacheStats
from serve_app.cache.ssd import SSDStore
from serve_app.cache.tiers import TieredStore
from serve_app.config.normalize_rules import RULE_NAMES
from serve_app.deploy.pool import UNLOAD_REASONS
from serve_app.metrics.samples import (
    pool_samples,
    pooling_samples,
    rank_samples,
    replica_samples,
    store_samples,
)
from serve_app.metrics.table import (
    DEFS,
    METRICS,
    PHASES,
    ROUTING_REASONS,
    MetricsPump,
    Recorder,
    Sample,
    markdown_table,
    zero_at_start,
)
from serve_app.parallel.group import RankStatus
from serve_app.serving.engine_events import EngineStats
from serve_app.serving.request import CompletionRequest
from tests.support import REPO
from tests.support.blocks import DISK, entry
from tests.support.engine import make_services
from tests.support.servers import wait_for


class ListRecorder(Recorder):
    """Keeps what it was given, to compare with what the stats imply."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def inc(self, name, value, labels):
        self.calls.append(("inc", name, value, labels))

    def zero(self, name, labels):
        self.calls.append(("zero", name, 0, labels))

    def set(self, name, value, labels):
        self.calls.append(("set", name, value, labels))

    def observe(self, name, value, labels):
        self.calls.append(("observe", name, value, labels))

    def observed(self, name: str) -> list[float]:
        return [c[2] for c in self.calls if c[0] == "observe" and c[1] == name]


# ---- one source of truth ------------------------------------------------------------------


def test_docs_metrics_table_is_generated_from_the_definitions():
    page = (REPO / "docs" / "metrics.md").read_text()
    start = page.index("<!-- metrics-table:start -->\n") + len("<!-- metrics-table:start -->\n")
    end = page.index("<!-- metrics-table:end -->")
    assert page[start:end] == markdown_table(), (
        "docs/metrics.md's metrics table is stale: paste `python -m serve_app metrics-table`")


def test_metric_names_follow_prometheus_conventions():
    for d in METRICS:
        assert re.fullmatch(r"serve_app_[a-z_]+", d.name), d.name
        assert not d.name.endswith("_total"), "Ray adds _total to counters"
        assert "request_id" not in d.labels
        if d.kind != "gauge" and ("seconds" in d.name or "bytes" in d.name):
            assert d.name.endswith(("_seconds", "_bytes")), d.name
        if d.where in ("ingress", "replica"):
            assert "model" in d.labels, d.name


@pytest.mark.parametrize("key", list(DASHBOARDS))
def test_committed_dashboards_are_the_generated_ones(key):
    assert (REPO / "dashboards" / f"{key}.json").read_text() == render(key), (
        "regenerate with `python -m dashboards.generate`")


def test_dashboards_use_defined_metrics_and_show_every_one():
    exported = {d.exported for d in METRICS}
    used = set()
    for key in DASHBOARDS:
        for title, expr in panel_queries(build(key)):
            for name in re.findall(r"ray_serve_app_\w+", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert base in exported, f"{key} / {title} uses unknown metric {name}"
                used.add(base)
    assert used == exported, f"not on any dashboard: {sorted(exported - used)}"


def test_every_labelled_counter_a_dashboard_queries_starts_at_zero():
    """A one-node server's panels show 0, not "no data": each labelled counter that a
    dashboard queries is exported at 0 when the process recording it starts, from fresh
    stats through the pump (replica, store) or by ``zero_at_start`` (ingress, router)."""
    queried = {name for key in DASHBOARDS for _, expr in panel_queries(build(key))
               for name in re.findall(r"ray_(serve_app_\w+)_total", expr)}
    labelled = {d.name for d in METRICS
                if d.kind == "counter" and d.name in queried and set(d.labels) - {"model"}}
    assert "serve_app_routing_decisions" in labelled and "serve_app_requests" in labelled

    recorder = ListRecorder()
    pump = MetricsPump(recorder, list)
    pump.publish(replica_samples("m", EngineStats(), CacheStats(True, None, 16),
                                 dict.fromkeys(RULE_NAMES, 0)))
    pump.publish(store_samples(TieredStore(1 << 20, None, 1 << 20).stats(), {"0" * 16: "m"}))
    pump.publish(pool_samples("m", True, 0, 0.0, dict.fromkeys(UNLOAD_REASONS, 0)))
    pump.publish(pooling_samples("e", "embed", 0, 0))
    pump.publish(rank_samples("m", [RankStatus(r, "node", "127.0.0.1", 1) for r in (0, 1)]))
    for where in ("ingress", "router"):
        zero_at_start(recorder, where, "m")
    assert not [call for call in recorder.calls if call[0] == "inc"]  # fresh: nothing yet
    zeroed: dict[str, set[tuple]] = {}
    for op, name, _, labels in recorder.calls:
        if op == "zero":
            zeroed.setdefault(name, set()).add(tuple(sorted(labels.items())))
    assert not labelled - set(zeroed), f"no series at 0: {sorted(labelled - set(zeroed))}"
    decisions = {dict(labels)["reason"] for labels in zeroed["serve_app_routing_decisions"]}
    assert decisions == set(ROUTING_REASONS)


# ---- stats to samples ---------------------------------------------------------------------


def test_pump_turns_totals_into_increments():
    rec = ListRecorder()
    pump = MetricsPump(rec, list)
    c = "serve_app_prefix_cache_walkbacks"
    g = "serve_app_running_requests"
    labels = {"model": "m"}
    for total in (0, 5, 5, 8, 2):  # 2: the stats restarted
        pump.publish([Sample(c, labels, total), Sample(g, labels, total)])
    assert [(op, v) for op, name, v, _ in rec.calls if name == c] == [
        ("zero", 0), ("inc", 5), ("inc", 3), ("inc", 2)]
    assert [v for op, name, v, _ in rec.calls if name == g] == [0, 5, 5, 8, 2]


def test_store_samples_match_the_files_on_disk(tmp_path):
    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(hot_budget=3 * 4096, ssd=ssd, pending_max_bytes=1 << 20)
    for i in range(5):  # the hot tier holds three: two hot evictions
        store.put(entry(i), DISK)
    wait_for(lambda: store.snapshot()["staging"]["writes_done"] == 5, "five SSD writes",
                 interval=0.01)
    samples = store_samples(store.stats(), {DISK.model[:16]: "m"})

    def value(name: str, **labels: str) -> float:
        (hit,) = [s.value for s in samples if s.name == name and s.labels == labels]
        return hit

    files = list((tmp_path / "v1" / "blocks").rglob("*.safetensors"))
    assert value("serve_app_cache_entries", model="m", tier="ssd", kind="block") == len(files) == 5
    assert value("serve_app_cache_bytes", model="m", tier="ssd", kind="block") == sum(
        f.stat().st_size for f in files)
    assert value("serve_app_cache_entries", model="m", tier="hot", kind="block") == 3
    assert value("serve_app_cache_bytes", model="m", tier="hot", kind="block") == 3 * 4096
    assert value("serve_app_cache_evictions", model="m", tier="hot") == 2
    assert value("serve_app_cache_evictions", model="m", tier="ssd") == 0
    assert value("serve_app_cache_staging_writes", result="done") == 5
    assert value("serve_app_cache_staging_writes", result="dropped") == 0
    assert value("serve_app_cache_budget_bytes", tier="hot") == 3 * 4096
    assert value("serve_app_cache_budget_bytes", tier="ssd") == 1 << 30
    assert value("serve_app_cache_staging_peak_pending_bytes") > 0
    for s in samples:
        assert set(s.labels) == set(DEFS[s.name].labels), s


def test_service_records_latency_and_cache_counters(tmp_path):
    warm, cold, _ = make_services("tiny-dense", tmp_path)
    rec = ListRecorder()
    warm.metrics = rec
    try:
        prompt = list(range(40, 40 + 3 * 16 + 5))

        async def go():
            prepared = warm.prepare(CompletionRequest(model="warm", prompt=prompt,
                                                      max_tokens=7, temperature=0))
            return [e async for batch in warm.stream(prepared) for e in batch]

        for _ in range(2):
            asyncio.run(go())
        assert len(rec.observed("serve_app_time_to_first_token_seconds")) == 2
        assert len(rec.observed("serve_app_inter_token_latency_seconds")) == 2 * 6
        assert len(rec.observed("serve_app_request_duration_seconds")) == 2
        phases = [c for c in rec.calls
                  if c[0] == "observe" and c[1] == "serve_app_request_phase_seconds"]
        assert sorted(c[3]["phase"] for c in phases) == sorted(PHASES * 2)
        ttft = rec.observed("serve_app_time_to_first_token_seconds")
        # plan + queue + prefill is the time to first token (prepare comes before it)
        parts = sum(c[2] for c in phases if c[3]["phase"] != "prepare")
        assert parts == pytest.approx(sum(ttft), rel=0.05, abs=2e-3)
        summary = asyncio.run(warm.stats())["phases"]
        assert summary["requests"] == 2 and set(summary["mean_ms"]) == set(PHASES)
        assert all(v >= 0 for c in rec.calls if c[0] == "observe" for v in [c[2]])

        samples = {(s.name, tuple(s.labels.values())): s.value for s in warm.metric_samples()}
        assert samples[("serve_app_prompt_tokens", ("warm",))] == 2 * len(prompt)
        assert samples[("serve_app_generation_tokens", ("warm",))] == 2 * 7
        assert samples[("serve_app_prefix_cache_lookups", ("warm",))] == 2
        hit = len(prompt) - 1  # the second time: three blocks and the prompt-end tail
        assert samples[("serve_app_prefix_cache_hit_tokens", ("warm", "hot"))] == hit
        assert samples[("serve_app_prefix_cache_missed_tokens", ("warm",))] == (
            2 * len(prompt) - hit)
        assert samples[("serve_app_prefix_cache_misses", ("warm", "new_prefix"))] == 1
        assert samples[("serve_app_prefix_cache_misses", ("warm", "diverged"))] == 0
        assert warm.cache_stats.summary()["hit_rate"] == round(hit / (2 * len(prompt)), 4)
    finally:
        warm.shutdown()
        cold.shutdown()


# ---- /metrics on the API port -------------------------------------------------------------
