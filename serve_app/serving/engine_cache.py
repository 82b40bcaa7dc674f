"""The engine's side of the prefix cache, on its thread: a request's cache built from
its restore plan, and the blocks its plan says are due sliced out as its cache grows.
A failure here costs one request its hit (or one tail), never the running batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from serve_app.cache.blocks import build_cache, capture_block
from serve_app.cache.layout import Layout
from serve_app.cache.request_plan import Published
from serve_app.kvquant.batch_cache import make_cache
from serve_app.serving.engine_events import EngineStats
from serve_app.serving.engine_request import EngineRequest

logger = logging.getLogger(__name__)


def segments(req: EngineRequest) -> list[list[int]]:
    """What is left of the prompt, cut only where a checkpoint needs the batch to pause.

    KV blocks need no pause (they are sliced out of the cache once it covers them); a
    recurrent checkpoint exists only at the end of a segment. BatchGenerator cuts the
    segments further by ``prefill_step_size``.
    """
    rest = req.prompt[req.restored :]
    if req.cache is None:
        return [rest]
    cuts = [p - req.restored for p in req.cache.checkpoints(len(req.prompt), req.restored)]
    return [rest[a:b] for a, b in zip([0, *cuts], [*cuts, len(rest)], strict=True)]


def restore(model, layout: Layout, req: EngineRequest, stats: EngineStats, lock,
            name: str, restoring: bool = True) -> list | None:
    """The cache the request starts from: its restored one (``req.restored`` set), else
    a fresh quantized one where the K/V is (``layout.kv_quant``), else None (mlx-lm makes
    a float one). ``restoring`` False: restore nothing (a follower rank whose rank 0 failed to).

    A restore that fails to build (a payload that does not fit the model) costs that one
    request its cache hit, never the running batch.
    """
    def fresh() -> list | None:
        return None if layout.kv_quant is None else make_cache(model, layout.kv_quant)

    plan = req.cache.restore if req.cache and restoring else None
    if plan is None or not plan.tokens:
        return fresh()
    tic = time.perf_counter()
    try:
        cache = build_cache(model, layout, plan)
    except Exception:
        logger.exception("engine %s: restore of request %d failed; prefilling it cold",
                         name, req.rid)
        with lock:
            stats.restore_failures += 1
        return fresh()
    req.restored = plan.tokens
    with lock:
        stats.restored_tokens += plan.tokens
        stats.restored_bytes += plan.nbytes
        stats.restore_seconds += time.perf_counter() - tic
    return cache


def capture(req: EngineRequest, covered: int, finished_cache: list | None, layout: Layout,
            batch_caches: Callable[[int], tuple[list, int]], count: Callable[[list], None],
            name: str, *, state_valid: bool, decoding: bool, ended: bool) -> float:
    """Slice out what the request's plan says is due, now that the cache covers
    ``covered`` tokens (``state_valid``: the recurrent state is exactly there); returns
    the seconds it took. ``finished_cache``: the request's own cache once it has left the
    batch. A tail that fails to capture is logged and skipped: a cache that misses a tail
    is slower, never wrong."""
    plan = req.cache
    if plan is None:  # a request without a plan captures nothing
        return 0.0
    captures = plan.captures(covered, req.prompt, req.output, state_valid=state_valid,
                             decoding=decoding, ended=ended)
    if not captures:
        return 0.0
    tic = time.perf_counter()
    source = (finished_cache, 0) if finished_cache is not None else None
    for due in captures:
        try:
            if source is None:
                assert req.uid is not None  # in the batch: inserted
                source = batch_caches(req.uid)
            payload = capture_block(source[0], source[1], layout, due.start, due.end,
                                    due.with_state)
            published: list[Published] = plan.publish(due, payload)
        except Exception:
            if not due.tail:
                raise
            logger.exception("engine %s: capturing a tail of request %d failed", name,
                             req.rid)
            continue
        count(published)
    return time.perf_counter() - tic
