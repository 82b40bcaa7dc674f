"""Ray glue for the cache store: one actor per node, and the replica's client.

The actor owns the tiers' state (hot index, staging, SSD index and writes);
payload bytes sit in Ray's shared-memory object store. A replica ``ray.put``s
a captured block once and hands the actor the reference; a restoring replica
gets the references back and reads the arrays zero-copy (or reads SSD files
itself), so the only copy on restore is the one into MLX arrays.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.cache.blocks import CapturedBlock, Payload
from serve_app.cache.client import CacheClient
from serve_app.cache.hot import HotEntry
from serve_app.cache.ssd import SSDStore, auto_budget, default_cache_dir
from serve_app.cache.tiers import DiskInfo, TieredStore
from serve_app.metrics import MetricsPump, RayRecorder, store_samples

logger = logging.getLogger(__name__)

NAMESPACE = "serve_app"
PUBLISH_QUEUE_BLOCKS = 256


def make_ssd(config: dict) -> SSDStore | None:
    """The SSD tier a ``CacheStoreProfile`` asks for, with its directory locked."""
    if not config.get("ssd"):
        return None
    root = Path(config.get("ssd_dir") or default_cache_dir()).expanduser()
    budget = config.get("ssd_cache_max_size", "auto")
    if budget == "auto":
        budget = auto_budget(root)
    store = SSDStore(root, int(budget), int(config.get("ssd_min_free", 0)))
    if not store.lock_directory():
        logger.warning("cache directory %s is locked by another process; sharing it", root)
    return store


@ray.remote(num_cpus=0, max_restarts=-1)
class CacheStoreActor:
    """The per-node cache store. Sequential: every call sees the previous one."""

    def __init__(self, hot_budget: int, config: dict) -> None:
        self.tiers = TieredStore(
            hot_budget,
            make_ssd(config),
            int(config.get("gdn_ssd_pending_max_size", 512 * 1000 * 1000)),
            resolve=ray.get,
        )
        self.names: dict[str, str] = {}  # model identity[:16] -> a name it is served under
        recorder = RayRecorder("store", serve=False)
        self.pump = MetricsPump(recorder, self._metric_samples, name="cache-metrics").start()

    def _metric_samples(self) -> list:
        return store_samples(self.tiers.snapshot(), dict(self.names))

    def put(self, model: str, block_id: str, parent_id: str, nbytes: int,
            has_checkpoint: bool, refs: list, disk: DiskInfo | None) -> None:
        entry = HotEntry(block_id, parent_id, nbytes, has_checkpoint, handle=refs[0], model=model)
        self.tiers.put(entry, disk)

    def activate(self, name: str, model: str, layout: str) -> None:
        """A replica serves model identity ``model`` as ``name``: its files are evicted last."""
        self.names.setdefault(model[:16], name)
        if self.tiers.ssd is not None:
            self.tiers.ssd.active.add((model, layout))

    def lookup(self, block_ids: list[str], need_checkpoint: bool, layout: str) -> dict:
        return self.tiers.lookup(block_ids, need_checkpoint, layout)

    def release(self, lease: int | None) -> None:
        self.tiers.release(lease)

    def drop(self, kind: str, layout: str, block_id: str) -> None:
        self.tiers.drop(kind, layout, block_id)

    def stats(self) -> dict:
        return self.tiers.snapshot()


def get_or_create_actor(hot_budget: int, config: dict):
    """The cache-store actor of this node, created by the first replica that asks."""
    node_id = ray.get_runtime_context().get_node_id()
    return CacheStoreActor.options(
        name=f"cache-store-{node_id}",
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(hot_budget, config)


class RayCacheClient(CacheClient):
    """Publishes from a background thread so the engine thread never waits on Ray."""

    def __init__(self, actor) -> None:
        self.actor = actor
        # Bounded: if Ray falls behind, the engine waits instead of memory growing.
        self._queue: queue.Queue = queue.Queue(maxsize=PUBLISH_QUEUE_BLOCKS)
        self._cv = threading.Condition()
        self._seq = 0
        self._unsubmitted: set[int] = set()
        self._thread = threading.Thread(target=self._publisher, name="cache-publish",
                                        daemon=True)
        self._thread.start()

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None) -> None:
        with self._cv:
            self._seq += 1
            seq = self._seq
            self._unsubmitted.add(seq)
        self._queue.put((seq, model, block, disk))

    def _publisher(self) -> None:
        while True:
            seq, model, block, disk = self._queue.get()
            try:
                ref = ray.put((block.payload, block.dtypes))
                self.actor.put.remote(model, block.block_id, block.parent_id, block.nbytes,
                                      block.has_checkpoint, [ref], disk)
            except Exception:
                logger.exception("publishing block %s failed", block.block_id)
            finally:
                with self._cv:
                    self._unsubmitted.discard(seq)
                    self._cv.notify_all()

    def _wait_submitted(self, seqs: set[int]) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not (seqs & self._unsubmitted))

    async def _lookup(self, block_ids: list[str], need_checkpoint: bool, layout: str) -> dict:
        # Blocks published before this lookup must be visible to it: wait until the
        # publisher has submitted those (actor calls from one process run in order),
        # not the ones published after.
        with self._cv:
            before = set(self._unsubmitted)
        if before:
            await asyncio.get_running_loop().run_in_executor(None, self._wait_submitted, before)
        return await self.actor.lookup.remote(block_ids, need_checkpoint, layout)

    async def _resolve(self, handle: Any) -> tuple[Payload, dict[str, str]]:
        try:
            return await handle
        except ray.exceptions.RayError:  # its owner died: those bytes are gone
            raise LookupError("hot block lost with its owner") from None

    async def _drop(self, kind: str, layout: str, block_id: str) -> None:
        await self.actor.drop.remote(kind, layout, block_id)

    async def release(self, lease: int | None) -> None:
        if lease is not None:
            await self.actor.release.remote(lease)

    async def stats(self) -> dict:
        return await self.actor.stats.remote()
