"""Every replica of a model in ``/v1/stats``: what a replica reports, where the reports
are kept, and how they make the model's totals.

Ray Serve has no call that reaches every replica of a deployment: a ``/v1/stats`` call
lands on one of them. So each model replica sends its stats (a ``ReplicaReport``) every
``REPORT_INTERVAL_S`` to its node's cache-store actor (from its metrics pump thread, one
send in flight at most); the store keeps the latest report of each replica on a
``ReplicaBoard`` and forgets one silent for ``FORGET_AFTER_S`` (it stopped). The
ingress asks every node's store for a model's reports, puts the replica that answered
the call first (its numbers fresh) and merges them (``model_view``): a ``replicas``
list, the model's totals (each field as it declares: ``serve_app.cache.merge``), and
whether every configured replica is among them. Reports are typed (``ReplicaStats``)
until ``ModelView.to_json``.

Pure: no Ray, no MLX (the store actor and the ingress import it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from serve_app.cache.merge import merge
from serve_app.memory.plan import NodeMemory
from serve_app.serving.replica_stats import ReplicaStats

REPORT_INTERVAL_S = 1.0  # a replica reports this often (its metrics pump's period)
FORGET_AFTER_S = 5 * REPORT_INTERVAL_S  # a replica silent this long has stopped

@dataclass(frozen=True)
class ReplicaReport:
    """One replica's stats as it last sent them to its node's store."""

    model: str
    node_id: str
    pid: int
    stats: ReplicaStats  # as ``ModelReplica.report_stats`` builds it (its own sections)
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
    stats: ReplicaStats

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "pid": self.pid, "age_s": self.age_s,
                "answered": self.answered, "stats": self.stats.to_json()}


@dataclass(frozen=True)
class ModelView:
    """A model's ``/v1/stats``: the answering replica's stats, the totals over every
    replica listed, the replicas, and whether every configured replica is among them."""

    answered: ReplicaStats
    totals: ReplicaStats
    replicas: tuple[ReplicaEntry, ...]
    expected: int
    note: str | None

    def to_json(self) -> dict[str, Any]:
        """The answering replica's sections with the totals' ``engine``, ``cache``,
        ``phases`` and ``normalization``; ``model``, ``replica`` and ``cache_store`` stay
        the answering replica's."""
        out = self.answered.to_json()
        totals = self.totals.to_json()
        for key in ("engine", "cache", "phases", "normalization", "recent"):
            if key in totals:
                out[key] = totals[key]
        out["replicas"] = [e.to_json() for e in self.replicas]
        out["replicas_expected"] = self.expected
        out["replicas_complete"] = len(self.replicas) >= self.expected
        out["replicas_note"] = self.note
        return out

    def memory(self) -> list[NodeMemory]:
        """Each listed replica's memory section, for ``/v1/stats``' ``memory``."""
        return [NodeMemory(self.answered.model, e.pid, e.node_id, e.stats.replica.memory)
                for e in self.replicas
                if e.stats.replica is not None and e.stats.replica.memory is not None]


def model_view(answered: ReplicaStats, gathered: Gathered, expected: int) -> ModelView:
    """A model's view: ``answered`` (the stats of the replica that took the call) merged
    with the other replicas' reports, the answering one first, then by node and pid (a
    replica's own older report is dropped: what it just answered is fresher)."""
    process = answered.replica
    mine = ReplicaEntry(process.node_id if process else "", process.pid if process else 0,
                        0.0, True, answered.own())
    others: dict[tuple[str, int], ReplicaReport] = {}
    for r in gathered.reports:
        key = (r.node_id, r.pid)
        if key == (mine.node_id, mine.pid):
            continue
        if key not in others or r.age_s < others[key].age_s:
            others[key] = r
    entries = (mine, *(ReplicaEntry(r.node_id, r.pid, r.age_s, False, r.stats)
                       for _, r in sorted(others.items())))
    return ModelView(answered, merge([e.stats for e in entries]), entries, expected,
                     _note(len(entries), expected, gathered))


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
