"""GET /metrics gathers every node of a Ray cluster (two real Ray nodes on this machine)."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.config.profile import CacheStoreProfile
from serve_app.deploy.scrape import gather_node_metrics
from serve_app.store.actor import CacheStoreActor
from tests.support.servers import wait_for


@pytest.fixture
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "_system_config": {"metrics_report_interval_ms": 500}})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_each_nodes_cache_store_is_scraped(two_nodes):
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    budgets = {node: (i + 1) * 1_000_000 for i, node in enumerate(nodes)}
    actors = [CacheStoreActor.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(CacheStoreProfile(hot_budget=budget, ssd=False))
        for node, budget in budgets.items()]
    ray.get([a.stats.remote() for a in actors])

    last = [""]

    def every_budget() -> str | None:
        text = last[0] = asyncio.run(gather_node_metrics())
        seen = sorted(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("ray_serve_app_cache_budget_bytes{")
                      and 'tier="hot"' in line)
        return text if seen == sorted(budgets.values()) else None

    text = wait_for(every_budget, lambda: f"each node's hot budget exported:\n{last[0]}", 60,
                    interval=0.5)
    assert text.count("# TYPE ray_serve_app_cache_budget_bytes gauge") == 1
