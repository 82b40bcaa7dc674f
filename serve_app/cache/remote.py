"""Fetching blocks another node holds: whether a fetch is worth it (``RemoteFetchPolicy``:
measured link speed against this model's prefill speed) and the link's measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.cache.client import (
    CircuitBreaker,
)


@dataclass
class NodeLink:
    """What this replica measured of fetching from one other node, and its breaker."""

    bandwidth: float
    latency: float
    breaker: CircuitBreaker
    fetches: int = 0
    failures: int = 0

    def snapshot(self) -> dict:
        return {"bandwidth_bytes_per_s": round(self.bandwidth), "fetches": self.fetches,
                "failures": self.failures, **self.breaker.snapshot()}


@dataclass
class RemoteFetchPolicy:
    """Whether fetching blocks from another node beats prefilling them here: measured
    fetch bandwidth against measured prefill rate (moving averages).

    Bandwidth is measured per node (``links``): a wedged or slow node never makes
    fetches from healthy ones look slower, and a node whose fetches fail or time out
    ``breaker_failures`` times in a row is skipped for ``breaker_cool_down_s`` (its
    circuit breaker), then tried again. ``bandwidth`` and ``latency`` are what a node
    not measured yet starts from (and, without a node, the replica-wide average).

    Until this replica has measured a prefill, fetching wins: KV bytes per token are
    small against what a token of prefill costs on any real model and link.
    """

    bandwidth: float = 1e9  # bytes/s until measured (10 GbE or Thunderbolt: 1-4 GB/s)
    latency: float = 0.005  # seconds a fetch costs beyond its bytes
    prefill_rate: float | None = None  # tokens/s, once measured
    min_timeout: float = 2.0
    weight: float = 0.3  # of a new measurement in the moving averages
    breaker_failures: int = 3
    breaker_cool_down_s: float = 10.0
    links: dict[str, NodeLink] = field(default_factory=dict)

    def link(self, node_id: str) -> NodeLink:
        link = self.links.get(node_id)
        if link is None:
            link = self.links[node_id] = NodeLink(
                self.bandwidth, self.latency,
                CircuitBreaker(self.breaker_failures, self.breaker_cool_down_s))
        return link

    def usable(self, node_id: str) -> bool:
        """False while the node's breaker is open (it is skipped; nothing consumed)."""
        link = self.links.get(node_id)
        return link is None or not link.breaker.is_open

    def allow(self, node_id: str) -> bool:
        """Fetch from this node now? (After a cool-down: one probe at a time.)"""
        return self.link(node_id).breaker.allow()

    def worth(self, nbytes: int, tokens: int, node_id: str | None = None) -> bool:
        if self.prefill_rate is None:
            return True
        return self.fetch_seconds(nbytes, node_id) < tokens / self.prefill_rate

    def fetch_seconds(self, nbytes: int, node_id: str | None = None) -> float:
        link = self.link(node_id) if node_id is not None else self
        return link.latency + nbytes / link.bandwidth

    def timeout(self, nbytes: int, node_id: str | None = None) -> float:
        """How long to wait for a fetch before prefilling instead: far past its estimate."""
        return max(self.min_timeout, 4 * self.fetch_seconds(nbytes, node_id))

    def fetched(self, nbytes: int, seconds: float, node_id: str | None = None) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth = self._mix(self.bandwidth, nbytes / seconds)
            if node_id is not None:
                link = self.link(node_id)
                link.bandwidth = self._mix(link.bandwidth, nbytes / seconds)
        if node_id is not None:
            link = self.link(node_id)
            link.fetches += 1
            link.breaker.success()

    def failed(self, node_id: str, nbytes: int = 0, timed_out_after: float = 0.0) -> None:
        """A fetch from ``node_id`` brought nothing (``timed_out_after``: it ran into its
        timeout, so that link is slower than thought). Only that node's link learns it."""
        link = self.link(node_id)
        link.failures += 1
        link.breaker.failure()
        if nbytes > 0 and timed_out_after > 0:
            link.bandwidth = self._mix(link.bandwidth, nbytes / timed_out_after)

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else self._mix(
                self.prefill_rate, rate)

    def snapshot(self) -> dict:
        return {node_id: link.snapshot() for node_id, link in self.links.items()}

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.weight) * old + self.weight * new
