"""Faults and concurrency of the cache-store actor, on a real local Ray.

A second server on a locked directory serves without SSD and says why; a slow
put (staging backpressure, inline write) or a lookup waiting for the SSD index
holds up no other call; a replica's lookup always sees the blocks it published
before; a block that cannot be published is counted.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import ray

from serve_app.cache.match import MatchQuery
from serve_app.cache.payload import BlockPayload, CapturedBlock, Tensor
from serve_app.config.profile import CacheStoreProfile
from serve_app.metrics.table import DROP_REASONS
from serve_app.store.actor import ACTOR_OPTIONS, CacheStore, CacheStoreActor, make_ssd, store_name
from serve_app.store.client import MAX_UNACKED_PUTS, RayCacheClient
from tests.support.blocks import DISK, LAYOUT, bid
from tests.support.servers import wait_for


def ssd_config(root: Path, **over) -> CacheStoreProfile:
    return CacheStoreProfile(**{"hot_budget": 1 << 20, "ssd": True, "ssd_dir": str(root),
                                "ssd_cache_max_size": 1 << 30, "ssd_min_free": 0, **over})


NO_SSD = CacheStoreProfile(ssd=False)


def payload(i: int, nbytes: int = 4096) -> BlockPayload:
    half = Tensor(np.full(nbytes // 8, i, dtype=np.float32), "float32")
    return BlockPayload({0: (half, half)})


def block(i: int, nbytes: int = 4096) -> CapturedBlock:
    return CapturedBlock(bid(i), bid(i - 1), payload(i, nbytes))


def answered_first(quick, slow) -> bool:
    """Whether the call ``quick`` was answered before ``slow``, sent before it, was: the
    actor did not make it wait behind ``slow``."""
    ready, _ = ray.wait([quick, slow], num_returns=1, timeout=30)
    return ready == [quick]


def test_stats_show_why_the_ssd_tier_is_off(local_ray, tmp_path):
    holder, _ = make_ssd(ssd_config(tmp_path))  # this process serves the directory
    actor = CacheStoreActor.remote(ssd_config(tmp_path))
    stats = ray.get(actor.stats.remote(), timeout=60)
    assert f"process {os.getpid()}" in stats["ssd"]["disabled"]
    assert str(tmp_path) in stats["ssd"]["disabled"]
    assert ray.get(actor.samples.remote(), timeout=30)  # the pump copes with a disabled tier
    ray.kill(actor)


def test_stats_show_an_untrusted_directory(local_ray, tmp_path):
    """A group-writable cache directory: the store serves without SSD, and its stats (the
    ``cache_store`` section of ``/v1/stats``) name the directory and why."""
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o775)
    actor = CacheStoreActor.remote(ssd_config(root))
    disabled = ray.get(actor.stats.remote(), timeout=60)["ssd"]["disabled"]
    assert str(root) in disabled and "writable by group" in disabled
    assert not (root / "v1").exists()
    ray.kill(actor)


def test_a_slow_put_does_not_hold_up_other_calls(local_ray, tmp_path):
    """A staging area of one byte: every put waits for room (backpressure, 0.5 s), then
    writes inline. Meanwhile stats and lookups are answered before a put sent before
    them, and a replica keeps at most MAX_UNACKED_PUTS puts in flight."""
    actor = CacheStoreActor.remote(ssd_config(tmp_path, gdn_ssd_pending_max_size=1))
    ray.get(actor.stats.remote(), timeout=60)
    client = RayCacheClient(actor)
    for i in range(12):
        client.publish("m", block(i), DISK)
    wait_for(lambda: client._in_flight >= MAX_UNACKED_PUTS, "the slow puts running", 10,
             interval=0.01)
    most = 0
    for i in range(5):
        put = actor.put.remote("m", bid(200 + i), "", 4096, False, [ray.put(payload(i))],
                               DISK)
        assert answered_first(actor.stats.remote(), put), "stats waited behind a put"
        lookup = actor.match.remote(MatchQuery([bid(100)], layout=LAYOUT))
        assert answered_first(lookup, put), "a lookup waited behind a put"
        assert ray.get(put, timeout=30) is True  # stored (written inline), not dropped
        most = max(most, client._in_flight)
    assert most <= MAX_UNACKED_PUTS
    found = asyncio.run(client._match(MatchQuery([bid(i) for i in range(12)], layout=LAYOUT)))
    assert found.present == 12  # it waited for its own puts' acks
    staging = ray.get(actor.stats.remote())["staging"]
    assert staging["backpressure_seconds"] > 0 and staging["inline_writes"] > 0
    ray.kill(actor)


class IndexNotReady(CacheStore):
    """Injected: the SSD index stays "rebuilding", so every lookup waits its full 2 s
    for it, counted while it waits. (Really slow indexing needs a directory of ~10^5
    files: minutes to build here.)"""

    def __init__(self, config: CacheStoreProfile) -> None:
        super().__init__(config)
        assert self.tiers.ssd.ready.wait(30), "the SSD index was never read"
        self.tiers.ssd.ready.clear()
        self.lookups_waiting = 0

    def match(self, q: MatchQuery):
        self.lookups_waiting += 1
        try:
            return super().match(q)
        finally:
            self.lookups_waiting -= 1

    def waiting(self) -> int:
        return self.lookups_waiting


def test_a_lookup_waiting_for_the_index_does_not_hold_up_other_calls(local_ray, tmp_path):
    actor = ray.remote(**ACTOR_OPTIONS)(IndexNotReady).remote(ssd_config(tmp_path))
    ray.get(actor.stats.remote(), timeout=60)
    slow = actor.match.remote(MatchQuery([bid(0)], layout=LAYOUT))
    wait_for(lambda: ray.get(actor.waiting.remote(), timeout=30) == 1,
             "the lookup waiting for the index", 10, interval=0.02)
    assert answered_first(actor.stats.remote(), slow), "stats waited behind a lookup"
    ref = ray.put(payload(0))
    put = actor.put.remote("m", bid(0), "", 4096, False, [ref], None)
    assert answered_first(put, slow), "a put waited behind a lookup"
    assert not ray.wait([slow], timeout=0)[0]  # still waiting for the index
    assert ray.get(slow, timeout=30).present == 1
    ray.kill(actor)


def test_back_to_back_publish_then_lookup_sees_the_block(local_ray):
    """Calls run concurrently in the actor, so call order is no promise: the client waits
    for the acks of its earlier puts, and the very next lookup always sees the block."""
    actor = CacheStoreActor.remote(CacheStoreProfile(hot_budget=1 << 24, ssd=False))
    ray.get(actor.stats.remote(), timeout=60)
    client = RayCacheClient(actor)

    async def turns() -> None:
        for i in range(50):
            client.publish("m", block(i), None)
            found = await client._match(MatchQuery([bid(i)], layout=LAYOUT))
            assert found.present == 1, f"turn {i} missed its own block"
            await client.release(found.lease)

    asyncio.run(turns())
    ray.kill(actor)


class Unpicklable:
    """A payload Ray cannot serialize: the publish fails in the replica."""

    nbytes = 16
    has_state = False

    def __reduce__(self):
        raise TypeError("this payload cannot be serialized")


def test_a_block_that_cannot_be_published_is_counted(local_ray):
    actor = CacheStoreActor.remote(NO_SSD)
    ray.get(actor.stats.remote(), timeout=60)
    client = RayCacheClient(actor)
    client.publish("m", CapturedBlock(bid(0), "", Unpicklable()), None)
    found = asyncio.run(client._match(MatchQuery([bid(0)], layout=LAYOUT)))  # not held up
    assert found.present == 0 and client.dropped == 1

    def counted() -> dict | None:
        stats = asyncio.run(client.stats())
        return stats if stats["dropped"]["publish"] == 1 else None

    stats = wait_for(counted, "the dropped publish counted by the store", 10, interval=0.05)
    assert stats["publisher"]["dropped"] == 1
    samples = {s.labels["reason"]: s.value for s in ray.get(actor.samples.remote(), timeout=30)
               if s.name == "serve_app_cache_dropped_blocks"}
    assert samples == {**dict.fromkeys(DROP_REASONS, 0), "publish": 1}
    ray.kill(actor)


class OldProtocolStore(CacheStore):
    """A store actor left running by older code: its methods no longer match."""

    PROTOCOL = 1


class NoProtocolStore:
    """Older still: no ``protocol`` method at all."""

    def __init__(self, config: CacheStoreProfile) -> None:
        pass

    def stats(self) -> dict:
        return {}


@pytest.mark.parametrize("old_cls", [OldProtocolStore, NoProtocolStore])
def test_an_outdated_store_actor_is_replaced(local_ray, old_cls):
    from serve_app.cluster.directory_service import NAMESPACE
    from serve_app.store.actor import get_or_create_actor

    name = store_name(ray.get_runtime_context().get_node_id())
    remote = ray.remote(**ACTOR_OPTIONS) if issubclass(old_cls, CacheStore) else ray.remote
    old = remote(old_cls).options(
        name=name, namespace=NAMESPACE, lifetime="detached").remote(NO_SSD)
    ray.get(old.stats.remote(), timeout=60)
    actor = get_or_create_actor(NO_SSD, timeout=60)
    assert ray.get(actor.protocol.remote(), timeout=30) == CacheStore.PROTOCOL
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.stats.remote(), timeout=30)  # the old one is gone
    assert get_or_create_actor(NO_SSD) is not None  # and kept from now on
    ray.kill(actor)
