"""Samples of a replica, a sharded model's ranks, the model pool and a cache store, from
their plain stats dataclasses: what ``MetricsPump`` reads every second (``table`` holds
the definitions they name)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from serve_app.cache.stats import Usage
from serve_app.metrics.table import (
    DROP_REASONS,
    MISS_REASONS,
    TIERS,
    WRITE_RESULTS,
    Sample,
)

if TYPE_CHECKING:
    from serve_app.cache.manager_stats import CacheStats
    from serve_app.cache.stats import StoreStats
    from serve_app.memory.plan import ReplicaMemory
    from serve_app.memory.shapes import CacheShape
    from serve_app.multimodal.tower import VisionStats
    from serve_app.parallel.group import RankStatus
    from serve_app.reasoning.ahead import ThinkingStats
    from serve_app.serving.engine_events import EngineStats


def _thinking_samples(m: dict[str, str], thinking: ThinkingStats | None) -> list[Sample]:
    from serve_app.reasoning.ahead import OUTCOMES, ThinkingStats

    t = thinking if thinking is not None else ThinkingStats()
    return [Sample("serve_app_reasoning_tokens", m, t.thought_tokens),
            *(Sample("serve_app_history_ahead_requests", {**m, "outcome": o}, t.ahead[o])
              for o in OUTCOMES),
            Sample("serve_app_history_ahead_prefilled_tokens", m, t.ahead_prefilled_tokens)]


def _vision_samples(m: dict[str, str], vision: VisionStats | None) -> list[Sample]:
    from serve_app.multimodal.tower import VisionStats

    vision = vision if vision is not None else VisionStats()  # a text model's: zeros
    return [Sample("serve_app_images", {**m, "source": "encoded"}, vision.images),
            Sample("serve_app_images", {**m, "source": "feature_cache"}, vision.cache_hits),
            Sample("serve_app_images", {**m, "source": "prefix_cache"}, vision.prefix_hits),
            Sample("serve_app_image_encoder_seconds", m, vision.encoder_seconds)]


def rank_samples(model: str, ranks: Sequence[RankStatus]) -> list[Sample]:
    """Samples of a sharded model's ranks (none for a model in one process)."""
    out = []
    for r in ranks:
        labels = {"model": model, "rank": str(r.rank)}
        out.append(Sample("serve_app_rank_step_seconds", labels, r.step_seconds))
        out.append(Sample("serve_app_rank_collective_seconds", labels, r.channel_seconds))
    return out


