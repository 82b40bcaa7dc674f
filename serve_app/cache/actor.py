"""Ray glue for the cache store: one actor per node, and the replica's client.

The actor owns the index (budget, LRU, pins) of the hot tier; payload bytes
sit in Ray's shared-memory object store. A replica ``ray.put``s a captured
block once and hands the actor the reference; a restoring replica gets the
references back and reads the arrays zero-copy, so the only copy on restore is
the one into MLX arrays.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.cache.blocks import CapturedBlock
from serve_app.cache.client import CacheClient, FetchedChain
from serve_app.cache.hot import HotEntry, HotStore

logger = logging.getLogger(__name__)

NAMESPACE = "serve_app"


@ray.remote(num_cpus=0, max_restarts=-1)
class CacheStoreActor:
    """The per-node hot tier index. Sequential: every call sees the previous one."""

    def __init__(self, budget_bytes: int) -> None:
        self.store = HotStore(budget_bytes)

    def put(self, model: str, block_id: str, parent_id: str, nbytes: int,
            has_checkpoint: bool, refs: list) -> bool:
        return self.store.put(
            HotEntry(block_id, parent_id, nbytes, has_checkpoint, handle=refs[0], model=model)
        )

    def lookup(self, block_ids: list[str], need_checkpoint: bool) -> dict:
        found = self.store.lookup(block_ids, need_checkpoint)
        return {
            "present": found.present,
            "walkbacks": found.walkbacks,
            "refs": found.handles,  # stay references: nested in a dict
            "lease": found.lease,
            "first_missing_evicted": found.first_missing_evicted,
        }

    def release(self, lease: int | None) -> None:
        self.store.release(lease)

    def remove(self, block_ids: list[str]) -> int:
        return sum(self.store.remove(b) for b in block_ids)

    def drop_checkpoint(self, block_id: str) -> bool:
        return self.store.drop_checkpoint(block_id)

    def stats(self) -> dict:
        return self.store.snapshot()


def get_or_create_actor(budget_bytes: int):
    """The cache-store actor of this node, created by the first replica that asks."""
    node_id = ray.get_runtime_context().get_node_id()
    return CacheStoreActor.options(
        name=f"cache-store-{node_id}",
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(budget_bytes)


class RayCacheClient(CacheClient):
    """Publishes from a background thread so the engine thread never waits on Ray."""

    def __init__(self, actor) -> None:
        self.actor = actor
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._publisher, name="cache-publish",
                                        daemon=True)
        self._thread.start()

    def publish(self, model: str, block: CapturedBlock) -> None:
        self._queue.put((model, block))

    def _publisher(self) -> None:
        while True:
            model, block = self._queue.get()
            try:
                ref = ray.put((block.payload, block.dtypes))
                self.actor.put.remote(model, block.block_id, block.parent_id, block.nbytes,
                                      block.has_checkpoint, [ref])
            except Exception:
                logger.exception("publishing block %s failed", block.block_id)
            finally:
                self._queue.task_done()

    async def fetch(self, block_ids: list[str], need_checkpoint: bool) -> FetchedChain:
        # Blocks captured before this lookup must be visible to it: wait until the
        # publisher has submitted them (actor calls from one process run in order).
        await asyncio.get_running_loop().run_in_executor(None, self._queue.join)
        found = await self.actor.lookup.remote(block_ids, need_checkpoint)
        payloads = []
        if found["refs"]:
            try:
                payloads = list(await asyncio.gather(*found["refs"]))
            except asyncio.CancelledError:
                self.actor.release.remote(found["lease"])  # never leave blocks pinned
                raise
            except Exception:  # the owner of a block died: those bytes are gone
                logger.warning("hot blocks lost with their owner; dropping them")
                await self.actor.release.remote(found["lease"])
                await self.actor.remove.remote(block_ids[: len(found["refs"])])
                return FetchedChain(0, 0, [], None, True)
        return FetchedChain(found["present"], found["walkbacks"], payloads, found["lease"],
                            found["first_missing_evicted"])

    async def release(self, lease: int | None) -> None:
        if lease is not None:
            await self.actor.release.remote(lease)

    async def drop_checkpoint(self, block_id: str) -> bool:
        return await self.actor.drop_checkpoint.remote(block_id)

    async def stats(self) -> dict:
        return await self.actor.stats.remote()
