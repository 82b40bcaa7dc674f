"""Sampling on the engine thread (MLX): a sampler per request, and the log-probabilities a
step's tokens are reported with. ``serve_app.serving.sampling`` holds the settings
themselves, as plain data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, greedy_sampler, make_sampler

from serve_app.serving.sampling import SamplingParams


def make_request_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A sampler for one request.

    Greedy requests share mlx-lm's ``greedy_sampler`` object so the batch
    samples them in one call. A seeded request carries its own PRNG key, so
    its tokens do not depend on what else is in the batch.
    """
    if params.temperature == 0:
        return greedy_sampler
    if params.seed is None:
        return make_sampler(temp=params.temperature, top_p=params.top_p)
    key = mx.random.key(params.seed)
    inv_temp = 1.0 / params.temperature
    top_p = params.top_p

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sampler


def score_logprobs(responses: list, ks: list[int]
                   ) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Each response's token log-probability and its ``ks[i]`` top alternatives, in order
    (a speculative step returns several tokens of one request).

    One MLX graph for the whole step (rows stacked, top-k by argpartition, then only
    the k sorted) and one evaluation, so requests without logprobs cost nothing and
    many with logprobs cost one small op, not one per request.
    """
    if not responses:
        return []
    rows = mx.stack([r.logprobs for r in responses])  # (n, vocab), after processors
    tokens = mx.array([[r.token] for r in responses])
    chosen = mx.take_along_axis(rows, tokens, axis=-1)[:, 0].astype(mx.float32)
    k = min(max(ks), rows.shape[-1])
    if k:
        top = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(rows, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        top = mx.take_along_axis(top, order, axis=-1)
        values = mx.take_along_axis(values, order, axis=-1).astype(mx.float32)
        mx.eval(chosen, top, values)
        # (n, k) arrays: lists of lists (mlx types any tolist() as a scalar or list)
        ids = cast(list[list[int]], top.tolist())
        lps = cast(list[list[float]], values.tolist())
    else:
        mx.eval(chosen)
        ids, lps = [[] for _ in responses], [[] for _ in responses]
    chosen_lps = cast(list[float], chosen.tolist())
    return [(lp, tuple((t, v) for t, v in zip(i[:n], p[:n], strict=True) if v != -math.inf))
            for lp, n, i, p in zip(chosen_lps, ks, ids, lps, strict=True)]