def replica_samples(model: str, engine: EngineStats, cache: CacheStats,
                    normalized: dict[str, int],
                    thinking: ThinkingStats | None = None,
                    vision: VisionStats | None = None,
                    kv: CacheShape | None = None) -> list[Sample]:
    """Samples of one replica from its engine and prefix-cache stats, its normalized
    requests by rule, its thinking and its vision counters, its K/V's bytes a token."""
    m = {"model": model}
    sm = {**m, "method": engine.speculative_method or "off"}
    kv_samples = [] if kv is None else [Sample(
        "serve_app_kv_bytes_per_token", {**m, "format": kv.kv_format}, kv.kv_bytes_per_token)]
    out = [*_thinking_samples(m, thinking), *_vision_samples(m, vision), *kv_samples,
        Sample("serve_app_prompt_tokens", m, engine.prompt_tokens),
        Sample("serve_app_generation_tokens", m, engine.generated_tokens),
        Sample("serve_app_running_requests", m, engine.running_batch_size),
        Sample("serve_app_queued_requests", m,
               max(0, engine.in_flight - engine.running_batch_size)),
        Sample("serve_app_rejected_requests", {**m, "reason": "queue_full"}, engine.rejected),
        Sample("serve_app_rejected_requests", {**m, "reason": "kv_budget"}, engine.kv_rejected),
        Sample("serve_app_kv_waiting_requests", m, engine.kv_waiting),
        Sample("serve_app_speculative_verify_steps", sm, engine.verify_steps),
        Sample("serve_app_speculative_drafting_rows", sm, engine.drafting_row_steps),
        Sample("serve_app_speculative_drafted_tokens", sm, engine.drafted_tokens),
        Sample("serve_app_speculative_accepted_tokens", sm, engine.accepted_tokens),
        Sample("serve_app_speculating_rows", m, engine.speculating_rows),
        Sample("serve_app_prefix_cache_lookups", m, cache.lookups),
        Sample("serve_app_prefix_cache_missed_tokens", m, cache.missed_tokens),
        Sample("serve_app_prefix_cache_trim_hits", m, cache.trim_hits),
        Sample("serve_app_prefix_cache_walkbacks", m, cache.walkbacks),
        Sample("serve_app_prefix_cache_checkpoint_decode_failures", m,
               cache.checkpoint_rejects),
        Sample("serve_app_prefix_cache_captured_tokens", m, engine.captured_tokens),
        Sample("serve_app_prefix_cache_checkpoint_bytes", m, engine.captured_checkpoint_bytes),
        Sample("serve_app_prefix_cache_incompatible_payloads", m, cache.incompatible_payloads),
        Sample("serve_app_prefix_cache_restore_failures", m, cache.restore_failures),
        Sample("serve_app_prefix_cache_inflight_waits", m, cache.inflight_waits),
        Sample("serve_app_prefix_cache_inflight_wait_seconds", m, cache.inflight_wait_seconds),
        Sample("serve_app_prefix_cache_ssd_read_bytes", m, cache.ssd_read_bytes),
        Sample("serve_app_prefix_cache_ssd_read_seconds", m, cache.ssd_read_seconds),
        Sample("serve_app_remote_fetch_blocks", m, cache.remote_fetch_blocks),
        Sample("serve_app_remote_fetch_bytes", m, cache.remote_fetch_bytes),
        Sample("serve_app_remote_fetch_seconds", m, cache.remote_fetch_seconds),
        Sample("serve_app_remote_fetch_failures", m, cache.remote_fetch_failures),
        Sample("serve_app_remote_fetch_skipped", m, cache.remote_fetch_skipped),
    ]
    # The cache's counters change on the replica's event loop while this runs on the
    # pump's thread: each labelled family is read from a copy.
    hits, loads = dict(cache.hit_tokens_by_tier), dict(cache.checkpoint_loads_by_tier)
    for tier in TIERS:
        out.append(Sample("serve_app_prefix_cache_hit_tokens", {**m, "tier": tier},
                          hits.get(tier, 0)))
        out.append(Sample("serve_app_prefix_cache_checkpoint_loads", {**m, "tier": tier},
                          loads.get(tier, 0)))
    misses = dict(cache.misses_by_reason)
    for reason in MISS_REASONS:
        out.append(Sample("serve_app_prefix_cache_misses", {**m, "reason": reason},
                          misses.get(reason, 0)))
    for kind, count in dict(cache.store_errors_by_kind).items():
        out.append(Sample("serve_app_prefix_cache_store_errors", {**m, "kind": kind}, count))
    for position, count in dict(cache.cache_busts_by_position).items():
        out.append(Sample("serve_app_prefix_cache_busts", {**m, "position": position}, count))
    for rule, count in dict(normalized).items():
        out.append(Sample("serve_app_normalized_requests", {**m, "rule": rule}, count))
    return out


def memory_samples(model: str, memory: ReplicaMemory) -> list[Sample]:
    """``serve_app_memory_bytes`` of one replica from its memory section (``ModelReplica.
    _memory_stats``); kinds without a value (no plan, nothing set off Metal) are left out.
    A model the pool unloaded holds no weights and no KV: those kinds are 0 then."""
    planned = memory.planned
    held = 1 if memory.loaded else 0
    values = {"weights": _times(planned.weights_bytes if planned else None, held),
              "kv": _times(planned.kv_bytes if planned else None, held),
              "hot_share": planned.hot_share_bytes if planned else None,
              "kv_budget": _times(memory.kv_budget_bytes, held),
              "kv_in_use": memory.kv_in_use_bytes,
              "wired_limit": memory.wired_limit_bytes,
              "cache_limit": memory.cache_limit_bytes,
              "process_rss": memory.process_rss_bytes}
    return [Sample("serve_app_memory_bytes", {"model": model, "kind": kind}, value)
            for kind, value in values.items() if value is not None]


def pool_samples(model: str, loaded: bool, loads: int, load_seconds: float,
                 unloads: dict[str, int]) -> list[Sample]:
    """The model pool's metrics of one replica (``ModelReplica``'s counts)."""
    labels = {"model": model}
    return [Sample("serve_app_model_loaded", labels, 1.0 if loaded else 0.0),
            Sample("serve_app_model_loads", labels, loads),
            Sample("serve_app_model_load_seconds", labels, load_seconds),
            *(Sample("serve_app_model_unloads", {**labels, "reason": reason}, n)
              for reason, n in unloads.items())]


