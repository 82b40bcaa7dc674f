"""The block directory actor on a real one-node Ray: a follower resyncs with a new
directory actor, a store actor feeds it (and a restarted one starts over), a one-node
server feeds none (the directory's own logic: tests/unit/test_directory.py)."""

from __future__ import annotations

import pytest

from serve_app.cache.match import BlockEvent
from serve_app.cluster.directory import EventBatch
from tests.support.servers import wait_for


def batch(node: str, seq: int, *events: tuple[str, str | None], epoch: str = "e1",
          full: bool = False) -> EventBatch:
    return EventBatch(node, epoch, seq, tuple(BlockEvent(b, t) for b, t in events), full)


@pytest.mark.usefixtures("local_ray")
def test_a_follower_resyncs_with_a_new_directory_actor():
    """On a real Ray: the directory actor is killed and a new one (another incarnation,
    fed other blocks, further along its log) takes its name; the follower drops its copy
    and matches the new directory."""
    import ray

    from serve_app.cluster.directory_service import DirectoryFollower, get_or_create_directory

    first = get_or_create_directory()
    ray.get(first.apply.remote(batch("A", 1, ("b0", "hot"), full=True)), timeout=60)
    follower = DirectoryFollower(0.05).start()
    try:
        wait_for(lambda: follower.prefix_by_node(["b0"]) == {"A": ["hot"]},
                 "the follower to see the first directory's block", interval=0.05)
        seen = follower.snapshot()["incarnation"]
        assert seen == ray.get(first.incarnation.remote())
        ray.kill(first, no_restart=True)
        second = get_or_create_directory()
        ray.get(second.apply.remote(batch("B", 1, ("b1", "hot"), ("b2", "hot"), full=True)),
                timeout=60)
        ray.get(second.apply.remote(batch("B", 2, ("b3", "ssd"))), timeout=60)
        wait_for(lambda: follower.snapshot()["incarnation"] == ray.get(
            second.incarnation.remote()), "the follower to follow the new directory",
            interval=0.05)
        wait_for(lambda: follower.prefix_by_node(["b1", "b2", "b3"]) == {
            "B": ["hot", "hot", "ssd"]}, "the follower to see the new directory's blocks",
            interval=0.05)
        assert follower.prefix_by_node(["b0"]) == {}  # nothing of the old directory left
        assert follower.snapshot()["resyncs"] >= 1
        ray.kill(second, no_restart=True)
    finally:
        follower.stop()


# ---- the feed: a node's tiers as directory events ------------------------------------


@pytest.mark.usefixtures("local_ray")
def test_a_store_actor_feeds_the_directory_and_a_restarted_one_starts_over():
    import asyncio

    import ray

    from serve_app.cluster.directory_service import get_or_create_directory
    from serve_app.config.profile import CacheStoreProfile
    from serve_app.store.actor import CacheStoreActor
    from serve_app.store.client import RayCacheClient
    from tests.support.blocks import bid, block

    directory = get_or_create_directory()
    node = ray.get_runtime_context().get_node_id()
    feeding = CacheStoreProfile(hot_budget=1 << 24, ssd=False, directory="on")

    store = CacheStoreActor.remote(feeding, feed_interval_s=0.1)
    client = RayCacheClient(store)
    for i in range(3):
        client.publish("m", block(i), None)
    wait_for(lambda: all(ray.get(directory.holders.remote(bid(i))) == {node: "hot"}
                         for i in range(3)), "the store's blocks in the directory", 20)
    feed = asyncio.run(client.stats())["directory_feed"]
    assert feed["snapshots"] >= 1 and feed["last_error"] is None
    ray.kill(store)
    # A new store on the node (a restart: its RAM is empty) replaces the node's entries.
    store = CacheStoreActor.remote(feeding, feed_interval_s=0.1)
    ray.get(store.stats.remote(), timeout=60)
    wait_for(lambda: ray.get(directory.holders.remote(bid(0))) == {},
             "the restarted store to replace the node's entries", 20)
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
