"""The cluster-wide block directory: ordered batches per node, restarts, followers."""

from __future__ import annotations

import pytest

from serve_app.cache.match import BlockEvent
from serve_app.cluster.directory import BlockDirectory, EventBatch


def batch(node: str, seq: int, *events: tuple[str, str | None], epoch: str = "e1",
          full: bool = False) -> EventBatch:
    return EventBatch(node, epoch, seq, tuple(BlockEvent(b, t) for b, t in events), full)


def state(d: BlockDirectory) -> dict[str, dict[str, str]]:
    return {b: d.holders(b) for b in ("b0", "b1", "b2", "b3", "x")}


@pytest.mark.usefixtures("local_ray")
def test_a_follower_resyncs_with_a_new_directory_actor():
    """On a real Ray: the directory actor is killed and a new one (another incarnation,
    fed other blocks, further along its log) takes its name; the follower drops its copy
    and matches the new directory."""
    import time

    import ray

    from serve_app.cluster.directory_service import DirectoryFollower, get_or_create_directory

    def until(predicate, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    first = get_or_create_directory()
    ray.get(first.apply.remote(batch("A", 1, ("b0", "hot"), full=True)), timeout=60)
    follower = DirectoryFollower(0.05).start()
    try:
        until(lambda: follower.prefix_by_node(["b0"]) == {"A": ["hot"]})
        seen = follower.snapshot()["incarnation"]
        assert seen == ray.get(first.incarnation.remote())
        ray.kill(first, no_restart=True)
        second = get_or_create_directory()
        ray.get(second.apply.remote(batch("B", 1, ("b1", "hot"), ("b2", "hot"), full=True)),
                timeout=60)
        ray.get(second.apply.remote(batch("B", 2, ("b3", "ssd"))), timeout=60)
        until(lambda: follower.snapshot()["incarnation"] == ray.get(
            second.incarnation.remote()))
        until(lambda: follower.prefix_by_node(["b1", "b2", "b3"]) == {
            "B": ["hot", "hot", "ssd"]})
        assert follower.prefix_by_node(["b0"]) == {}  # nothing of the old directory left
        assert follower.snapshot()["resyncs"] >= 1
        ray.kill(second, no_restart=True)
    finally:
        follower.stop()


# ---- the feed: a node's tiers as directory events ------------------------------------


@pytest.mark.usefixtures("local_ray")
def test_a_store_actor_feeds_the_directory_and_a_restarted_one_starts_over():
    import asyncio
    import time

    import ray

    from serve_app.cluster.directory_service import get_or_create_directory
    from serve_app.config.profile import CacheStoreProfile
    from serve_app.store.actor import CacheStoreActor
    from serve_app.store.client import RayCacheClient
    from tests.unit.test_ssd import bid
    from tests.unit.test_store_faults import block

    directory = get_or_create_directory()
    node = ray.get_runtime_context().get_node_id()
    feeding = CacheStoreProfile(hot_budget=1 << 24, ssd=False, directory="on")

    def until(predicate, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.1)

    store = CacheStoreActor.remote(feeding, feed_interval_s=0.1)
    client = RayCacheClient(store)
    for i in range(3):
        client.publish("m", block(i), None)
    until(lambda: all(ray.get(directory.holders.remote(bid(i))) == {node: "hot"}
                      for i in range(3)))
    feed = asyncio.run(client.stats())["directory_feed"]
    assert feed["snapshots"] >= 1 and feed["last_error"] is None
    ray.kill(store)
    # A new store on the node (a restart: its RAM is empty) replaces the node's entries.
    store = CacheStoreActor.remote(feeding, feed_interval_s=0.1)
    ray.get(store.stats.remote(), timeout=60)
    until(lambda: ray.get(directory.holders.remote(bid(0))) == {})
    assert ray.get(directory.nodes.remote()) == {node: 0}
    ray.kill(store)


@pytest.mark.usefixtures("local_ray")
def test_a_one_node_server_does_not_feed_a_directory_by_default():
    import time

    import ray

    from serve_app.config.profile import CacheStoreProfile
    from serve_app.store.actor import CacheStoreActor

    store = CacheStoreActor.remote(CacheStoreProfile(hot_budget=1 << 24, ssd=False),
                                   feed_interval_s=0.1)
    time.sleep(1.0)
    feed = ray.get(store.stats.remote(), timeout=60)["directory_feed"]
    assert not feed["active"] and feed["batches"] == 0
    ray.kill(store)
