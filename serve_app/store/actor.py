"""Ray glue for the cache store: one actor per node, and the replica's client.

The actor owns the tiers' state (hot index, staging, SSD index and writes);
payload bytes sit in Ray's shared-memory object store. A replica ``ray.put``s
a captured block once and hands the actor the reference; a restoring replica
gets the references back and reads the arrays zero-copy (or reads SSD files
itself), so the only copy on restore is the one into MLX arrays.

The actor is threaded: a put waiting for staging room (or writing inline) or
a lookup waiting for the SSD index never holds up another call. Puts run in
their own concurrency group, so a burst of them cannot take every thread.
The ``TieredStore`` is lock-protected and holds its locks only briefly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.cache.client import (
    CacheClient,
    CircuitBreaker,
    FetchedChain,
    FetchRequest,
    LocalCacheClient,
    RemotePrefix,
    StoreError,
    store_error_kind,
)
from serve_app.cache.hot import HotEntry
from serve_app.cache.match import Drop, Match, MatchQuery, Tier
from serve_app.cache.payload import BlockPayload, CapturedBlock
from serve_app.cache.ssd import SSDStore, auto_budget, default_cache_dir, untrusted_reason
from serve_app.cache.tiers import DiskInfo, TieredStore
from serve_app.cache.wear import auto_write_budget
from serve_app.cluster.directory import BlockDirectory, Changes, EventBatch
from serve_app.cluster.replicas import ReplicaBoard, ReplicaReport
from serve_app.config.profile import CacheStoreProfile
from serve_app.memory.plan import hot_budget_bytes
from serve_app.metrics.table import MetricsPump, RayRecorder, Sample, store_samples

logger = logging.getLogger(__name__)

NAMESPACE = "serve_app"
PUBLISH_QUEUE_BLOCKS = 256
MAX_UNACKED_PUTS = 8  # puts one replica has in flight to the store; then its publisher waits
ACK_WAIT_S = 30.0  # a lookup waits at most this long for the replica's earlier puts
# A request waits at most this long for one store call (lookup, release, stats); then it
# prefills cold. The profile's ``cache_store.call_timeout_s`` (its default here).
STORE_CALL_TIMEOUT_S = CacheStoreProfile().call_timeout_s
RECONNECT_EVERY_S = 1.0  # a replica looks for a replacement of a dead store this often
REPORT_STUCK_S = 30.0  # a replica's stats report unanswered this long: send another
REPORT_DROPS_S = 1.0
FEED_INTERVAL_S = 0.5  # how often a store tells the block directory what changed
FOLLOW_INTERVAL_S = 0.25  # how often a router or replica pulls the directory's changes
LOOK_FOR_DIRECTORY_S = 1.0  # how often a follower looks for a directory not there yet
FEED_TIMEOUT_S = 10.0
NODE_CHECK_S = 5.0  # how often the directory looks for nodes that died
# The suffix changes with the directory's method signatures (2: ``changes_since`` takes
# the follower's incarnation): the actor is detached and outlives a redeploy.
DIRECTORY_NAME = "block-directory-2"
SSD_DIR_ENV = "SERVE_APP_SSD_DIR"  # a node's own SSD directory (several nodes, one machine)
# Options of the actor (and of test subclasses): threaded, puts in a group of their own.
# Exports to other nodes (SSD reads of long chains) have a group too: never all threads.
ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 16,
                                 "concurrency_groups": {"puts": 8, "exports": 4}}


def make_ssd(config: CacheStoreProfile) -> tuple[SSDStore | None, str | None]:
    """The SSD tier a ``CacheStoreProfile`` asks for, its directory locked; or None and why.

    Two servers on one directory would each evict the other's files under its
    own index and budget: the second one serves without the SSD tier and says so.
    So does a directory another local user owns or may write to (``untrusted_reason``).
    """
    if not config.ssd:
        return None, None
    root = Path(ssd_dir_of(config.ssd_dir)).expanduser()
    untrusted = untrusted_reason(root)
    if untrusted is not None:  # another local user could plant blocks in it
        reason = (f"refusing cache directory {root}: {untrusted}; it must be owned by this "
                  "server's user and not writable by group or others; serving without the "
                  "SSD tier")
        logger.error("%s", reason)
        return None, reason
    try:
        configured = config.ssd_cache_max_size
        budget = auto_budget(root) if configured == "auto" else int(configured)
        wear = config.ssd_write_budget_per_hour
        per_hour = auto_write_budget(root) if wear == "auto" else int(wear)
        store = SSDStore(root, budget, int(config.ssd_min_free), per_hour)
        locked = store.lock_directory()
    except OSError as exc:
        reason = f"cannot use cache directory {root}: {exc}; serving without the SSD tier"
        logger.error("%s", reason)
        return None, reason
    if not locked:
        reason = (f"cache directory {root} is locked by process {store.lock_holder()} "
                  "(another server uses it); serving without the SSD tier")
        logger.error("%s", reason)
        return None, reason
    return store, None


def ssd_dir_of(configured: str | None) -> str:
    """The SSD directory of this node: ``SERVE_APP_SSD_DIR`` in the node's environment
    (``ray start`` from a shell that sets it), else the profile's ``ssd_dir``, where
    ``{node_id}`` becomes the Ray node's id, else the default."""
    configured = os.environ.get(SSD_DIR_ENV) or configured
    if not configured:
        return str(default_cache_dir())
    if "{node_id}" in configured:
        return configured.replace("{node_id}", ray.get_runtime_context().get_node_id())
    return configured


