"""What the status page shows: the last errors, and ``/v1/status``, the part of
``/v1/stats`` the page reads.

``/v1/status`` is ``/v1/stats`` pruned to the fields in ``STATUS_FIELDS``: every figure sits
at the same path in both, so a figure on the page can be checked against ``/v1/stats``
(the browser test does) and there is one source of truth, not two reports that drift.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.serving.request import ApiError

RECENT_ERRORS = 20  # errors kept for the page, newest first
MESSAGE_CHARS = 300
# The message of an error about a request's body can quote that body (another tenant's,
# with API keys on; a 404 names the model the body asked for): only its type, param and
# code are kept.
BODY_STATUSES = frozenset({400, 404, 413, 422})

ANY = "*"
# The fields of /v1/stats that /v1/status keeps: a dict is a subtree (``ANY``: every key
# at that level), True the whole value.
_CACHE_STORE = {
    "budget_bytes": True, "bytes": True, "blocks": True, "pinned_blocks": True,
    "evictions": True,
    "staging": {"pending_bytes": True, "pending_max_bytes": True},
    "dropped": True,
    "ssd": {"dir": True, "disabled": True, "budget_bytes": True, "block_bytes": True,
            "sidecar_bytes": True, "blocks": True, "sidecars": True,
            "write_budget_per_hour": True, "written_last_hour": True, "bytes_written": True,
            "reads": True, "evictions": True, "index_ready": True},
}
STATUS_FIELDS: dict[str, Any] = {
    "server": True,
    "models": {ANY: {
        "model": True,
        "phase": True,
        "engine": {k: True for k in (
            "submitted", "finished", "cancelled", "rejected", "failed", "in_flight",
            "running_batch_size", "peak_batch_size", "generated_tokens", "prompt_tokens",
            "restored_tokens", "kv_in_use_bytes", "kv_waiting", "speculative_method",
            "drafted_tokens", "accepted_tokens")},
        "recent": True,
        "images": True,
        "pooling": True,
        "kv_cache": {"kv_format": True, "kv_bytes_per_token": True,
                     "float_kv_bytes_per_token": True},
        "cache": {k: True for k in (
            "enabled", "disabled_reason", "block_size", "lookups", "hit_tokens",
            "missed_tokens", "hit_rate", "hit_tokens_by_tier", "misses_by_reason",
            "last_miss_reason", "cache_busts_by_position", "recent_cache_busts",
            "restore_failures", "last_store_error")},
        "cache_store": _CACHE_STORE,
        "replica": {"pid": True, "node_id": True, "status": True, "loads": True,
                    "memory": True, "ranks": True},
        "replicas_expected": True,
        "replicas_complete": True,
        "replicas_note": True,
    }},
    "memory": {
        "plan": {k: True for k in (
            "total_memory_bytes", "budget_bytes", "budget_origin", "planned_bytes",
            "hot_bytes", "staging_bytes", "loaded", "max_loaded_models", "fits", "advisory",
            "models", "problems", "notes")},
        "nodes": {ANY: {k: True for k in (
            "total_memory_bytes", "budget_bytes", "planned_bytes", "kv_in_use_bytes",
            "hot_bytes", "staging_bytes", "wired_limit_bytes", "advisory")}},
    },
    "pool": True,
    "nodes": True,
    "errors": True,
    "benchmarks": True,
}


def pruned(value: Any, spec: Any) -> Any:
    """``value`` with only the keys ``spec`` names (recursively); missing keys stay out."""
    if spec is True or not isinstance(value, dict):
        return value
    out = {}
    for key, sub in value.items():
        inner = spec.get(key, spec.get(ANY))
        if inner is not None:
            out[key] = pruned(sub, inner)
    return out


def status_view(stats: dict[str, Any]) -> dict[str, Any]:
    """``/v1/status``: ``/v1/stats`` (with its ingress sections) as the page reads it."""
    return pruned(stats, STATUS_FIELDS)


@dataclass(frozen=True)
class ErrorRecord:
    """One error answer: when (Unix time), to what, and what it said."""

    at: float
    path: str
    model: str | None
    status: int
    type: str
    code: str | None
    param: str | None
    message: str | None  # None for an error about the request's body (BODY_STATUSES)


class ErrorLog:
    """The last ``RECENT_ERRORS`` error answers of this ingress, and counts by status since
    it started. Thread-safe; nothing of a request's content is kept but what an error
    message of ours says, and not even that for errors about a body."""

    def __init__(self, keep: int = RECENT_ERRORS) -> None:
        self._recent: deque[ErrorRecord] = deque(maxlen=keep)
        self._by_status: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, path: str, model: str | None, err: ApiError) -> None:
        message = None if err.status in BODY_STATUSES else err.message[:MESSAGE_CHARS]
        record = ErrorRecord(round(time.time(), 3), path, model, err.status, err.type,
                             err.code, err.param, message)
        with self._lock:
            self._recent.appendleft(record)
            key = str(err.status)
            self._by_status[key] = self._by_status.get(key, 0) + 1

    def report(self) -> dict[str, Any]:
        """``/v1/stats``' ``errors``: the total, by status, and the last ones."""
        with self._lock:
            return {"total": sum(self._by_status.values()),
                    "by_status": dict(sorted(self._by_status.items())),
                    "recent": [asdict(r) for r in self._recent]}


@dataclass(frozen=True)
class ServerInfo:
    """``/v1/stats``' ``server``: what is running and since when."""

    version: str | None
    started_at: float  # Unix time
    api_keys: bool  # routes need a key (the page asks for one)
    admin_keys: bool  # the controls need an admin key
    model_pool: bool  # the ingress runs the model pool (load, unload, pin)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "uptime_s": round(time.time() - self.started_at, 1)}
