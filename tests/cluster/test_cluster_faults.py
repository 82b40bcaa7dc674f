"""Cross-node fetch and the block directory on a real multi-node Ray cluster.

Two (then three) Ray nodes on this machine (``ray.cluster_utils.Cluster``), a cache
store on each, the cluster's block directory. This process plays a replica on the
head node: it fetches through Ray's object store what another node's store holds,
sees a node die in the middle of a fetch (a clean miss, not a hang), and sees the
directory forget the dead node and learn a node that joins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.cache.client import FetchRequest
from serve_app.cache.hashing import chain
from serve_app.cache.layout import KV, ArraySpec, Layout
from serve_app.cache.match import Match, MatchQuery
from serve_app.cache.payload import BlockPayload, Tensor
from serve_app.cluster.directory_service import DIRECTORY_NAME, NAMESPACE, DirectoryFollower
from serve_app.config.profile import CacheStoreProfile
from serve_app.store.actor import ACTOR_OPTIONS, CacheStore, store_name
from serve_app.store.client import RayCacheClient
from tests.support import REPO, servers

BS = 4
LAYOUT = Layout((KV,), arrays=((ArraySpec((1, 2, None, 8), "float32"),) * 2,), epoch="t")
EXPORT_DELAY_S = 4.0


class SlowStore(CacheStore):
    """A store whose exports take a while: the window in which its node is killed."""

    def export(self, req):
        time.sleep(EXPORT_DELAY_S)
        return super().export(req)


def payload(seed: int) -> BlockPayload:
    rng = np.random.default_rng(seed)
    arrays = tuple(Tensor(rng.standard_normal((1, 2, BS, 8)).astype(np.float32), "float32")
                   for _ in range(2))
    return BlockPayload({0: arrays})


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray_cluster_faults")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 << 20})
    c.add_node(num_cpus=1, object_store_memory=100 << 20)
    try:
        ray.init(address=c.address, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def store_on(node_id: str, cls=CacheStore):
    """The node's store actor, named as replicas find it, feeding the directory."""
    return ray.remote(**ACTOR_OPTIONS)(cls).options(
        name=store_name(node_id), namespace=NAMESPACE, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(CacheStoreProfile(hot_budget=1 << 26, ssd=False, directory="on"),
             feed_interval_s=0.2)


def fill(store, node_id: str, tokens: list[int]) -> list[str]:
    """Put a chain's blocks into a store (as that node's replica would)."""
    ids = chain("root", tokens, BS)
    parents = ["root", *ids]
    refs = []
    for i, block_id in enumerate(ids):
        p = payload(i)
        refs.append(store.put.remote("m", block_id, parents[i], p.nbytes, False,
                                     [ray.put(p)], None,
                                     tuple(tokens[i * BS:(i + 1) * BS])))
    assert all(ray.get(refs, timeout=60))
    return ids


def request(ids: list[str], tokens: list[int]) -> FetchRequest:
    return FetchRequest("m", ids, LAYOUT, BS, {}, root="root", tokens=tuple(tokens[:-1]))


def eventually(check: Callable[[], Any], what: str) -> Any:
    """The shared ``wait_for`` at this file's pace: a minute, polled every 0.2 s."""
    return servers.wait_for(check, what, timeout=60.0, interval=0.2)


def test_fetch_through_the_object_store_then_node_death_then_a_new_node(cluster, caplog):
    head = ray.get_runtime_context().get_node_id()
    (other,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    local = store_on(head)
    remote = store_on(other, SlowStore)
    tokens = list(range(6 * BS + 1))
    ids = fill(remote, other, tokens)

    directory = eventually(lambda: _directory(), what="the directory actor")
    eventually(lambda: ray.get(directory.holders.remote(ids[-1])) == {other: "hot"},
             what="the directory to list the other node's blocks")
    follower = DirectoryFollower(0.1).start()
    try:
        check_fetch_and_node_loss(cluster, local, other, ids, tokens, directory,
                                  RayCacheClient(local, follower), caplog)
    finally:
        follower.stop()


def check_fetch_and_node_loss(cluster, local, other, ids, tokens, directory, client, caplog):
    offer = eventually(lambda: client.remote_prefix(ids), what="the follower's copy")
    assert offer.node_id == other and offer.blocks == 6

    # A fetch of the blocks past the first two crosses the object store, checked and
    # promoted into this node's store.
    got = asyncio.run(client.fetch_remote(request(ids, tokens), 2, other, timeout=60))
    assert got is not None and len(got.payloads) == 4 and got.seconds >= EXPORT_DELAY_S
    for i, p in enumerate(got.payloads):
        np.testing.assert_array_equal(p.kv[0][0].data, payload(2 + i).kv[0][0].data)
    eventually(lambda: _lookup(local, ids[2:]).present == 4, what="the promotion")

    # The other node dies while its store prepares an export: a clean miss, ended by the
    # node's death (Ray's actor error), not by the fetch's timeout.
    killer = threading.Timer(1.0, cluster.remove_node, args=(_node(cluster, other),))
    killer.start()
    with caplog.at_level(logging.WARNING, logger="serve_app.store.client"):
        got = asyncio.run(client.fetch_remote(request(ids, tokens), 0, other, timeout=120))
    killer.join(60)
    assert not killer.is_alive(), "removing the node hung"
    failed = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith(f"fetching blocks from node {other} failed")]
    assert got is None and len(failed) == 1, failed
    assert "TimeoutError" not in failed[0], failed

    # The directory forgets the dead node; a node that joins is learned from its store.
    # The directory may have lived on the dead node: then it restarts elsewhere, empty,
    # and the stores that remain send it full snapshots.
    eventually(lambda: (nodes := _nodes(directory)) is not None and other not in nodes,
             what="the directory to forget the dead node")
    eventually(lambda: client.remote_prefix(ids) is None, what="the follower to forget it")
    node = cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
    cluster.wait_for_nodes()
    new = node.node_id
    fill(store_on(new), new, tokens[: 3 * BS + 1])
    eventually(lambda: client.remote_prefix(ids) == type(offer)(new, 3),
             what="the follower to learn the new node")
    nodes = eventually(lambda: _nodes(directory), what="the directory")
    assert other not in nodes and nodes[new] == 3


def _directory():
    try:
        return ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _nodes(directory) -> dict[str, int] | None:
    """The directory's nodes; None while it restarts."""
    try:
        return ray.get(directory.nodes.remote(), timeout=30)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
        return None


def _lookup(store, ids: list[str]) -> Match:
    found = ray.get(store.match.remote(MatchQuery(ids, layout=LAYOUT.digest)), timeout=30)
    ray.get(store.release.remote(found.lease))
    return found


def _node(cluster: Cluster, node_id: str):
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
