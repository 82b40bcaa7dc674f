"""The replica's client of its node's cache-store actor (``RayCacheClient``).

Publishes from a background thread so the engine thread never waits on Ray; every
call a request waits on is bounded, and a failing store only makes requests prefill
cold (see the class docstring).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from serve_app.cache.client import (
    CacheClient,
    CircuitBreaker,
    FetchedChain,
    FetchRequest,
    RemotePrefix,
    StoreError,
    store_error_kind,
)
from serve_app.cache.match import Drop, Match, MatchQuery, Tier
from serve_app.cache.payload import BlockPayload, CapturedBlock
from serve_app.cache.ssd_format import DiskInfo
from serve_app.cluster.directory_service import NAMESPACE, DirectoryFollower
from serve_app.cluster.replicas import ReplicaReport
from serve_app.config.profile import CacheStoreProfile
from serve_app.store.actor import resolve_hot, store_name

logger = logging.getLogger(__name__)

PUBLISH_QUEUE_BLOCKS = 256


MAX_UNACKED_PUTS = 8  # puts one replica has in flight to the store; then its publisher waits


ACK_WAIT_S = 30.0  # a lookup waits at most this long for the replica's earlier puts


# A request waits at most this long for one store call (lookup, release, stats); then it
# prefills cold. The profile's ``cache_store.call_timeout_s`` (its default here).
STORE_CALL_TIMEOUT_S = CacheStoreProfile().call_timeout_s


RECONNECT_EVERY_S = 1.0  # a replica looks for a replacement of a dead store this often


REPORT_STUCK_S = 30.0  # a replica's stats report unanswered this long: send another


REPORT_DROPS_S = 1.0


class RayCacheClient(CacheClient):
    """Publishes from a background thread so the engine thread never waits on Ray.

    The actor runs calls concurrently, so the order of calls is no promise of
    visibility: each put is tracked until its reply arrives (its ack), and a
    lookup waits for the acks of the puts published before it, not after. At
    most ``MAX_UNACKED_PUTS`` are in flight; beyond that the publisher waits and
    the bounded queue fills: a block that does not fit is dropped and counted,
    and the engine never waits.

    A store that fails never fails a request: every call a request waits on is
    bounded by ``timeout`` and raises ``StoreError`` (the cache manager prefills
    cold and counts it). After ``breaker.threshold`` failures in a row the store
    is skipped for a cool-down (lookups and publishes too), then probed again. A
    store actor that died is looked up again (``reconnect``: the replica's
    get-or-create), so a replacement is used as soon as it answers.
    """

    timeout: float  # always bounded here

    def __init__(self, actor, follower: DirectoryFollower | None = None, *,
                 timeout: float = STORE_CALL_TIMEOUT_S,
                 reconnect: Callable[[], Any] | None = None,
                 breaker: CircuitBreaker | None = None) -> None:
        self.actor = actor
        self.follower = follower
        self.timeout = timeout
        self.reconnect = reconnect
        self.breaker = breaker or CircuitBreaker()
        self.node_id = ray.get_runtime_context().get_node_id()
        self._stores: dict[str, Any] = {}  # node id -> that node's store actor
        self._queue: queue.Queue = queue.Queue(maxsize=PUBLISH_QUEUE_BLOCKS)
        self._cv = threading.Condition()
        self._seq = 0
        self._unacked: set[int] = set()  # published, not acknowledged by the store yet
        self._in_flight = 0  # submitted to the store, not acknowledged yet
        self.dropped = 0  # blocks that never reached the store
        self._unreported = 0  # of those, not yet counted by the store
        self._activation: tuple | None = None  # repeated on a replacement store
        self._reconnecting = False
        self._next_reconnect = 0.0
        self.reconnects = 0
        self._epoch: str | None = None  # of the store last answering a lookup
        self._closed = False
        self._report_sent: float | None = None  # a stats report in flight since then
        self.report_failures = 0
        self._thread = threading.Thread(target=self._publisher, name="cache-publish",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop publishing and reconnecting (blocks still queued are dropped)."""
        self._closed = True
        self.reconnect = None

    def activate(self, name: str, model: str, layout: str, timeout: float = 120.0) -> None:
        """Tell the store this replica serves ``model`` (repeated on a replacement)."""
        self._activation = (name, model, layout)
        ray.get(self.actor.activate.remote(name, model, layout), timeout=timeout)

    def demote(self, model: str, layout: str, wait_s: float = 30.0) -> tuple[int, int]:
        """This replica's model was unloaded: once every block it published is
        acknowledged, its blocks that the SSD tier holds leave the store's RAM (blocks,
        bytes). Bounded by ``wait_s``; a failing store costs nothing but the RAM."""
        with self._cv:
            published = set(self._unacked)
        self._wait_acked(published, wait_s)
        try:
            return ray.get(self.actor.demote.remote(model, layout, wait_s),
                           timeout=wait_s + self.timeout)
        except Exception as exc:
            logger.warning("taking model %s's blocks out of the store's RAM failed: %r",
                           model, exc)
            return 0, 0

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None,
                wait: bool = True) -> None:
        if self.breaker.is_open:  # the store is stuck or gone: drop, count, never wait
            self._count_dropped(1)
            return
        with self._cv:
            self._seq += 1
            seq = self._seq
            self._unacked.add(seq)
        try:
            self._queue.put((seq, model, block, disk), block=wait, timeout=self.timeout)
        except queue.Full:  # a store that does not keep up: dropped, counted
            with self._cv:
                self._unacked.discard(seq)
            self._count_dropped(1)

    def _count_dropped(self, n: int) -> None:
        with self._cv:
            self.dropped += n
            self._unreported += n

    def _failed(self, exc: BaseException) -> None:
        """A store call failed: one more failure in a row; a dead store is replaced."""
        self.breaker.failure()
        if isinstance(exc, ray.exceptions.RayActorError) or (
                isinstance(exc, StoreError) and exc.kind == "unavailable"):
            self._reconnect_soon()

    def _reconnect_soon(self) -> None:
        if self.reconnect is None:
            return
        with self._cv:
            if self._reconnecting or time.monotonic() < self._next_reconnect:
                return
            self._reconnecting = True
            self._next_reconnect = time.monotonic() + RECONNECT_EVERY_S
        threading.Thread(target=self._reconnect_now, name="cache-reconnect",
                         daemon=True).start()

    def _reconnect_now(self) -> None:
        try:
            if not ray.is_initialized():  # shut down: never auto-start a Ray of our own
                return
            reconnect = self.reconnect
            if reconnect is None:  # closed since this thread was started
                return
            actor = reconnect()
            if self._activation is not None:
                ray.get(actor.activate.remote(*self._activation), timeout=self.timeout)
            self.actor = actor
            self.reconnects += 1
            self.breaker.success()
            logger.warning("cache store reached again (reconnect %d)", self.reconnects)
        except BaseException as exc:  # no store yet (or Ray shut down): try again later
            logger.warning("looking for a replacement cache store failed: %r", exc)
        finally:
            with self._cv:
                self._reconnecting = False

    async def _call(self, ref) -> Any:
        """One store call a request waits on: bounded, failures as ``StoreError``."""
        try:
            out = await asyncio.wait_for(ref, self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            kind = store_error_kind(exc)
            raise StoreError(kind, repr(exc)) from None
        self.breaker.success()
        return out

    async def fetch(self, req: FetchRequest) -> FetchedChain:
        if not self.breaker.allow():
            raise StoreError("skipped", "circuit breaker open")
        try:
            found = await super().fetch(req)
        except asyncio.CancelledError:
            raise
        except StoreError as exc:  # counted by ``_call`` already, but for lookups
            if exc.kind == "timeout":
                self._failed(exc)
            raise
        except Exception as exc:
            self._failed(exc)
            raise
        self.breaker.success()
        return found

    def _publisher(self) -> None:
        while True:
            try:
                seq, model, block, disk = self._queue.get(timeout=REPORT_DROPS_S)
            except queue.Empty:
                if not self._closed and ray.is_initialized():  # never auto-start a Ray
                    self._report_drops()
                continue
            if self._closed or not ray.is_initialized():
                # Closed or Ray shut down: drop it and idle. The thread is not left to end:
                # a thread that used Ray ending after shutdown can take the process down.
                with self._cv:
                    self._unacked.discard(seq)
                continue
            with self._cv:
                self._cv.wait_for(lambda: self._in_flight < MAX_UNACKED_PUTS)
                self._in_flight += 1
            try:
                ref = ray.put(block.payload)
                ack = self.actor.put.remote(model, block.block_id, block.parent_id,
                                            block.nbytes, block.has_checkpoint, [ref], disk,
                                            block.token_ids, block.keep_hot)
                ack.future().add_done_callback(
                    lambda f, seq=seq, bid=block.block_id: self._acked(seq, bid, f))
            except Exception:
                logger.exception("publishing block %s failed", block.block_id)
                self._acked(seq, block.block_id, None)
            self._report_drops()

    def _acked(self, seq: int, block_id: str, future: Any) -> None:
        """A put answered or failed: it holds back no lookup now. On Ray's callback thread
        (no Ray calls here); a failure is counted and reported by the publisher."""
        try:
            error = future.exception() if future is not None else True
        except BaseException as exc:  # cancelled
            error = exc
        if error is not None and future is not None:
            logger.warning("publishing block %s failed: %s", block_id, error)
            if isinstance(error, ray.exceptions.RayActorError):
                self._reconnect_soon()  # starts a thread: no Ray call here
        with self._cv:
            self._unacked.discard(seq)
            self._in_flight -= 1
            if error is not None:
                self.dropped += 1
                self._unreported += 1
            self._cv.notify_all()

    def _report_drops(self) -> None:
        with self._cv:
            n, self._unreported = self._unreported, 0
        if not n:
            return

        def told(future: Any) -> None:
            try:
                failed = future.exception() is not None
            except BaseException:
                failed = True
            if failed:  # no store to tell now: try again later
                with self._cv:
                    self._unreported += n

        try:
            self.actor.count_dropped.remote("publish", n).future().add_done_callback(told)
        except Exception:
            with self._cv:
                self._unreported += n

    def _wait_acked(self, seqs: set[int], timeout: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not (seqs & self._unacked), timeout=timeout)

    async def _match(self, q: MatchQuery) -> Match:
        # Blocks published before this lookup must be visible to it: wait for the
        # store's acks of those puts (not of the ones published after).
        with self._cv:
            before = set(self._unacked)
        if before:  # bounded: a stuck store must not hold executor threads for long
            await asyncio.get_running_loop().run_in_executor(
                None, self._wait_acked, before, min(ACK_WAIT_S, self.timeout))
        found = await self.actor.match.remote(q)
        self._seen_epoch(found.store_epoch)
        return found

    def _seen_epoch(self, epoch: str | None) -> None:
        """A store that Ray restarted (a new epoch) has forgotten which models are served
        here: tell it again, from a thread (the request does not wait)."""
        if epoch is None or epoch == self._epoch:
            return
        known, self._epoch = self._epoch, epoch
        if known is None or self._activation is None:
            return
        actor, activation = self.actor, self._activation

        def again() -> None:
            try:
                ray.get(actor.activate.remote(*activation), timeout=self.timeout)
                logger.warning("cache store restarted (epoch %s): activated again", epoch[:8])
            except Exception as exc:
                logger.warning("activating a restarted cache store failed: %r", exc)

        threading.Thread(target=again, name="cache-activate", daemon=True).start()

    async def _resolve(self, handle: Any) -> BlockPayload:
        return await asyncio.wait_for(resolve_hot(handle), self.timeout)

    async def _drop(self, why: Drop, layout: str, block_id: str,
                    digest: str | None = None) -> None:
        await self._call(self.actor.drop.remote(why, layout, block_id, digest))

    def remote_prefix(self, block_ids: list[str],
                      usable: Callable[[str], bool] | None = None) -> RemotePrefix | None:
        if self.follower is None:
            return None
        runs = self.follower.prefix_by_node(block_ids)
        runs.pop(self.node_id, None)
        if usable is not None:
            runs = {node_id: tiers for node_id, tiers in runs.items() if usable(node_id)}
        if not runs:
            return None
        # The longest run; between equals, the one with more of it in RAM.
        node_id, tiers = max(runs.items(), key=lambda kv: (len(kv[1]), kv[1].count(Tier.HOT)))
        return RemotePrefix(node_id, len(tiers))

    async def _export(self, node_id: str, req: FetchRequest,
                      timeout: float) -> FetchedChain | None:
        loop = asyncio.get_running_loop()
        try:
            store: Any = self._stores.get(node_id)  # an actor handle
            if store is None:  # a GCS lookup: off the event loop, once per node
                store = await loop.run_in_executor(None, lambda: ray.get_actor(
                    store_name(node_id), namespace=NAMESPACE))
                self._stores[node_id] = store
            return await asyncio.wait_for(store.export.remote(req), timeout)
        except Exception as exc:  # the node died, its store is gone, or it answered late
            logger.warning("fetching blocks from node %s failed: %r", node_id, exc)
            self._stores.pop(node_id, None)
            return None

    async def release(self, lease: int | None) -> None:
        if lease is None:
            return
        if self.breaker.is_open:  # a stuck store: it expires the lease itself
            raise StoreError("skipped", "circuit breaker open")
        await self._call(self.actor.release.remote(lease))

    async def stats(self) -> dict:
        """The store's stats, this replica's publisher (drops, puts not acked yet), the
        store's circuit breaker and its copy of the block directory. A store that does
        not answer in time shows as ``unavailable`` (the stats never fail)."""
        try:
            out = await self._call(self.actor.stats.remote())
        except StoreError as exc:
            out = {"unavailable": str(exc)}
        out.update(self.own_stats())
        return out

    def own_stats(self) -> dict:
        """This replica's part of ``stats()``, no store call: its publisher (drops, puts
        not acked yet), its circuit breaker on the store, its copy of the directory."""
        with self._cv:
            out: dict = {"publisher": {"dropped": self.dropped,
                                       "unacknowledged": len(self._unacked)}}
        out["breaker"] = {**self.breaker.snapshot(), "reconnects": self.reconnects,
                          "call_timeout_s": self.timeout}
        if self.follower is not None:
            out["directory"] = self.follower.snapshot()
        return out

    def report(self, report: ReplicaReport) -> bool:
        """Send this replica's stats to the store (``serve_app.cluster.replicas``); never waits.
        One report in flight at most (a stuck store gets no pile of them, but one is
        sent again after ``REPORT_STUCK_S``); none while the breaker is open. False:
        not sent."""
        sent = self._report_sent
        if self._closed or self.breaker.is_open or not ray.is_initialized() or (
                sent is not None and time.monotonic() - sent < REPORT_STUCK_S):
            return False
        self._report_sent = time.monotonic()
        try:
            ref = self.actor.report_replica.remote(report)
            ref.future().add_done_callback(self._reported)
        except Exception as exc:
            self._report_sent = None
            self._report_failed(exc)
            return False
        return True

    def _reported(self, future: Any) -> None:
        """A report answered or failed (on Ray's callback thread: no Ray calls here)."""
        try:
            error = future.exception()
        except BaseException as exc:  # cancelled
            error = exc
        if error is not None:
            self._report_failed(error)
            if isinstance(error, ray.exceptions.RayActorError):
                self._reconnect_soon()  # starts a thread: no Ray call here
        self._report_sent = None

    def _report_failed(self, error: BaseException) -> None:
        self.report_failures += 1
        if self.report_failures == 1 or self.report_failures % 100 == 0:
            logger.warning("reporting replica stats to the cache store failed (%d so far): "
                           "%r", self.report_failures, error)


def connect_store(cache_store: CacheStoreProfile, directory: bool = True) -> RayCacheClient:
    """A client of this node's cache store, waiting for the store actor (and replacing one
    of older code). ``directory``: follow the cluster's block directory (which other node
    holds more of a prompt: those blocks are fetched instead of prefilled). A store that
    fails costs requests their cache, never the request: calls are bounded, a failing
    store is skipped for a while, a dead one is replaced."""
    from serve_app.store.actor import get_or_create_actor

    actor = get_or_create_actor(cache_store)
    follower = (DirectoryFollower().start()
                if directory and cache_store.directory != "off" else None)
    return RayCacheClient(actor, follower, timeout=cache_store.call_timeout_s,
                          reconnect=lambda: get_or_create_actor(cache_store),
                          breaker=CircuitBreaker(cache_store.breaker_failures,
                                                 cache_store.breaker_cool_down_s))
