"""How a model replica talks to the cache store.

``CacheClient`` is the replica's view: publish captured blocks (from the
engine thread, never blocking it), fetch a restorable chain across tiers, and
release pins. Fetching reads SSD block files and the one sidecar it needs
directly (the store is on the same node), validates them, and on any bad file
tells the store to drop it and looks again: a corrupt block is a clean miss
from that block on, a bad checkpoint a walkback. Blocks read from SSD are
promoted into the hot tier.

``LocalCacheClient`` keeps a ``TieredStore`` in-process (tests, one process);
``serve_app.store.client.RayCacheClient`` talks to the per-node actor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from serve_app.cache import codecs
from serve_app.cache.hot import HotEntry
from serve_app.cache.match import Drop, Match, MatchQuery, Partial, Source, StateAt, Tier
from serve_app.cache.payload import (
    BlockPayload,
    CapturedBlock,
    PayloadError,
    from_tensors,
    state_from_names,
)
from serve_app.cache.ssd_format import DiskInfo, SSDError, read_file
from serve_app.cache.tiers import TieredStore

if TYPE_CHECKING:  # layout.py imports mlx-lm; this module (and the cache policy) need not
    from serve_app.cache.layout import Layout

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
STORE_ERROR_KINDS = ("timeout", "unavailable", "error", "skipped")


class StoreError(Exception):
    """A cache-store call a request waited on failed: ``kind`` is "timeout" (no answer
    in time), "unavailable" (the store actor died or is restarting), "error"
    (anything else) or "skipped" (the store's circuit breaker is open). The request
    goes on without the cache: a cold prefill, never a failed request."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"cache store {kind}: {detail}" if detail else f"cache store {kind}")
        self.kind = kind


def store_error_kind(exc: BaseException) -> str:
    """How a failed store call is counted (``serve_app_prefix_cache_store_errors``)."""
    if isinstance(exc, StoreError):
        return exc.kind
    if isinstance(exc, TimeoutError):  # asyncio's and Ray's GetTimeoutError both are
        return "timeout"
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - Ray is a dependency
        return "error"
    return "unavailable" if isinstance(exc, (RayActorError, ActorUnavailableError)) else "error"


class CircuitBreaker:
    """Skip a peer that keeps failing: after ``failures`` failures or timeouts in a row
    it is open (skipped) for ``cool_down_s``; then one call is let through again (a
    probe) and a success closes it. Thread-safe enough for counters read by stats."""

    def __init__(self, failures: int = 3, cool_down_s: float = 10.0) -> None:
        self.threshold = max(1, failures)
        self.cool_down_s = cool_down_s
        self.failures = 0  # in a row
        self.opened = 0  # times it opened
        self._open_until = 0.0

    def allow(self) -> bool:
        """True unless open; once the cool-down has passed, one probe at a time."""
        now = time.monotonic()
        if now < self._open_until:
            return False
        if self.failures >= self.threshold:  # half open: this call probes, others wait
            self._open_until = now + self.cool_down_s
        return True

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._open_until

    def success(self) -> None:
        self.failures = 0
        self._open_until = 0.0

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            if self._open_until <= time.monotonic():
                self.opened += 1
            self._open_until = time.monotonic() + self.cool_down_s

    def snapshot(self) -> dict:
        return {"open": self.is_open, "failures_in_a_row": self.failures,
                "opened": self.opened}


@dataclass(kw_only=True)
class FetchedChain:
    """Result of a fetch: what is present and the payloads to restore."""

    present: int
    walkbacks: int
    payloads: list[BlockPayload]
    lease: int | None
    first_missing_evicted: bool
    tiers: list[Tier] = field(default_factory=list)
    checkpoint_rejects: int = 0
    incompatible: int = 0  # payloads whose shapes or dtypes did not fit the layout
    incompatible_reason: str | None = None
    partial: Partial | None = None  # the last payload is a tail, or cut on restore
    block_tokens: list[int] = field(default_factory=list)  # tokens restored from each payload
    sidecar_loads: int = 0
    ssd_bytes: int = 0
    ssd_seconds: float = 0.0
    store_error: str | None = None  # the store failed (its kind): nothing was looked up
    first_missing_skipped: bool = False  # kept out of RAM, too large (no SSD tier)

    @classmethod
    def nothing(cls, **why: Any) -> FetchedChain:
        """No block present (``why``: the counters that say why, or the store's error)."""
        return cls(present=0, walkbacks=0, payloads=[], lease=None,
                   first_missing_evicted=False, **why)

    @property
    def full_blocks(self) -> int:
        """Payloads that are full blocks of the prompt (all but a partial last one)."""
        return len(self.block_tokens) - (self.partial is not None)


@dataclass(frozen=True)
class FetchRequest:
    """What a replica asks for: a chain of its model's blocks, checked against its layout."""

    model: str  # the name it serves the model under (for the store's stats)
    block_ids: list[str]
    layout: Layout
    block_size: int
    expect: dict[str, str]  # metadata every SSD file of this model must carry
    exact: bool = True  # only exact checkpoints (no lossy sidecar codec)
    root: str = ""  # the chain's (salted) root: the first block's parent
    tokens: tuple[int, ...] = ()  # the restorable prompt, for a partial last block; ():
    # full blocks only
    first: int = 0  # payloads of the blocks before this one are not loaded (another
    # node's store exporting what the asking replica lacks)

    def query(self) -> MatchQuery:
        return MatchQuery(self.block_ids, self.layout.hybrid, self.layout.digest, self.exact,
                          self.root, self.tokens, self.block_size)

    def token_ids(self, index: int, count: int) -> tuple[int, ...]:
        """The prompt tokens of payload ``index`` holding ``count`` tokens (full blocks
        come first, so it starts at ``index * block_size``); () when unknown."""
        start = index * self.block_size
        return tuple(self.tokens[start : start + count])


@dataclass(frozen=True)
class RemotePrefix:
    """Another node holds the leading ``blocks`` blocks of a chain (per the directory)."""

    node_id: str
    blocks: int


@dataclass(frozen=True)
class RemoteChain:
    """Blocks ``start`` on of a chain, fetched from another node's store and validated
    here; the last carries its recurrent checkpoint on a hybrid model."""

    node_id: str
    start: int
    payloads: list[BlockPayload]
    nbytes: int
    seconds: float


class BadFile(Exception):
    """A block or checkpoint that cannot be used: dropped, then the lookup is redone."""

    def __init__(self, why: Drop, block_id: str, digest: str | None = None,
                 incompatible: str | None = None) -> None:
        super().__init__(f"{why} {block_id}")
        self.why = why
        self.block_id = block_id
        self.digest = digest
        self.incompatible = incompatible


class CacheClient:
    """Shared fetch logic; subclasses say how to reach the store.

    ``timeout``: how long a request waits for one store call (None: no bound, a store
    in this process). A call that fails or times out raises ``StoreError``.
    """

    timeout: float | None = None

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None,
                wait: bool = True) -> None:
        """Hand a block to the store. ``wait=False`` (from an event loop): never block;
        a block that does not fit the publish queue now is dropped and counted."""
        raise NotImplementedError

    async def _match(self, q: MatchQuery) -> Match:
        raise NotImplementedError

    async def _resolve(self, handle: Any) -> BlockPayload:
        raise NotImplementedError

    async def _drop(self, why: Drop, layout: str, block_id: str,
                    digest: str | None = None) -> None:
        raise NotImplementedError

    async def release(self, lease: int | None) -> None:
        raise NotImplementedError

    async def stats(self) -> dict:
        raise NotImplementedError

    def remote_prefix(self, block_ids: list[str],
                      usable: Callable[[str], bool] | None = None) -> RemotePrefix | None:
        """The other node holding the longest leading run of ``block_ids`` (from this
        replica's copy of the cluster's block directory; no remote call), among those
        ``usable`` says may be asked now (a node whose breaker is open is not). None: no
        cluster, or no such node holds the first block."""
        return None

    async def _export(self, node_id: str, req: FetchRequest,
                      timeout: float) -> FetchedChain | None:
        """``req`` answered by ``node_id``'s store (None: gone, slow or failed)."""
        return None

    async def fetch_remote(self, req: FetchRequest, start: int, node_id: str,
                           timeout: float) -> RemoteChain | None:
        """Blocks ``start`` on of ``req``'s chain from another node's store, checked like
        SSD blocks and promoted into this node's hot tier; None is a clean miss (the node
        died, answered late, or sent nothing usable)."""
        tic = time.perf_counter()
        remote = replace(req, first=start, tokens=())
        found = await self._export(node_id, remote, timeout)
        seconds = time.perf_counter() - tic
        # The exporter walked back to its last checkpoint: what it restores is what it sent.
        n = len(found.block_tokens) if found is not None else 0
        if found is None or n <= start or len(found.payloads) != n - start:
            return None
        bs, layout = req.block_size, req.layout
        for i, payload in enumerate(found.payloads):
            last = i == len(found.payloads) - 1
            reason = layout.check(payload, bs, need_state=last and layout.hybrid)
            if reason is not None:
                logger.warning("block %s from node %s does not fit: %s",
                               req.block_ids[start + i], node_id, reason)
                return None
        payloads = [p if i == len(found.payloads) - 1 else p.without_state()
                    for i, p in enumerate(found.payloads)]
        parents = [req.root, *req.block_ids]
        for i, payload in enumerate(payloads):
            index = start + i
            self.publish(req.model, CapturedBlock(req.block_ids[index], parents[index], payload,
                                                  token_ids=req.token_ids(index, bs)),
                         None, wait=False)  # on the event loop: a promotion never waits
        return RemoteChain(node_id, start, payloads, sum(p.nbytes for p in payloads), seconds)

    async def fetch(self, req: FetchRequest) -> FetchedChain:
        """The longest restorable chain, payloads loaded and checked; retried past bad files."""
        rejects = incompatible = 0
        reason = None
        for _ in range(MAX_ATTEMPTS):
            found = await self._pinned_match(req)
            try:
                tic = time.perf_counter()
                payloads, loads = await self._load(req, found)
                toc = time.perf_counter()
            except BadFile as bad:
                await self.release(found.lease)
                await self._drop(bad.why, req.layout.digest, bad.block_id, bad.digest)
                rejects += bad.why not in (Drop.BLOCK, Drop.LOST)
                if bad.incompatible is not None:
                    incompatible += 1
                    reason = bad.incompatible
                continue
            except BaseException:  # cancelled or unexpected: never leave pins behind
                self._release_soon(found.lease)
                raise
            # A rejected checkpoint shows up as a walkback of the next lookup.
            tiers = [s.tier for s in found.sources]
            ssd_bytes = sum(p.nbytes for p, t in zip(payloads, tiers[req.first:], strict=True)
                            if t == Tier.SSD)
            return FetchedChain(
                present=found.present, walkbacks=found.walkbacks, payloads=payloads,
                lease=found.lease, first_missing_evicted=found.first_missing_evicted,
                tiers=tiers, checkpoint_rejects=rejects, incompatible=incompatible,
                incompatible_reason=reason, partial=found.partial,
                block_tokens=found.block_tokens(req.block_size), sidecar_loads=loads,
                ssd_bytes=ssd_bytes, ssd_seconds=(toc - tic) if ssd_bytes else 0.0,
                first_missing_skipped=found.first_missing_skipped)
        return FetchedChain.nothing(checkpoint_rejects=rejects, incompatible=incompatible,
                                    incompatible_reason=reason)

    def _release_soon(self, lease: int | None) -> None:
        """Release from a task that may be cancelled: scheduled, not awaited."""
        if lease is not None:
            asyncio.ensure_future(self.release_quietly(lease))

    async def _pinned_match(self, req: FetchRequest) -> Match:
        """A lookup whose lease is released even if the caller is cancelled meanwhile.

        The store grants the lease when the lookup runs; a client that hangs up
        while waiting for the answer would otherwise leave its blocks pinned.
        """
        task = asyncio.ensure_future(self._match(req.query()))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except TimeoutError:  # a store that answers later: its lease is released then
            task.add_done_callback(self._release_abandoned)
            raise StoreError("timeout", f"lookup took over {self.timeout} s") from None
        except asyncio.CancelledError:
            task.add_done_callback(self._release_abandoned)
            raise

    def _release_abandoned(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self._release_soon(task.result().lease)

    async def release_quietly(self, lease: int | None) -> str | None:
        """Release a lease; a store that fails or times out only costs the lease (the
        store expires it). Returns the error kind, or None."""
        try:
            await self.release(lease)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind = store_error_kind(exc)
            logger.warning("releasing cache lease %s failed (%s): %r", lease, kind, exc)
            return kind
        return None

    async def _load(self, req: FetchRequest, found: Match) -> tuple[list[BlockPayload], int]:
        payloads: list[BlockPayload] = []
        sidecar_loads = 0
        loop = asyncio.get_running_loop()
        first = min(req.first, len(found.sources))
        sources: list[Source] = found.sources[first:]
        block_ids, layout = found.ids[first:], req.layout
        counts = found.stored_tokens(req.block_size)[first:]  # a cut one is checked as stored
        # Read every SSD block file at once; the disk does better with queue depth.
        reads = await asyncio.gather(*(
            loop.run_in_executor(None, _read_or_none, s.handle, {**req.expect, "block_id": b})
            for b, s in zip(block_ids, sources, strict=False) if s.tier == Tier.SSD))
        files = iter(reads)
        # Hot payloads at once too: one await each would cost a round trip per block.
        resolved = iter(await asyncio.gather(
            *(self._resolve(s.handle) for s in sources if s.tier != Tier.SSD),
            return_exceptions=True))
        for i, source in enumerate(sources):
            last = i == len(sources) - 1
            bid = block_ids[i]
            parent = ""
            if source.tier != Tier.SSD:
                payload = next(resolved)
                if isinstance(payload, LookupError):
                    raise BadFile(Drop.LOST, bid) from None
                if isinstance(payload, BaseException):
                    raise payload
                bad = Drop.LOST  # a hot payload that does not fit: drop it from RAM
            else:
                read = next(files)
                if read is None:
                    raise BadFile(Drop.BLOCK, bid, source.file_digest)
                tensors, meta = read
                parent = meta.get("parent_id", "")
                try:
                    payload = from_tensors(tensors, meta.get("dtypes", ""))
                except PayloadError as exc:
                    raise BadFile(Drop.BLOCK, bid, source.file_digest, str(exc)) from None
                bad = Drop.BLOCK
            lossy = False
            if last and layout.hybrid and source.state in (StateAt.EMBEDDED, StateAt.SIDECAR):
                state, lossy = await self._load_checkpoint(loop, req, source, payload, bid)
                payload = payload.with_state(state)
                sidecar_loads += source.state == StateAt.SIDECAR
            reason = layout.check(payload.without_state(), counts[i], need_state=False)
            if reason is not None:
                raise BadFile(bad, bid, source.file_digest, reason)
            if last and layout.hybrid:
                reason = layout.check(payload, counts[i], need_state=True)
                if reason is not None:  # a walkback: this checkpoint is unusable
                    raise _bad_checkpoint(source, bid, reason)
            else:
                payload = payload.without_state()
            payloads.append(payload)
            if source.tier == Tier.SSD:  # validated: promote to the hot tier (never lossy state)
                promoted = payload.without_state() if lossy else payload
                own = source.token_ids or req.token_ids(first + i, counts[i])
                self.publish(req.model, CapturedBlock(bid, parent, promoted, token_ids=own),
                             None, wait=False)  # on the event loop: a promotion never waits
        return payloads, sidecar_loads

    async def _load_checkpoint(self, loop, req: FetchRequest, source: Source,
                               payload: BlockPayload, bid: str) -> tuple[dict, bool]:
        """The block's recurrent state and whether it came through a lossy codec."""
        if source.state == StateAt.EMBEDDED:
            return payload.state, False
        try:
            encoded, meta = await loop.run_in_executor(
                None, read_file, source.sidecar, {**req.expect, "block_id": bid})
            named = codecs.decode_state(encoded, meta.get("codec_meta", ""), req.exact)
            return state_from_names(named), meta.get("codec") != codecs.EXACT
        except Exception:  # unreadable, wrong metadata, or a codec that does not decode
            raise BadFile(Drop.SIDECAR, bid, source.sidecar_digest) from None


def _bad_checkpoint(source: Source, bid: str, reason: str) -> BadFile:
    """What to drop when a block's checkpoint does not fit: where it was read from."""
    if source.state == StateAt.SIDECAR:
        return BadFile(Drop.SIDECAR, bid, source.sidecar_digest, reason)
    if source.state == StateAt.EMBEDDED:
        return BadFile(Drop.BLOCK, bid, source.file_digest, reason)
    return BadFile(Drop.CHECKPOINT, bid, None, reason)


def _read_or_none(path: str, expect: dict[str, str]) -> tuple[dict, dict] | None:
    try:
        return read_file(path, expect)
    except SSDError:
        return None


def entry_for(model: str, block: CapturedBlock, handle: Any) -> HotEntry:
    return HotEntry(
        block_id=block.block_id,
        parent_id=block.parent_id,
        nbytes=block.nbytes,
        has_checkpoint=block.has_checkpoint,
        handle=handle,
        model=model,
        token_ids=block.token_ids,
    )


class LocalCacheClient(CacheClient):
    """A ``TieredStore`` in this process; payloads are kept as they are."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._lock = threading.Lock()

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None,
                wait: bool = True) -> None:
        self.store.put(entry_for(model, block, block.payload), disk, keep_hot=block.keep_hot)

    async def _match(self, q: MatchQuery) -> Match:
        return self.store.match(q)

    async def _resolve(self, handle: Any) -> BlockPayload:
        return handle

    async def _drop(self, why: Drop, layout: str, block_id: str,
                    digest: str | None = None) -> None:
        self.store.drop(why, layout, block_id, digest)

    async def release(self, lease: int | None) -> None:
        self.store.release(lease)

    def _release_soon(self, lease: int | None) -> None:
        self.store.release(lease)  # in this process: at once (a loop may close after)

    async def stats(self) -> dict:
        return self.store.snapshot()