class CacheStore:
    """The per-node cache store: the actor's body (``CacheStoreActor``), plain so tests
    can subclass it. Calls run concurrently; replicas make their own puts visible to
    their own lookups (``RayCacheClient``)."""

    # Bumped whenever a method's signature changes: the actor is detached and outlives
    # a redeploy, so replicas of new code may find one running the old code.
    PROTOCOL = 7  # 2: put carries the block's token ids; 3: export to other nodes;
    # 4: replicas report their stats (report_replica, replica_reports); 5: match;
    # 6: put's keep_hot; 7: demote (a model the pool unloaded)

    def __init__(self, config: CacheStoreProfile,
                 feed_interval_s: float = FEED_INTERVAL_S) -> None:
        ssd, self.ssd_disabled = make_ssd(config)
        self.tiers = TieredStore(hot_budget_bytes(config.hot_budget), ssd,
                                 int(config.gdn_ssd_pending_max_size), resolve=ray.get)
        self.names: dict[str, str] = {}  # model identity[:16] -> a name it is served under
        self.replicas = ReplicaBoard()  # this node's model replicas' last stats (/v1/stats)
        self._lock = threading.Lock()
        self.publish_dropped = 0  # blocks replicas could not hand over (they report them)
        self.feed = DirectoryFeed(self.tiers, feed_interval_s, always=config.directory == "on")
        if config.directory != "off" and ray.is_initialized():
            self.feed.start()
        recorder = RayRecorder("store", serve=False)
        self.pump = MetricsPump(recorder, self._metric_samples, name="cache-metrics").start()

    def _metric_samples(self) -> list[Sample]:
        stats = self.tiers.stats()
        with self._lock:
            names = dict(self.names)
            stats = replace(stats, dropped_publish=self.publish_dropped)
        return store_samples(stats, names)

    def samples(self) -> list[Sample]:
        """What the metrics pump publishes now (tests, operators)."""
        return self._metric_samples()

    @ray.method(concurrency_group="puts")
    def put(self, model: str, block_id: str, parent_id: str, nbytes: int,
            has_checkpoint: bool, refs: list, disk: DiskInfo | None,
            token_ids: tuple[int, ...] = (), keep_hot: bool = True) -> bool:
        """Store a block; the reply is the replica's acknowledgement (False: dropped)."""
        entry = HotEntry(block_id, parent_id, nbytes, has_checkpoint, handle=refs[0], model=model,
                         token_ids=tuple(token_ids))
        return self.tiers.put(entry, disk, keep_hot=keep_hot)

    @ray.method(concurrency_group="puts")
    def demote(self, model: str, layout: str, wait_s: float) -> tuple[int, int]:
        """The model pool unloaded ``model``'s replica: its blocks on SSD leave RAM
        (``TieredStore.demote``); the blocks and bytes taken out."""
        return self.tiers.demote(model, layout, wait_s)

    def count_dropped(self, reason: str, n: int) -> None:
        """Blocks a replica could not hand over (``reason`` is "publish")."""
        with self._lock:
            self.publish_dropped += n

    def activate(self, name: str, model: str, layout: str) -> None:
        """A replica serves model identity ``model`` as ``name``: its files are evicted last."""
        with self._lock:
            self.names.setdefault(model[:16], name)
        if self.tiers.ssd is not None:
            self.tiers.ssd.activate(model, layout)

    def match(self, q: MatchQuery) -> Match:
        found = self.tiers.match(q)
        found.store_epoch = self.feed.epoch  # new after every (re)start of the store
        return found

    def release(self, lease: int | None) -> None:
        self.tiers.release(lease)

    @ray.method(concurrency_group="exports")
    def export(self, req: FetchRequest) -> FetchedChain:
        """A replica on another node asks for blocks ``req.first`` on of a chain: loaded
        and checked here like a local restore (SSD files read on this node), returned
        through the object store. Nothing stays pinned: the payloads travel in the reply."""
        found = asyncio.run(ExportClient(self.tiers).fetch(req))
        self.tiers.release(found.lease)
        return replace(found, lease=None)

    def drop(self, why: Drop, layout: str, block_id: str, digest: str | None = None) -> None:
        self.tiers.drop(why, layout, block_id, digest)

    def stats(self) -> dict:
        return self._snapshot()

    def report_replica(self, report: ReplicaReport) -> None:
        """A model replica of this node sends its stats (every second): the ingress
        gathers them for ``/v1/stats``, which lands on one replica only."""
        self.replicas.put(report)

    def replica_reports(self, model: str) -> list[ReplicaReport]:
        """The last stats of each of ``model``'s replicas on this node, with their age
        (a replica silent for ``serve_app.cluster.replicas.FORGET_AFTER_S`` is forgotten)."""
        return self.replicas.reports(model)

    def protocol(self) -> int:
        return self.PROTOCOL

    def pid(self) -> int:
        """The actor's process id (operators and fault tests: SIGSTOP, py-spy)."""
        return os.getpid()

    def _snapshot(self) -> dict:
        out = self.tiers.snapshot()
        with self._lock:
            out["dropped"]["publish"] = self.publish_dropped
        if self.ssd_disabled is not None:
            out["ssd"] = {"disabled": self.ssd_disabled}
        out["directory_feed"] = self.feed.snapshot()
        out["pid"] = os.getpid()  # the store's process (operators: py-spy, a frozen store)
        with self._lock:
            out["served_models"] = sorted(set(self.names.values()))  # activated by replicas
        return out


