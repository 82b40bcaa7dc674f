"""How a model replica talks to the cache store.

``CacheClient`` is the replica's view: publish captured blocks (from the
engine thread, never blocking it), look up and fetch a chain, release pins.
``LocalCacheClient`` keeps a ``HotStore`` in-process (tests, single process);
``serve_app.cache.actor.RayCacheClient`` talks to the per-node actor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from serve_app.cache.blocks import CapturedBlock, Payload
from serve_app.cache.hot import HotEntry, HotStore


@dataclass
class FetchedChain:
    """Result of a lookup: how many blocks are present and the payloads to restore."""

    present: int
    walkbacks: int
    payloads: list[tuple[Payload, dict[str, str]]]
    lease: int | None
    first_missing_evicted: bool


class CacheClient:
    """Interface; see the module docstring."""

    def publish(self, model: str, block: CapturedBlock) -> None:
        raise NotImplementedError

    async def fetch(self, block_ids: list[str], need_checkpoint: bool) -> FetchedChain:
        raise NotImplementedError

    async def release(self, lease: int | None) -> None:
        raise NotImplementedError

    async def drop_checkpoint(self, block_id: str) -> bool:
        raise NotImplementedError

    async def stats(self) -> dict:
        raise NotImplementedError


def entry_for(model: str, block: CapturedBlock, handle) -> HotEntry:
    return HotEntry(
        block_id=block.block_id,
        parent_id=block.parent_id,
        nbytes=block.nbytes,
        has_checkpoint=block.has_checkpoint,
        handle=handle,
        model=model,
    )


class LocalCacheClient(CacheClient):
    """A ``HotStore`` in this process; payloads are kept as they are."""

    def __init__(self, store: HotStore) -> None:
        self.store = store
        self._lock = threading.Lock()

    def publish(self, model: str, block: CapturedBlock) -> None:
        with self._lock:
            self.store.put(entry_for(model, block, (block.payload, block.dtypes)))

    async def fetch(self, block_ids: list[str], need_checkpoint: bool) -> FetchedChain:
        with self._lock:
            found = self.store.lookup(block_ids, need_checkpoint)
        return FetchedChain(found.present, found.walkbacks, list(found.handles), found.lease,
                            found.first_missing_evicted)

    async def release(self, lease: int | None) -> None:
        with self._lock:
            self.store.release(lease)

    async def drop_checkpoint(self, block_id: str) -> bool:
        with self._lock:
            return self.store.drop_checkpoint(block_id)

    async def stats(self) -> dict:
        with self._lock:
            return self.store.snapshot()
