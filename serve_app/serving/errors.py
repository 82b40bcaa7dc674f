"""The refusals a server answers before or instead of generating: one home for each code,
its HTTP status and its Retry-After."""

from __future__ import annotations

from serve_app.serving.request import ApiError

RETRY_AFTER_S = 1  # a full queue or KV budget: a request may end within a second
CAPACITY_RETRY_AFTER_S = 5  # a loaded model is busy: retry once a request could end


def queue_full_error(message: str) -> ApiError:
    """429 ``queue_full`` with Retry-After: the model (or its prepare stage) is full."""
    return ApiError(429, message, type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def kv_budget_error(message: str) -> ApiError:
    """429 ``kv_budget_exceeded``: the request's KV alone is over its model's KV budget in
    the memory plan (it would never be admitted; a smaller ``max_tokens`` may be)."""
    return ApiError(429, message, type="rate_limit_error", code="kv_budget_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def model_capacity_error(message: str) -> ApiError:
    """503 ``model_capacity`` with Retry-After: the request's model is not loaded and the
    pool can unload nothing to make room (every loaded model is pinned or busy)."""
    return ApiError(503, message, type="service_unavailable", code="model_capacity",
                    headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)})


def model_load_failed_error(message: str) -> ApiError:
    """503 ``model_load_failed`` with Retry-After: loading the model failed (the message
    names the cause); a later request tries again."""
    return ApiError(503, message, type="service_unavailable", code="model_load_failed",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


RANK_LOST_RETRY_AFTER_S = 10  # Serve replaces the replica and its ranks: give it time


def rank_lost_error(message: str) -> ApiError:
    """503 ``rank_lost`` with Retry-After: a rank of a model sharded over several
    processes was lost (the message names it and its node); Serve replaces the replica."""
    return ApiError(503, message, type="service_unavailable", code="rank_lost",
                    headers={"Retry-After": str(RANK_LOST_RETRY_AFTER_S)})


def conflict_error(message: str, code: str) -> ApiError:
    """409: an asked-for change that the server's state refuses now (the message says
    what would let it through)."""
    return ApiError(409, message, type="invalid_request_error", code=code)
