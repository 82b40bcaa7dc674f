"""Prometheus's own tools on what we export: the dashboards' Prometheus configs pass
``promtool check config``, nodes' metrics merge into one exposition ``promtool check
metrics`` accepts, and every histogram is in the first scrape (the metric table and the
stats' samples: tests/unit/test_metrics.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.metrics.exposition import merge_exposition
from serve_app.metrics.table import (
    METRICS,
    PHASES,
)
from tests.support import REPO

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="promtool (Debian: prometheus) "
                                                         "is not installed")


# ---- one source of truth ------------------------------------------------------------------


@needs_promtool
def test_prometheus_configs_are_valid():
    for name in ("prometheus.yml", "prometheus-ray-cluster.yml"):
        done = subprocess.run([PROMTOOL, "check", "config", str(REPO / "dashboards" / name)],
                              capture_output=True, timeout=60)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


# ---- /metrics on the API port -------------------------------------------------------------


def node_text(node: str, value: float) -> str:
    ray_labels = (f'Component="core_worker",NodeAddress="{node}",SessionName="s",'
                  f'Version="2.60.0",WorkerId="w{node[-1]}",otel_scope_name="x",'
                  'otel_scope_schema_url="",otel_scope_version=""')
    return (
        "# HELP ray_serve_app_prefix_cache_walkbacks_total Walkbacks.\n"
        "# TYPE ray_serve_app_prefix_cache_walkbacks_total counter\n"
        f'ray_serve_app_prefix_cache_walkbacks_total{{{ray_labels},model="m"}} {value}\n'
        "# HELP ray_serve_app_cache_bytes Bytes.\n"
        "# TYPE ray_serve_app_cache_bytes gauge\n"
        f'ray_serve_app_cache_bytes{{{ray_labels},kind="block",model="m",tier="hot"}} 10.0\n'
        "# HELP ray_tasks Ray's own.\n"
        "# TYPE ray_tasks gauge\n"
        f"ray_tasks{{{ray_labels}}} 3.0\n"
    )


def test_nodes_merge_into_one_valid_exposition():
    text = merge_exposition([node_text("10.0.0.1", 1.0), node_text("10.0.0.2", 2.0)])
    assert text.count("# TYPE ray_serve_app_prefix_cache_walkbacks_total counter") == 1
    assert 'node="10.0.0.1"' in text and 'node="10.0.0.2"' in text
    assert "ray_tasks" not in text and "SessionName" not in text and "otel_scope" not in text
    walkbacks = [line for line in text.splitlines()
                 if line.startswith("ray_serve_app_prefix_cache_walkbacks_total")]
    assert sorted(float(line.split()[-1]) for line in walkbacks) == [1.0, 2.0]
    if PROMTOOL:
        done = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(),
                              capture_output=True, timeout=60)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_every_histogram_of_every_model_is_in_the_first_scrape():
    """Ray exports a histogram once observed: ``/metrics`` fills in each table histogram of
    each served model at zero (each bucket, count and sum) until then, and leaves an
    observed series as the node exported it."""
    ray_labels = 'Component="core_worker",NodeAddress="10.0.0.1",WorkerId="w1"'
    observed = (
        "# HELP ray_serve_app_time_to_first_token_seconds TTFT.\n"
        "# TYPE ray_serve_app_time_to_first_token_seconds histogram\n"
        + "".join(f'ray_serve_app_time_to_first_token_seconds_bucket{{{ray_labels},'
                  f'le="{b}",model="a"}} 1.0\n' for b in ("0.5", "+Inf"))
        + f'ray_serve_app_time_to_first_token_seconds_count{{{ray_labels},model="a"}} 1.0\n'
        + f'ray_serve_app_time_to_first_token_seconds_sum{{{ray_labels},model="a"}} 0.3\n')
    text = merge_exposition([observed], models=("a", "b"))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    histograms = [d for d in METRICS if d.kind == "histogram"]
    assert histograms
    for d in histograms:
        family = families[f"ray_{d.name}"]
        assert family.type == "histogram"
        counts = {tuple(sorted(s.labels.items())): s.value for s in family.samples
                  if s.name.endswith("_count")}
        phases = PHASES if "phase" in d.labels else (None,)
        for model in ("a", "b"):
            for phase in phases:
                labels = {"model": model, **({"phase": phase} if phase else {})}
                observed_here = d.name == "serve_app_time_to_first_token_seconds" and model == "a"
                key = tuple(sorted(({**labels, "node": "10.0.0.1", "worker_id": "w1"}
                                    if observed_here else labels).items()))
                assert counts[key] == (1.0 if observed_here else 0.0), (d.name, key, counts)
        zero = [s for s in family.samples if s.labels.get("model") == "b"
                and s.name.endswith("_bucket")]
        assert {s.labels["le"] for s in zero} >= {"+Inf"} and not any(s.value for s in zero)
    if PROMTOOL:
        done = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(),
                              capture_output=True, timeout=60)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
