"""Every replica of a model in ``/v1/stats``: what a replica reports, where the reports
are kept, and how they make the model's totals.

Ray Serve has no call that reaches every replica of a deployment: a ``/v1/stats`` call
lands on one of them. So each model replica sends its stats (a ``ReplicaReport``) every
``REPORT_INTERVAL_S`` to its node's cache-store actor (from its metrics pump thread, one
send in flight at most); the store keeps the latest report of each replica on a
``ReplicaBoard`` and forgets one silent for ``FORGET_AFTER_S`` (it stopped). The
ingress asks every node's store for a model's reports, puts the replica that answered
the call first (its numbers fresh) and merges them (``model_view``): a ``replicas``
list, the model's totals, and whether every configured replica is among them.

Pure: no Ray, no MLX (the store actor and the ingress import it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

REPORT_INTERVAL_S = 1.0  # a replica reports this often (its metrics pump's period)
FORGET_AFTER_S = 5 * REPORT_INTERVAL_S  # a replica silent this long has stopped

# How a model's totals combine its replicas' sections. Every key is named: a counter is
# summed, a gauge only where the sum means something for the model, a setting or a
# replica's own measurement is never summed (the answering replica's value is shown, each
# replica's in ``replicas``). A key named nowhere is the answering replica's too, and a
# unit test fails until it is named (tests/test_replica_stats.py).
ENGINE_SUMS = (
    # counters
    "submitted", "finished", "cancelled", "rejected", "failed", "decode_steps",
    "generated_tokens", "prompt_tokens", "step_seconds", "restored_tokens",
    "restored_bytes", "restore_seconds", "restore_failures", "captured_blocks",
    "captured_bytes", "captured_tokens", "captured_checkpoints",
    "captured_checkpoint_bytes", "captured_tails", "capture_seconds", "kv_waited",
    "kv_rejected",
    # gauges whose sum is the model's: requests in flight, in running batches, now; KV
    # reserved by running requests and requests waiting for KV (each replica's own budget)
    "in_flight", "running_batch_size", "kv_in_use_bytes", "kv_waiting",
)
ENGINE_MAX = ("peak_batch_size",)  # the largest batch one replica ran (batches never merge)
CACHE_SUMS = (
    "lookups", "hit_tokens", "missed_tokens", "walkbacks", "trim_hits", "trim_hit_tokens",
    "checkpoint_rejects", "incompatible_payloads", "restore_failures", "sidecar_loads",
    "ssd_read_bytes", "ssd_read_seconds", "fetch_seconds", "remote_fetches",
    "remote_fetch_blocks", "remote_fetch_bytes", "remote_fetch_seconds",
    "remote_fetch_failures", "remote_fetch_skipped", "inflight_waits", "inflight_wait_seconds",
)
CACHE_SUMS_BY_KEY = ("hit_tokens_by_tier", "checkpoint_loads_by_tier", "misses_by_reason",
                     "store_errors_by_kind", "cache_busts_by_position")
# Settings (the same on every replica), the last text a replica saw, and what a replica
# measured for itself (fetch bandwidth and prefill rate, per other node's breaker).
CACHE_ANSWERING = ("enabled", "disabled_reason", "block_size", "checkpoint_interval",
                   "last_miss_reason", "last_store_error", "recent_cache_busts",
                   "remote_fetch_policy")
CACHE_DERIVED = ("hit_rate", "checkpoint_bytes_per_1k_tokens")  # recomputed from the sums
# Sections of a replica's stats that are its own (summed into the totals); ``model``,
# ``replica`` (the answering replica's process) and ``cache_store`` (its node's store
# and its own client of it) stay the answering replica's.
TOTALLED = ("engine", "cache", "phases", "normalization")
# The parts of ``cache_store`` that belong to a replica, not to its node's store: they
# travel in its report (the store's own stats are one per node, not per replica).
OWN_STORE_KEYS = ("publisher", "breaker", "directory")


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's stats as it last sent them to its node's store."""

    model: str
    node_id: str
    pid: int
    # Its sections (``TOTALLED``, ``replica`` and ``cache_store``'s ``OWN_STORE_KEYS``),
    # as ``ModelReplica.report_stats`` builds them.
    stats: dict[str, Any]
    age_s: float = 0.0  # how old the numbers were when read back (the board's clock)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.model, self.node_id, self.pid


