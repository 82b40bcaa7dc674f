"""Admission: whether a model takes one more request, decided in one place.

A request is refused with 429 ``queue_full`` while the engine holds ``max_batch_size +
max_queued_requests`` requests, and with 429 ``kv_budget_exceeded`` when its KV alone
(prompt plus ``max_tokens``) is over the model's KV budget: it could never run. The
replica asks before templating (the queue) and again once the prompt's length is known
(the KV); the engine applies the same bounds at ``submit`` and queues a request whose KV
does not fit beside the running ones until they free enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve_app.memory.shapes import CacheShape
from serve_app.serving.errors import kv_budget_error, queue_full_error, rank_lost_error

if TYPE_CHECKING:
    from serve_app.serving.engine import Engine
    from serve_app.serving.request import ApiError


class QueueFullError(Exception):
    """The engine already holds as many requests as it was allowed to queue."""


class RankLostError(Exception):
    """A model sharded over ranks lost one: nothing more is taken (503 ``rank_lost``)."""


class KVBudgetError(QueueFullError):
    """A request whose KV alone is more than the model's KV budget: it could never be
    admitted, however long it waited."""


@dataclass(frozen=True)
class KVBudget:
    """Admission by KV bytes: a request reserves the KV of its prompt plus its
    ``max_tokens`` (the model's bytes per token from its probed layout, rounded up to
    mlx-lm's 256-token steps as the plan rounds them, plus its recurrent state) from when
    it joins the batch to its end. Reserving the most a request can reach, not what it
    holds now, keeps it simple and safe: an admitted request can always finish, nothing
    is ever preempted. ``budget_bytes`` None: no admission by bytes (the batch size
    alone bounds the KV)."""

    shape: CacheShape | None = None
    budget_bytes: int | None = None

    def bytes_for(self, prompt_tokens: int, max_tokens: int) -> int:
        """The KV a request reserves (0 without a budget)."""
        if self.shape is None or self.budget_bytes is None:
            return 0
        return self.shape.bytes_for(1, prompt_tokens + max_tokens)

    def refusal(self, name: str, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request could never be admitted (its KV alone over the budget), or None."""
        budget = self.budget_bytes
        need = self.bytes_for(prompt_tokens, max_tokens)
        if budget is None or need <= budget:
            return None
        return (f"model {name!r}: this request needs {need} bytes of KV cache "
                f"({prompt_tokens} prompt tokens + max_tokens {max_tokens}), more than the "
                f"model's KV budget of {budget} bytes in the memory plan; lower max_tokens "
                "or shorten the prompt")

    def fits(self, in_use_bytes: int, need_bytes: int, running: int) -> bool:
        """Whether a request reserving ``need_bytes`` joins a batch of ``running``
        requests holding ``in_use_bytes`` (alone it always runs: ``refusal`` checked)."""
        if self.budget_bytes is None or not running:
            return True
        return in_use_bytes + need_bytes <= self.budget_bytes


def capacity_message(name: str, in_flight: int, max_batch_size: int,
                     max_queued_requests: int) -> str:
    return (f"model {name!r} is at capacity: {in_flight} requests in flight "
            f"(max_batch_size {max_batch_size} + max_queued_requests {max_queued_requests})")


def refusal(engine: Engine, prompt_tokens: int | None = None,
            max_tokens: int = 0) -> ApiError | None:
    """The API error that refuses a request now, or None: 429 ``queue_full`` when the
    engine is full (counted as a rejection), then, once the prompt's length is known,
    429 ``kv_budget_exceeded`` when its KV could never fit (counted in ``kv_rejected``);
    503 ``rank_lost`` when a sharded model lost a rank."""
    if engine.broken is not None:
        return rank_lost_error(engine.broken)
    if engine.at_capacity():
        return queue_full_error(engine.capacity_message())
    if prompt_tokens is not None:
        try:
            engine.check_kv(prompt_tokens, max_tokens)
        except KVBudgetError as exc:
            return kv_budget_error(str(exc))
    return None
