"""The cluster's block directory as a Ray actor, and each process's copy of it.

``BlockDirectoryService`` (one detached actor) applies the stores' event batches;
``DirectoryFollower`` keeps a router's or a replica's copy current from a thread, so
reading it never makes a remote call.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from serve_app.cluster.directory import BlockDirectory, Changes, EventBatch
from serve_app.models.compat import HEAD_NODE_RESOURCE

logger = logging.getLogger(__name__)

NAMESPACE = "serve_app"


FOLLOW_INTERVAL_S = 0.25  # how often a router or replica pulls the directory's changes


LOOK_FOR_DIRECTORY_S = 1.0  # how often a follower looks for a directory not there yet


FEED_TIMEOUT_S = 10.0


NODE_CHECK_S = 2.0  # how often the directory looks for nodes that died


# The suffix changes with the directory's method signatures (2: ``changes_since`` takes
# the follower's incarnation): the actor is detached and outlives a redeploy.
DIRECTORY_NAME = "block-directory-2"


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
    """The cluster's block directory actor, created by the first store that asks, on the
    head node: a worker that dies would take every node's block map with it (the cluster
    does not outlive its head anyway)."""
    return BlockDirectoryActor.options(name=DIRECTORY_NAME, namespace=NAMESPACE,
                                       lifetime="detached", get_if_exists=True,
                                       resources={HEAD_NODE_RESOURCE: 0.001}).remote()