CacheStoreActor = ray.remote(**ACTOR_OPTIONS)(CacheStore)


class ExportClient(LocalCacheClient):
    """A store's own tiers seen as a cache client, to load what another node asks for.
    Hot payloads are resolved from the object store; nothing is promoted."""

    def publish(self, model: str, block: CapturedBlock, disk: DiskInfo | None,
                wait: bool = True) -> None:
        pass

    async def _resolve(self, handle: Any) -> BlockPayload:
        return await resolve_hot(handle)


async def resolve_hot(handle: Any) -> BlockPayload:
    """A hot block's payload from the object store."""
    try:
        return await handle
    except ray.exceptions.RayError:  # its owner died: those bytes are gone
        raise LookupError("hot block lost with its owner") from None


class DirectoryFollower:
    """This process's copy of the cluster's block directory, kept current by a thread
    that pulls ``changes_since`` deltas; a router or a replica's planner reads memory
    only. Without a directory (one node) it looks for one now and then."""

    def __init__(self, interval: float = FOLLOW_INTERVAL_S) -> None:
        self.interval = interval
        self.copy = BlockDirectory(log_limit=1, incarnation="")  # follows none yet
        self.resyncs = 0  # copies dropped: the directory was replaced (a new incarnation)
        self.connected = False
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> DirectoryFollower:
        threading.Thread(target=self._run, name="directory-follow", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def prefix_by_node(self, block_ids: list[str]) -> dict[str, list[str]]:
        with self._lock:
            return self.copy.prefix_by_node(block_ids)

    def snapshot(self) -> dict:
        with self._lock:
            return {"connected": self.connected, "version": self.copy.version,
                    "incarnation": self.copy.incarnation, "resyncs": self.resyncs,
                    "nodes": self.copy.nodes(), "last_error": self.last_error}

    def _run(self) -> None:
        directory: Any = None  # an actor handle (Ray does not type its methods' .remote())
        while not self._stop.is_set():
            if not ray.is_initialized():  # shut down: never auto-start a Ray of our own
                return
            try:
                if directory is None:
                    directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
                with self._lock:
                    version, incarnation = self.copy.version, self.copy.incarnation
                # A directory of another incarnation (restarted or replaced) answers a
                # copy of the old one with everything: never a delta grafted onto it.
                changes: Changes = ray.get(
                    directory.changes_since.remote(version, incarnation),
                    timeout=FEED_TIMEOUT_S)
                if not changes.reset and (changes.incarnation != incarnation
                                          or changes.version < version):
                    self._start_over()  # cannot happen with a directory of this code
                    continue
                if changes.reset:  # everything: built aside, so readers never wait on it
                    fresh = BlockDirectory(log_limit=1, incarnation="")
                    fresh.follow(changes)
                    with self._lock:
                        self.resyncs += bool(incarnation) and incarnation != fresh.incarnation
                        self.copy = fresh
                else:
                    with self._lock:
                        self.copy.follow(changes)
                with self._lock:
                    self.connected = True
                    self.last_error = None
            except ValueError:  # no directory (yet): one node, or none fed it so far
                with self._lock:
                    self.connected = False
                self._stop.wait(LOOK_FOR_DIRECTORY_S)
                continue
            except Exception as exc:  # the directory died or is slow: look it up again
                with self._lock:
                    self.connected = False
                    self.last_error = repr(exc)
                directory = None
            self._stop.wait(self.interval)


    def _start_over(self) -> None:
        with self._lock:
            self.copy = BlockDirectory(log_limit=1, incarnation="")
            self.resyncs += 1


class DirectoryFeed:
    """Tells the cluster's block directory what this node's tiers hold, in ordered
    batches from a thread of the store actor. A new feed (a restarted store) is a new
    epoch and starts with a full snapshot; so does one the directory refused (a gap) or
    could not reach: the directory's view of this node is always rebuilt, never patched
    over a hole."""

    def __init__(self, tiers: TieredStore, interval: float, always: bool = False) -> None:
        self.tiers = tiers
        self.interval = interval
        self.always = always  # else only while the cluster has more than one node
        self.active = False
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.batches = 0
        self.snapshots = 0
        self.last_error: str | None = None
        self._stop = threading.Event()

    def start(self) -> DirectoryFeed:
        threading.Thread(target=self._run, name="directory-feed", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> dict:
        return {"active": self.active, "epoch": self.epoch, "seq": self.seq,
                "batches": self.batches,
                "snapshots": self.snapshots, "last_error": self.last_error}

    def _run(self) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        directory, full = None, True
        next_check = 0.0
        while not self._stop.wait(self.interval):
            if not self.always and time.monotonic() >= next_check:
                next_check = time.monotonic() + NODE_CHECK_S
                with contextlib.suppress(Exception):  # the GCS busy: keep the last answer
                    self.active = len(alive_node_ids()) > 1
            if not (self.always or self.active):
                directory, full = None, True  # a later second node gets a full snapshot
                continue
            self.active = True
            try:
                if directory is None:
                    directory = get_or_create_directory()
                events = self.tiers.directory_events(full=full)
                if not events and not full:
                    continue
                seq = 1 if full else self.seq + 1
                batch = EventBatch(node_id, self.epoch, seq, tuple(events), full)
                accepted = ray.get(directory.apply.remote(batch), timeout=FEED_TIMEOUT_S)
                self.seq = seq
                self.batches += 1
                self.snapshots += full
                full = not accepted
                self.last_error = None
            except Exception as exc:  # the directory is gone or slow: start over later
                self.last_error = repr(exc)
                logger.warning("telling the block directory failed: %r", exc)
                directory, full = None, True


class BlockDirectoryService:
    """The cluster's one ``BlockDirectory``, as a threaded actor; forgets nodes that
    died (a restarted node's store starts over with a full snapshot)."""

    def __init__(self, check_nodes_s: float = NODE_CHECK_S) -> None:
        self.directory = BlockDirectory()
        self._lock = threading.Lock()
        self._check_nodes_s = check_nodes_s
        threading.Thread(target=self._watch_nodes, name="node-watch", daemon=True).start()

    def apply(self, batch: EventBatch) -> bool:
        with self._lock:
            return self.directory.apply(batch)

    def changes_since(self, version: int, incarnation: str | None = None) -> Changes:
        with self._lock:
            return self.directory.changes_since(version, incarnation)

    def incarnation(self) -> str:
        return self.directory.incarnation

    def nodes(self) -> dict[str, int]:
        with self._lock:
            return self.directory.nodes()

    def holders(self, block_id: str) -> dict[str, str]:
        with self._lock:
            return self.directory.holders(block_id)

    def _watch_nodes(self) -> None:
        while True:
            time.sleep(self._check_nodes_s)
            try:
                alive = alive_node_ids()
            except Exception:  # the GCS is briefly unreachable: look again later
                continue
            with self._lock:
                for node_id in set(self.directory.nodes()) - alive:
                    logger.warning("node %s is gone: forgetting its blocks", node_id)
                    self.directory.forget(node_id)


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


# Ray's typed overloads of ray.remote omit actor-only options such as max_concurrency.
BlockDirectoryActor = ray.remote(num_cpus=0, max_restarts=-1,  # type: ignore[call-overload]
                                 max_concurrency=8)(BlockDirectoryService)


def get_or_create_directory():
    """The cluster's block directory actor, created by the first store that asks."""
    return BlockDirectoryActor.options(name=DIRECTORY_NAME, namespace=NAMESPACE,
                                       lifetime="detached", get_if_exists=True).remote()


def get_or_create_actor(config: CacheStoreProfile, timeout: float = 120.0):
    """The cache-store actor of this node, created by the first replica that asks.

    One left running by older code (another ``CacheStore.PROTOCOL``) is replaced: its
    methods no longer match, so every put would fail. Its hot tier is lost; its SSD
    files stay and are found again by the new one.
    """
    node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout
    while True:
        if not ray.is_initialized():  # shut down meanwhile: never auto-start a Ray
            raise RuntimeError("Ray is shut down")
        # Ray types the handle as ``ActorHandle[T] | type[T]``, whose methods' .remote()
        # it types only under @ray.method: a plain handle here.
        actor: Any = CacheStoreActor.options(
            name=f"cache-store-{node_id}",
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(config)
        left = max(1.0, deadline - time.monotonic())
        try:
            if ray.get(actor.protocol.remote(), timeout=left) == CacheStore.PROTOCOL:
                return actor
        except AttributeError:  # older code: no protocol method at all
            pass
        except ray.exceptions.RayActorError:  # one being replaced died meanwhile: retry
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not replace the outdated cache-store actor on node "
                               f"{node_id} within {timeout:.0f} s")
        logger.warning("replacing a cache-store actor of an older protocol on node %s",
                       node_id)
        ray.kill(actor, no_restart=True)
        time.sleep(0.5)


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
                    f"cache-store-{node_id}", namespace=NAMESPACE))
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