class ReplicaBoard:
    """A store's latest report of each replica on its node; forgets a replica silent
    for ``forget_after_s``. Thread-safe (the store actor is threaded)."""

    def __init__(self, forget_after_s: float = FORGET_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._latest: dict[tuple[str, str, int], tuple[float, ReplicaReport]] = {}
        self._lock = threading.Lock()

    def put(self, report: ReplicaReport) -> None:
        with self._lock:
            now = self.clock()
            self._forget(now)
            self._latest[report.key] = (now, report)

    def reports(self, model: str | None = None) -> list[ReplicaReport]:
        """The replicas' latest reports (of ``model``), each with its age, by node and pid."""
        with self._lock:
            now = self.clock()
            self._forget(now)
            out = [replace(r, age_s=round(r.age_s + now - at, 3))
                   for at, r in self._latest.values() if model is None or r.model == model]
        return sorted(out, key=lambda r: (r.node_id, r.pid))

    def _forget(self, now: float) -> None:
        for key in [k for k, (at, _) in self._latest.items()
                    if now - at > self.forget_after_s]:
            del self._latest[key]


@dataclass(frozen=True)
class Gathered:
    """What the ingress found of a model's other replicas: their reports from every
    node's store, the nodes whose store did not answer, or why none were asked."""

    reports: tuple[ReplicaReport, ...] = ()
    unreachable: tuple[str, ...] = ()  # node ids
    not_asked: str | None = None  # why no store was asked (the model's cache is off)


@dataclass(frozen=True)
class ReplicaEntry:
    """One replica in ``/v1/stats``'s ``replicas`` list."""

    node_id: str
    pid: int
    age_s: float  # 0 for the answering replica; else the age of its last report
    answered: bool  # this replica answered the call (its numbers are the freshest)
    stats: dict[str, Any]


def own_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """A replica's own sections of its full stats: what it reports to its store."""
    out = {k: stats[k] for k in (*TOTALLED, "replica") if k in stats}
    store = stats.get("cache_store")
    if store is not None:
        out["cache_store"] = {k: store[k] for k in OWN_STORE_KEYS if k in store}
    return out


def model_view(answered: dict[str, Any], gathered: Gathered, expected: int) -> dict[str, Any]:
    """A model's ``/v1/stats``: ``answered`` (the stats of the replica that took the call)
    merged with the other replicas' reports.

    The sections in ``TOTALLED`` become the model's totals over every replica listed;
    ``model``, ``replica`` and ``cache_store`` stay the answering replica's. Added:
    ``replicas`` (the answering one first, then by node and pid), ``replicas_expected``
    (the configured count), ``replicas_complete`` (as many replicas as configured are
    in the totals) and ``replicas_note`` (why not, when not).
    """
    replica = answered.get("replica") or {}
    mine = ReplicaEntry(str(replica.get("node_id", "")), int(replica.get("pid", 0)), 0.0,
                        True, own_stats(answered))
    others: dict[tuple[str, int], ReplicaReport] = {}
    for r in gathered.reports:
        key = (r.node_id, r.pid)
        if key == (mine.node_id, mine.pid):
            continue  # its last report is older than what it just answered
        if key not in others or r.age_s < others[key].age_s:
            others[key] = r
    entries = [mine, *(ReplicaEntry(r.node_id, r.pid, r.age_s, False, r.stats)
                       for _, r in sorted(others.items()))]
    out = dict(answered)
    out.update(totals([e.stats for e in entries]))
    out["replicas"] = [asdict(e) for e in entries]
    out["replicas_expected"] = expected
    out["replicas_complete"] = len(entries) >= expected
    out["replicas_note"] = _note(len(entries), expected, gathered)
    return out


def _note(seen: int, expected: int, gathered: Gathered) -> str | None:
    if seen >= expected:
        return None
    if gathered.not_asked is not None:
        return gathered.not_asked
    why = f"{seen} of {expected} replicas in the totals"
    if gathered.unreachable:
        return (f"{why}: the cache store of node(s) {', '.join(gathered.unreachable)} did "
                "not answer in time")
    return (f"{why}: a replica reports every {REPORT_INTERVAL_S:g} s once it is ready "
            "(one may be starting, or gone)")


def totals(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's totals of the ``TOTALLED`` sections of its replicas' stats (the
    answering replica first: its values stand where nothing is summed)."""
    if not replicas:
        return {}
    first = replicas[0]
    out: dict[str, Any] = {}
    if "engine" in first:
        out["engine"] = _engine([r.get("engine") or {} for r in replicas])
    if "cache" in first:
        engine = out.get("engine") or first.get("engine") or {}
        out["cache"] = _cache([r.get("cache") or {} for r in replicas], engine)
    if "phases" in first:
        out["phases"] = _phases([r.get("phases") or {} for r in replicas])
    if "normalization" in first:
        sections = [r.get("normalization") or {} for r in replicas]
        out["normalization"] = {**sections[0], "requests_by_rule": _sum_by_key(
            s.get("requests_by_rule") or {} for s in sections)}
    return out


def _engine(sections: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(sections[0])
    for key in ENGINE_SUMS:
        if key in out:
            out[key] = _sum(s.get(key) for s in sections)
    for key in ENGINE_MAX:
        if key in out:
            out[key] = max(s.get(key) or 0 for s in sections)
    return out


def _cache(sections: list[dict[str, Any]], engine: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(sections[0])
    for key in CACHE_SUMS:
        if key in out:
            out[key] = _sum(s.get(key) for s in sections)
    for key in CACHE_SUMS_BY_KEY:
        if key in out:
            out[key] = _sum_by_key(s.get(key) or {} for s in sections)
    if "hit_rate" in out:
        seen = (out.get("hit_tokens") or 0) + (out.get("missed_tokens") or 0)
        out["hit_rate"] = round(out["hit_tokens"] / seen, 4) if seen else None
    if "checkpoint_bytes_per_1k_tokens" in out:  # as ModelService.stats computes it
        tokens = engine.get("captured_tokens") or 0
        out["checkpoint_bytes_per_1k_tokens"] = (
            round((engine.get("captured_checkpoint_bytes") or 0) * 1000 / tokens)
            if tokens else None)
    return out


def _phases(sections: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests and per-phase counts summed; each phase's mean weighted by its count."""
    out = dict(sections[0])
    out["requests"] = _sum(s.get("requests") for s in sections)
    counts = [s.get("counts") or {} for s in sections]
    if "counts" in out:
        out["counts"] = _sum_by_key(counts)
    means = [s.get("mean_ms") or {} for s in sections]
    merged: dict[str, float] = {}
    for phase in means[0]:
        weights = [c.get(phase, s.get("requests") or 0) for c, s in zip(counts, sections,
                                                                          strict=True)]
        total = sum(weights)
        merged[phase] = (round(sum(m.get(phase, 0.0) * w for m, w in zip(means, weights,
                                                                          strict=True))
                               / total, 3) if total else 0.0)
    out["mean_ms"] = merged
    return out


def _sum(values: Iterable[Any]) -> Any:
    total: int | float = 0
    for v in values:
        if isinstance(v, int | float) and not isinstance(v, bool):
            total += v
    return total


def _sum_by_key(dicts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = _sum((out.get(k, 0), v))
    return out
