"""``GET /metrics`` on a cluster: every node's store and replica reports gathered into
one scrape (``StoreReports``), cached briefly so a busy Prometheus does not multiply
the calls.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

import ray

from serve_app.cache.stats import Cleared
from serve_app.cluster.replicas import Gathered, ReplicaReport
from serve_app.metrics.exposition import merge_exposition
from serve_app.models.compat import HEAD_NODE_RESOURCE
from serve_app.store.actor import store_name

logger = logging.getLogger("ray.serve")

METRICS_FETCH_TIMEOUT_S = 5.0
METRICS_CACHE_S = 1.5  # /metrics answers from one gather of every node for this long


class StoreReports:
    """The ingress's way to every node's cache-store actor (found by name per alive
    node, as ``/metrics`` finds every node's export), for the replicas' stats reports.
    Each call is bounded by ``timeout``: a store that does not answer leaves its
    node's replicas out (named in ``Gathered.unreachable``), never fails the call."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.handles: dict[str, Any] = {}  # node id -> its store actor

    async def gather(self, model: str) -> Gathered:
        try:
            nodes = await self._nodes()
        except Exception as exc:  # the GCS busy: this replica's numbers, and why alone
            return Gathered(not_asked=f"Ray's list of nodes could not be read: {exc!r}")
        found = await asyncio.gather(*(self._of_node(node_id, model) for node_id in nodes))
        reports = tuple(r for part in found if part is not None for r in part)
        return Gathered(reports, tuple(n for n, part in zip(nodes, found, strict=True)
                                       if part is None))

    async def clear(self, model: str, identities: frozenset[str],
                    wait_s: float) -> tuple[Cleared, tuple[str, ...]]:
        """A model's blocks forgotten in every node's store: what went, in all, and the
        nodes whose store did not answer (their blocks stay)."""
        nodes = await self._nodes()
        got = await asyncio.gather(*(self._call(n, "clear", model, identities, wait_s,
                                                 timeout=self.timeout + wait_s)
                                     for n in nodes))
        done = [c for c in got if isinstance(c, Cleared)]
        return sum(done, Cleared()), tuple(n for n, c in zip(nodes, got, strict=True)
                                           if c is _UNREACHABLE)

    async def _nodes(self) -> list[str]:
        from serve_app.cluster.directory_service import alive_node_ids

        return sorted(await asyncio.to_thread(alive_node_ids))

    async def _of_node(self, node_id: str, model: str) -> list[ReplicaReport] | None:
        """The node's reports of ``model``; [] for a node without a store; None: its
        store did not answer."""
        got = await self._call(node_id, "replica_reports", model)
        return None if got is _UNREACHABLE else got

    async def _call(self, node_id: str, method: str, *args: Any,
                    timeout: float | None = None) -> Any:
        """``method(*args)`` of the node's store: [] for a node without one,
        ``_UNREACHABLE`` when it did not answer in time."""
        from serve_app.cluster.directory_service import NAMESPACE

        store: Any = self.handles.get(node_id)  # an actor handle
        if store is None:
            try:  # a GCS lookup: off the event loop
                store = await asyncio.to_thread(ray.get_actor, store_name(node_id),
                                                namespace=NAMESPACE)
            except ValueError:  # no cached model's replica has run on that node
                return []
            self.handles[node_id] = store
        try:
            return await asyncio.wait_for(getattr(store, method).remote(*args),
                                          timeout or self.timeout)
        except Exception as exc:  # dead, frozen, or older code: leave it out
            logger.warning("%s from the cache store of node %s: %r", method, node_id, exc)
            self.handles.pop(node_id, None)
            return _UNREACHABLE


_UNREACHABLE = object()


@dataclass(frozen=True)
class NodeInfo:
    """A node of the Ray cluster, as the status page lists it."""

    node_id: str
    address: str
    hostname: str
    alive: bool
    head: bool
    cpus: float
    gpus: float
    object_store_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def node_list() -> list[NodeInfo]:
    """Every node Ray knows (a GCS call, off the event loop), the head first; [] when the
    GCS does not answer (the page shows the rest)."""
    try:
        nodes = await asyncio.to_thread(ray.nodes)
    except Exception as exc:
        logger.warning("reading Ray's node list failed: %r", exc)
        return []
    out = []
    for n in nodes:
        res = n.get("Resources") or {}
        out.append(NodeInfo(
            n.get("NodeID", ""), n.get("NodeManagerAddress", ""),
            n.get("NodeManagerHostname", ""), bool(n.get("Alive")),
            HEAD_NODE_RESOURCE in res, float(res.get("CPU", 0)),
            float(res.get("GPU", 0)), int(res.get("object_store_memory", 0))))
    return sorted(out, key=lambda n: (not n.head, not n.alive, n.node_id))


class _ScrapeCache:
    """The last merged ``/metrics`` text, kept ``METRICS_CACHE_S``; scrapes that arrive
    while one gathers wait for it instead of calling every node again."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.at = 0.0
        self.pending: asyncio.Future | None = None
        self.gathers = 0  # fan-outs to every node so far

    async def get(self, max_age: float, models: tuple[str, ...] = ()) -> str:
        loop = asyncio.get_running_loop()
        if self.text is not None and loop.time() - self.at < max_age:
            return self.text
        pending = self.pending
        if pending is None or pending.done() or pending.get_loop() is not loop:
            pending = self.pending = asyncio.ensure_future(self._gather(models))
        return await asyncio.shield(pending)

    async def _gather(self, models: tuple[str, ...]) -> str:
        self.gathers += 1
        text = await _gather_node_metrics(models)
        self.text, self.at = text, asyncio.get_running_loop().time()
        return text


_scrapes = _ScrapeCache()


async def gather_node_metrics(max_age: float | None = None,
                              models: tuple[str, ...] = ()) -> str:
    """serve_app's families from every alive node's Ray metrics export, merged, with the
    histograms of ``models`` not observed yet at zero; at most one fan-out to the nodes
    per ``METRICS_CACHE_S`` however often (or however many at once) Prometheus scrapes."""
    return await _scrapes.get(METRICS_CACHE_S if max_age is None else max_age, models)


async def _gather_node_metrics(models: tuple[str, ...] = ()) -> str:
    nodes = await asyncio.to_thread(ray.nodes)
    urls = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]
    texts = await asyncio.gather(*(asyncio.to_thread(_fetch, url) for url in urls))
    # Parsing every node's text is CPU work: not on the ingress's event loop.
    return await asyncio.to_thread(merge_exposition, [t for t in texts if t], models)


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=METRICS_FETCH_TIMEOUT_S) as response:
            return response.read().decode()
    except OSError as exc:  # one node down must not blank the others
        logger.warning("reading node metrics from %s failed: %s", url, exc)
        return None
