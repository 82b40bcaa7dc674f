"""What one model replica reports (``ReplicaStats``), typed end to end: built by the
replica, sent to its node's store and to the ingress as it is (pickled), merged into the
model's totals field by field as each field declares (``serve_app.cache.merge``), and
turned into ``/v1/stats``' JSON only at the edge (``to_json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from serve_app.cache.manager_stats import CacheStats
from serve_app.cache.merge import merged
from serve_app.memory.plan import ReplicaMemory
from serve_app.memory.shapes import CacheShape
from serve_app.metrics.table import PHASES
from serve_app.parallel.group import RankStatus
from serve_app.serving.engine_events import EngineStats
from serve_app.serving.recent import RecentActivity

# The parts of ``cache_store`` that belong to a replica, not to its node's store: they
# travel in its report (the store's own stats are one per node, not per replica).
OWN_STORE_KEYS = ("publisher", "breaker", "directory")


@dataclass
class PhaseTimes:
    """Seconds spent in each phase before the first token, summed per phase, and how
    many requests reached each (a rejected or cancelled one stops early)."""

    seconds: dict[str, float] = merged(
        "sum_by_key", default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    counts: dict[str, int] = merged("sum_by_key", default_factory=lambda: dict.fromkeys(PHASES, 0))

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.counts[phase] += 1

    def summary(self) -> dict:
        return {"requests": self.counts[PHASES[0]], "counts": dict(self.counts),
                "mean_ms": {k: round(v * 1000 / max(self.counts[k], 1), 3)
                            for k, v in self.seconds.items()}}


@dataclass
class NormalizationStats:
    """The normalization rules a model applies, and the requests each changed."""

    rules: list[str] = merged("answering")
    requests_by_rule: dict[str, int] = merged("sum_by_key")


@dataclass
class CacheView:
    """The cache section's settings and per-replica measurements: the answering
    replica's (fetch bandwidth and prefill rate, per other node)."""

    checkpoint_interval: int | None = merged("answering", default=None)
    remote_fetch_policy: dict = merged("answering", default_factory=dict)


@dataclass
class ReplicaProcess:
    """The replica's process: where it runs, its loads and unloads, its prepare stage and
    its memory (``/v1/stats``' ``replica``)."""

    pid: int
    node_id: str
    user_code_thread: str | None = None
    status: str = "loaded"
    loads: int = 0
    load_seconds: float = 0.0
    unloads: dict[str, int] = field(default_factory=dict)
    last_unload_demoted: dict[str, int] = field(default_factory=dict)
    preparing: int = 0
    prepare_runs: int = 0
    memory: ReplicaMemory | None = None
    # A model sharded over ranks: each rank's node, steps, step and collective seconds.
    ranks: tuple[RankStatus, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ImageStats:
    """A vision model's images (``serve_app.multimodal.tower.VisionStats``), summed over
    its replicas."""

    encoded: int = merged("sum", default=0)  # the vision tower ran
    from_feature_cache: int = merged("sum", default=0)
    from_prefix_cache: int = merged("sum", default=0)  # the restored prefix held them
    encoder_seconds: float = merged("sum", default=0.0)
    feature_cache_bytes: int = merged("sum", default=0)


@dataclass
class PoolingStats:
    """An embedding or rerank model's work (``serve_app/deploy/pooling_replica``), summed
    over its replicas: requests, their inputs and tokens, the model calls that took them
    together (Ray Serve's @serve.batch) and the seconds those ran."""

    task: str = merged("answering", default="embed")
    requests: int = merged("sum", default=0)
    inputs: int = merged("sum", default=0)
    tokens: int = merged("sum", default=0)
    batches: int = merged("sum", default=0)
    batch_seconds: float = merged("sum", default=0.0)
    failed: int = merged("sum", default=0)


@dataclass
class ReplicaStats:
    """One replica's stats, or (merged) a model's over its replicas. An unloaded replica
    has no engine, cache, phases or normalization (None)."""

    model: str = merged("answering")
    engine: EngineStats | None = merged("nested", default=None)
    cache: CacheStats | None = merged("nested", default=None)
    cache_view: CacheView | None = merged("answering", default=None)
    phases: PhaseTimes | None = merged("nested", default=None)
    normalization: NormalizationStats | None = merged("nested", default=None)
    # The answering replica's process and node store (never summed).
    replica: ReplicaProcess | None = merged("answering", default=None)
    cache_store: dict | None = merged("answering", default=None)
    recent: RecentActivity | None = merged("nested", default=None)  # the last minute
    images: ImageStats | None = merged("nested", default=None)  # a vision model's
    pooling: PoolingStats | None = merged("nested", default=None)  # an embedding model's
    # What a sequence's cache weighs as the model holds it (its K/V's format, a token's
    # bytes against float K/V's, its recurrent state).
    kv_cache: CacheShape | None = merged("answering", default=None)

    def own(self) -> ReplicaStats:
        """What a replica reports to its store: its node store's stats left out."""
        store = self.cache_store
        return replace(self, cache_store=None if store is None else {
            k: store[k] for k in OWN_STORE_KEYS if k in store})

    def to_json(self) -> dict[str, Any]:
        """``/v1/stats``' shape: each section present as a dict; ``cache`` with its
        derived hit rate and checkpoint bytes per 1k captured tokens."""
        out: dict[str, Any] = {"model": self.model}
        if self.engine is not None:
            out["engine"] = asdict(self.engine)
        if self.cache is not None:
            cache = self.cache.summary()
            view = self.cache_view or CacheView()
            cache["checkpoint_interval"] = view.checkpoint_interval
            cache["remote_fetch_policy"] = view.remote_fetch_policy
            tokens = self.engine.captured_tokens if self.engine is not None else 0
            checkpoint = self.engine.captured_checkpoint_bytes if self.engine else 0
            cache["checkpoint_bytes_per_1k_tokens"] = (
                round(checkpoint * 1000 / tokens) if tokens else None)
            out["cache"] = cache
        if self.phases is not None:
            out["phases"] = self.phases.summary()
        if self.normalization is not None:
            out["normalization"] = asdict(self.normalization)
        if self.recent is not None:
            out["recent"] = self.recent.summary()
        if self.images is not None:
            out["images"] = asdict(self.images)
        if self.pooling is not None:
            out["pooling"] = asdict(self.pooling)
        if self.kv_cache is not None:
            out["kv_cache"] = asdict(self.kv_cache)
        if self.cache_store is not None:
            out["cache_store"] = self.cache_store
        if self.replica is not None:
            out["replica"] = self.replica.to_json()
        return out
