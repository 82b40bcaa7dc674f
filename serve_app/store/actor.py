"""The cache-store actor: one per node, owning its tiers (the replica's client of it is
``store/client.py``).

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
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.cache.client import (
    FetchedChain,
    FetchRequest,
    LocalCacheClient,
)
from serve_app.cache.hot import HotEntry
from serve_app.cache.match import Drop, Match, MatchQuery
from serve_app.cache.payload import BlockPayload, CapturedBlock
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import DiskInfo
from serve_app.cache.ssd_fs import auto_budget, untrusted_reason
from serve_app.cache.stats import Cleared
from serve_app.cache.tiers import TieredStore
from serve_app.cache.wear import auto_write_budget
from serve_app.cluster.directory import EventBatch
from serve_app.cluster.directory_service import (
    FEED_TIMEOUT_S,
    NAMESPACE,
    NODE_CHECK_S,
    alive_node_ids,
    get_or_create_directory,
)
from serve_app.cluster.replicas import ReplicaBoard, ReplicaReport
from serve_app.config.paths import default_cache_dir
from serve_app.config.profile import CacheStoreProfile
from serve_app.memory.plan import hot_budget_bytes
from serve_app.metrics.samples import store_samples
from serve_app.metrics.table import MetricsPump, RayRecorder, Sample

logger = logging.getLogger(__name__)

FEED_INTERVAL_S = 0.5  # how often a store tells the block directory what changed
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
    PROTOCOL = 8  # 2: put carries the block's token ids; 3: export to other nodes;
    # 4: replicas report their stats (report_replica, replica_reports); 5: match;
    # 6: put's keep_hot; 7: demote (a model the pool unloaded); 8: clear

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

    @ray.method(concurrency_group="puts")
    def clear(self, model: str, identities: frozenset[str], wait_s: float) -> Cleared:
        """Forget a model's blocks on this node (``TieredStore.clear``)."""
        return self.tiers.clear(model, identities, wait_s)

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


def store_name(node_id: str) -> str:
    """The Ray name of ``node_id``'s cache-store actor (in ``NAMESPACE``)."""
    return f"cache-store-{node_id}"


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
            name=store_name(node_id),
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