def pooling_samples(model: str, task: str, inputs: int, tokens: int) -> list[Sample]:
    """An embedding or rerank replica's counts (``PoolingReplica``): zeros at its start."""
    labels = {"model": model, "task": task}
    return [Sample("serve_app_pooling_inputs", labels, inputs),
            Sample("serve_app_pooling_tokens", labels, tokens)]


def _times(value: int | None, factor: int) -> int | None:
    return None if value is None else value * factor


def store_samples(stats: StoreStats, names: dict[str, str]) -> list[Sample]:
    """Samples of a node's cache store from its tiers' stats (``TieredStore.stats()``).

    ``names`` maps a model identity's first 16 hex digits (how SSD files name
    their model) to the name it is served under; files of models nobody serves
    here now are labelled ``other``.
    """
    out = [Sample("serve_app_cache_budget_bytes", {"tier": "hot"}, stats.hot_budget_bytes)]
    hot = {name: Usage() for name in set(names.values())}
    hot.update(stats.hot_by_model)
    for model, u in hot.items():
        labels = {"model": model, "tier": "hot"}
        out.append(Sample("serve_app_cache_bytes", {**labels, "kind": "block"}, u.block_bytes))
        out.append(Sample("serve_app_cache_entries", {**labels, "kind": "block"}, u.blocks))
        out.append(Sample("serve_app_cache_evictions", labels, u.evictions))
    staging = stats.staging
    out += [
        Sample("serve_app_cache_budget_bytes", {"tier": "staging"}, stats.staging_budget_bytes),
        Sample("serve_app_cache_staging_pending_bytes", {}, staging.pending_bytes),
        Sample("serve_app_cache_staging_peak_pending_bytes", {}, staging.peak_pending_bytes),
        Sample("serve_app_cache_staging_backpressure_seconds", {},
               staging.backpressure_seconds),
        Sample("serve_app_cache_staging_inline_writes", {}, staging.inline_writes),
        Sample("serve_app_cache_oversized_snapshot_blocks", {}, staging.oversized_skipped),
    ]
    writes = {"done": staging.writes_done, "failed": staging.writes_failed,
              "dropped": stats.writes_dropped}
    for result in WRITE_RESULTS:
        out.append(Sample("serve_app_cache_staging_writes", {"result": result}, writes[result]))
    dropped = {"publish": stats.dropped_publish, "hot_full": stats.dropped_hot_full,
               "ssd_low_space": stats.dropped_ssd_low_space,
               "ssd_budget": stats.dropped_ssd_budget,
               "ssd_write_budget": stats.dropped_ssd_write_budget}
    for reason in DROP_REASONS:
        out.append(Sample("serve_app_cache_dropped_blocks", {"reason": reason}, dropped[reason]))
    if stats.ssd_budget_bytes is None:  # no SSD tier
        return out
    out.append(Sample("serve_app_cache_budget_bytes", {"tier": "ssd"}, stats.ssd_budget_bytes))
    out.append(Sample("serve_app_cache_ssd_written_bytes", {}, stats.ssd_written_bytes))
    if stats.ssd_write_budget_per_hour is not None:
        out.append(Sample("serve_app_cache_ssd_write_budget_bytes", {},
                          stats.ssd_write_budget_per_hour))
    per_name = {name: Usage() for name in set(names.values())}
    for key, u in stats.ssd_by_model.items():
        name = names.get(key, "other")
        per_name[name] = per_name.get(name, Usage()) + u
    for model, u in per_name.items():
        labels = {"model": model, "tier": "ssd"}
        out.append(Sample("serve_app_cache_bytes", {**labels, "kind": "block"}, u.block_bytes))
        out.append(Sample("serve_app_cache_entries", {**labels, "kind": "block"}, u.blocks))
        out.append(Sample("serve_app_cache_bytes", {**labels, "kind": "sidecar"},
                          u.sidecar_bytes))
        out.append(Sample("serve_app_cache_entries", {**labels, "kind": "sidecar"}, u.sidecars))
        out.append(Sample("serve_app_cache_evictions", labels, u.evictions))
    return out
