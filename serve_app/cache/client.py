"""How a model replica talks to the cache store.

``CacheClient`` is the replica's view: publish captured blocks (from the
engine thread, never blocking it), fetch a restorable chain across tiers, and
release pins. Fetching reads SSD block files and the one sidecar it needs
directly (the store is on the same node), validates them, and on any bad file
tells the store to drop it and looks again: a corrupt block is a clean miss
from that block on, a bad checkpoint a walkback. Blocks read from SSD are
promoted into the hot tier.

``LocalCacheClient`` keeps a ``TieredStore`` in-process (tests, one process);
``serve_app.cache.actor.RayCacheClient`` talks to the per-node actor.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from serve_app.cache import codecs
from serve_app.cache.blocks import CapturedBlock, Payload, validate_checkpoint
from serve_app.cache.hot import HotEntry
from serve_app.cache.layout import Layout
from serve_app.cache.ssd import SSDError, read_file
from serve_app.cache.tiers import DiskInfo, Source, TieredStore

MAX_ATTEMPTS = 8


@dataclass
class FetchedChain:
    """Result of a fetch: what is present and the payloads to restore."""

    present: int
    walkbacks: int
    payloads: list[tuple[Payload, dict[str, str]]]
    lease: int | None
    first_missing_evicted: bool
    tiers: list[str] = field(default_factory=list)
    checkpoint_rejects: int = 0
    sidecar_loads: int = 0
    ssd_bytes: int = 0
    ssd_seconds: float = 0.0


class BadFile(Exception):
    def __init__(self, kind: str, block_id: str) -> None:
        super().__init__(f"{kind} {block_id}")
        self.kind = kind
        self.block_id = block_id


class CacheClient:
    """Shared fetch logic; subclasses say how to reach the store."""

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None) -> None:
        raise NotImplementedError

    async def _lookup(self, block_ids: list[str], need_checkpoint: bool, layout: str) -> dict:
        raise NotImplementedError

    async def _resolve(self, handle: Any) -> tuple[Payload, dict[str, str]]:
        raise NotImplementedError

    async def _drop(self, kind: str, layout: str, block_id: str) -> None:
        raise NotImplementedError

    async def release(self, lease: int | None) -> None:
        raise NotImplementedError

    async def stats(self) -> dict:
        raise NotImplementedError

    async def fetch(self, model: str, block_ids: list[str], layout: Layout,
                    expect: dict[str, str]) -> FetchedChain:
        """The longest restorable chain, payloads loaded; retried past bad files."""
        rejects = 0
        for _ in range(MAX_ATTEMPTS):
            found = await self._lookup(block_ids, layout.hybrid, layout.digest)
            try:
                tic = time.perf_counter()
                payloads, loads = await self._load(model, block_ids, found["sources"], layout,
                                                   expect)
                toc = time.perf_counter()
            except BadFile as bad:
                await self.release(found["lease"])
                await self._drop(bad.kind, layout.digest, bad.block_id)
                rejects += bad.kind != "block"
                continue
            except BaseException:  # cancelled or unexpected: never leave pins behind
                asyncio.ensure_future(self.release(found["lease"]))
                raise
            # A rejected checkpoint shows up as a walkback of the next lookup.
            tiers = [s.tier for s in found["sources"]]
            ssd_bytes = sum(a.nbytes for (p, _), t in zip(payloads, tiers, strict=True)
                            if t == "ssd" for a in p.values())
            return FetchedChain(found["present"], found["walkbacks"], payloads,
                                found["lease"], found["first_missing_evicted"], tiers, rejects,
                                loads, ssd_bytes, (toc - tic) if ssd_bytes else 0.0)
        return FetchedChain(0, 0, [], None, False, [], rejects, 0)

    async def _load(self, model: str, block_ids: list[str], sources: list[Source],
                    layout: Layout, expect: dict[str, str]):
        payloads: list[tuple[Payload, dict[str, str]]] = []
        sidecar_loads = 0
        loop = asyncio.get_running_loop()
        # Read every SSD block file at once; the disk does better with queue depth.
        reads = await asyncio.gather(*(
            loop.run_in_executor(None, _read_or_none, s.handle, {**expect, "block_id": b})
            for b, s in zip(block_ids, sources, strict=False) if s.tier == "ssd"))
        files = iter(reads)
        for i, source in enumerate(sources):
            last = i == len(sources) - 1
            bid = block_ids[i]
            meta: dict[str, str] = {}
            tensors: dict = {}
            if source.tier != "ssd":
                try:
                    payload, dtypes = await self._resolve(source.handle)
                except LookupError:
                    raise BadFile("lost", bid) from None
            else:
                read = next(files)
                if read is None:
                    raise BadFile("block", bid)
                tensors, meta = read
                dtypes = json.loads(meta.get("dtypes", "{}"))
                payload = {k: v for k, v in tensors.items() if not k.startswith("s")}
            has_checkpoint = False
            if last and layout.hybrid:
                if source.checkpoint is None:  # carried by the hot/pending payload itself
                    if not validate_checkpoint(layout, payload):
                        raise BadFile("checkpoint", bid)
                else:
                    state = await self._load_checkpoint(loop, source, tensors, bid, expect)
                    if not validate_checkpoint(layout, state):
                        raise BadFile("sidecar" if source.checkpoint != "embedded" else "block",
                                      bid)
                    payload = {**payload, **state}
                    sidecar_loads += source.checkpoint != "embedded"
                has_checkpoint = True
            payloads.append((payload, dtypes))
            if source.tier == "ssd":  # promote to the hot tier
                self.publish(model, CapturedBlock(bid, meta.get("parent_id", ""), i, payload,
                                                  dtypes, has_checkpoint), None)
        return payloads, sidecar_loads

    async def _load_checkpoint(self, loop, source: Source, tensors: dict, bid: str,
                               expect: dict[str, str]) -> dict:
        if source.checkpoint == "embedded":
            return {k: v for k, v in tensors.items() if k.startswith("s")}
        if source.checkpoint is None:
            raise BadFile("sidecar", bid)
        try:
            encoded, meta = await loop.run_in_executor(
                None, read_file, source.checkpoint, {**expect, "block_id": bid})
            codec_meta = json.loads(meta.get("codec_meta", "{}"))
            if not codec_meta:
                raise SSDError("no codec metadata")
            return {name: codecs.decode(name, encoded, m) for name, m in codec_meta.items()}
        except Exception:  # unreadable, wrong metadata, or a codec that does not decode
            raise BadFile("sidecar", bid) from None


def _read_or_none(path: str, expect: dict[str, str]) -> tuple[dict, dict] | None:
    try:
        return read_file(path, expect)
    except SSDError:
        return None


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
    """A ``TieredStore`` in this process; payloads are kept as they are."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._lock = threading.Lock()

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None) -> None:
        self.store.put(entry_for(model, block, (block.payload, block.dtypes)), disk)

    async def _lookup(self, block_ids: list[str], need_checkpoint: bool, layout: str) -> dict:
        return self.store.lookup(block_ids, need_checkpoint, layout)

    async def _resolve(self, handle: Any) -> tuple[Payload, dict[str, str]]:
        return handle

    async def _drop(self, kind: str, layout: str, block_id: str) -> None:
        self.store.drop(kind, layout, block_id)

    async def release(self, lease: int | None) -> None:
        self.store.release(lease)

    async def stats(self) -> dict:
        return self.store.snapshot()
