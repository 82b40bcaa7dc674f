"""What a node's cache store counts, typed as the metrics pump reads it.

Plain dataclasses, no Ray and no arrays: ``serve_app.metrics.table`` turns a ``StoreStats``
into samples by attribute. ``/v1/stats`` shows the fuller dict of
``TieredStore.snapshot()`` (its ``staging`` is a ``StagingStats``).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field


@dataclass(frozen=True)
class Usage:
    """One model's share of a tier: blocks (KV; in the hot tier with their recurrent
    state), sidecar files (GDN state on SSD) and evictions."""

    blocks: int = 0
    block_bytes: int = 0
    sidecars: int = 0
    sidecar_bytes: int = 0
    evictions: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.blocks + other.blocks, self.block_bytes + other.block_bytes,
                     self.sidecars + other.sidecars, self.sidecar_bytes + other.sidecar_bytes,
                     self.evictions + other.evictions)


@dataclass
class SSDStats:
    """The SSD tier's counters (``SSDStore.counters``)."""

    writes_done: int = 0
    writes_failed: int = 0
    writes_skipped_low_space: int = 0
    writes_skipped_budget: int = 0
    writes_skipped_write_budget: int = 0  # the hourly write budget (SSD wear) was spent
    bytes_written: int = 0  # bytes of files written (what wears the SSD)
    reads: int = 0
    read_failures: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    temp_files_removed: int = 0
    foreign_files: int = 0


@dataclass(frozen=True)
class Cleared:
    """What a cache clear took out of one node's store."""

    hot_blocks: int = 0
    hot_bytes: int = 0
    ssd_files: int = 0  # blocks and sidecars
    ssd_bytes: int = 0
    kept_in_use: int = 0  # blocks and files a restore held: they stay

    def __add__(self, other: Cleared) -> Cleared:
        return Cleared(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class StagingStats:
    """The write path's counters. ``writes_dropped`` (SSD writes skipped for the
    free-space floor, a budget full of pinned files or the hourly write budget) is read
    off the SSD store."""

    pending_bytes: int = 0
    peak_pending_bytes: int = 0
    backpressure_seconds: float = 0.0
    inline_writes: int = 0
    writes_done: int = 0
    writes_failed: int = 0
    dropped_hot_full: int = 0  # rejected by a full hot tier with no SSD tier to keep them
    # Blocks of conversations larger than their model's share of the hot tier: kept out
    # of RAM (on SSD only; dropped without an SSD tier).
    oversized_skipped: int = 0
    oversized_skipped_bytes: int = 0
    # Blocks of a model the pool unloaded, taken out of RAM because the SSD tier has them.
    demoted_blocks: int = 0
    demoted_bytes: int = 0


@dataclass(frozen=True)
class StoreStats:
    """A node's tiers at one moment (copies, taken under the store's locks)."""

    hot_budget_bytes: int
    hot_by_model: dict[str, Usage]  # by the name the hot entries carry
    staging: StagingStats
    staging_budget_bytes: int
    # Blocks or sidecars dropped instead of stored, by reason (``metrics.DROP_REASONS``).
    dropped_hot_full: int = 0
    dropped_ssd_low_space: int = 0
    dropped_ssd_budget: int = 0
    dropped_ssd_write_budget: int = 0  # the hourly SSD write budget (wear) was spent
    dropped_publish: int = 0  # counted by the store actor: replicas report them
    ssd_budget_bytes: int | None = None  # None: no SSD tier (off, or refused)
    ssd_by_model: dict[str, Usage] = field(default_factory=dict)  # by identity[:16]
    ssd_written_bytes: int = 0  # bytes of files the SSD tier wrote
    ssd_write_budget_per_hour: int | None = None  # None: no SSD tier, or no limit

    @property
    def writes_dropped(self) -> int:
        """SSD writes skipped (free-space floor, budget full of pinned files, hourly write
        budget spent)."""
        return (self.dropped_ssd_low_space + self.dropped_ssd_budget
                + self.dropped_ssd_write_budget)
