"""What one replica's cache manager counts (``CacheStats``): lookups, hit and missed
tokens by tier, walkbacks, store errors, the latest cache busts; shown in ``/v1/stats``
and turned into metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from serve_app.cache.client import STORE_ERROR_KINDS
from serve_app.cache.divergence import POSITION_BUCKETS, CacheBust, position_bucket
from serve_app.cache.merge import merged
from serve_app.cache.request_plan import Miss

RECENT_CACHE_BUSTS = 8  # shown in /v1/stats


@dataclass
class CacheStats:
    """Prefix-cache counters of one replica, token-granular like vLLM's; each says how
    the replicas' combine into the model's (``serve_app.cache.merge``)."""

    enabled: bool = merged("answering")
    disabled_reason: str | None = merged("answering")
    block_size: int = merged("answering")
    lookups: int = merged("sum", default=0)
    hit_tokens: int = merged("sum", default=0)
    missed_tokens: int = merged("sum", default=0)
    walkbacks: int = merged("sum", default=0)
    # Attention-only models: restores that cut a stored block or tail to the tokens it
    # shares with the prompt (a request that diverges inside it), and the tokens so kept.
    trim_hits: int = merged("sum", default=0)
    trim_hit_tokens: int = merged("sum", default=0)
    checkpoint_loads_by_tier: dict[str, int] = merged("sum_by_key", default_factory=dict)
    checkpoint_rejects: int = merged("sum", default=0)
    # cached payloads whose shapes or dtypes did not fit; restores that failed to build
    # (the request prefilled cold instead)
    incompatible_payloads: int = merged("sum", default=0)
    restore_failures: int = merged("sum", default=0)
    sidecar_loads: int = merged("sum", default=0)
    ssd_read_bytes: int = merged("sum", default=0)
    ssd_read_seconds: float = merged("sum", default=0.0)
    hit_tokens_by_tier: dict[str, int] = merged("sum_by_key", default_factory=dict)
    fetch_seconds: float = merged("sum", default=0.0)
    # Blocks fetched from another node's store (a cluster), and fetches that came back
    # with nothing usable (the node died or answered late: the request went on without).
    remote_fetches: int = merged("sum", default=0)
    remote_fetch_blocks: int = merged("sum", default=0)
    remote_fetch_bytes: int = merged("sum", default=0)
    remote_fetch_seconds: float = merged("sum", default=0.0)
    remote_fetch_failures: int = merged("sum", default=0)
    # another node had more, but recomputing was cheaper
    remote_fetch_skipped: int = merged("sum", default=0)
    # Store calls a request waited on that failed, timed out or were skipped (the
    # store's circuit breaker open): each such request went on without the cache.
    store_errors_by_kind: dict[str, int] = merged(
        "sum_by_key", default_factory=lambda: dict.fromkeys(STORE_ERROR_KINDS, 0))
    last_store_error: str | None = merged("answering", default=None)
    misses_by_reason: dict[str, int] = merged("sum_by_key", default_factory=dict)
    last_miss_reason: str | None = merged("answering", default=None)
    # Prompts that left a cached prompt early and rejoined it (see ``divergence``), by
    # the position bucket where they left it, and the last few of them (lengths only).
    cache_busts_by_position: dict[str, int] = merged(
        "sum_by_key", default_factory=lambda: dict.fromkeys(POSITION_BUCKETS, 0))
    recent_cache_busts: list[dict] = merged("answering", default_factory=list)
    # Lookups that first waited for blocks another request was prefilling, and how long.
    inflight_waits: int = merged("sum", default=0)
    inflight_wait_seconds: float = merged("sum", default=0.0)

    def miss(self, miss: Miss) -> None:
        """A lookup that restored less than it could (counted by its label)."""
        self.misses_by_reason[miss.label] = self.misses_by_reason.get(miss.label, 0) + 1
        self.last_miss_reason = miss.text

    def store_error(self, kind: str, text: str) -> None:
        self.store_errors_by_kind[kind] = self.store_errors_by_kind.get(kind, 0) + 1
        self.last_store_error = text

    def cache_bust(self, bust: CacheBust) -> None:
        self.cache_busts_by_position[position_bucket(bust.position)] += 1
        self.recent_cache_busts = [*self.recent_cache_busts[1 - RECENT_CACHE_BUSTS:],
                                   asdict(bust)]

    def summary(self) -> dict:
        """The counters plus the derived hit rate (of prompt tokens)."""
        seen = self.hit_tokens + self.missed_tokens
        return {**self.__dict__, "hit_rate": round(self.hit_tokens / seen, 4) if seen else None}
