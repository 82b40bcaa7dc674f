"""Sampling on the engine thread (MLX): a sampler per request, and the log-probabilities a
step's tokens are reported with. ``serve_app.serving.sampling`` holds the settings
themselves, as plain data.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, greedy_sampler, make_sampler

from serve_app.serving.sampling import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def token_key(seed: int, index: int) -> mx.array:
    """The PRNG key of output token ``index`` of a request seeded ``seed``: a function of
    the two alone (a 64-bit BLAKE2b digest of both), so no step, batch or depth in
    between can shift which key a token is drawn with."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + index.to_bytes(8, "little"),
                             digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


@dataclass(eq=False)  # one per request: identity, never value equality
class SeededSampler:
    """A seeded request's sampler: one key stream per request, indexed by the position of
    the token drawn (``token_key``). Whichever step draws token ``i`` (mlx-lm's plain
    step calls it, a speculative verify step calls ``at``) draws it with the same key
    from the same distribution, so the output depends on the seed and the logits only:
    not on the batch-mates, nor on how deep speculation ran."""

    seed: int
    temperature: float
    top_p: float = 1.0
    index: int = 0  # the output position the next call draws

    def __call__(self, logprobs: mx.array) -> mx.array:
        token = self.at(logprobs, self.index)
        self.index += 1
        return token

    def at(self, logprobs: mx.array, index: int) -> mx.array:
        """Token ``index``'s draw from ``logprobs`` (``(1, vocab)``), leaving ``index``
        alone: top-p, then temperature, then a categorical draw with that token's key."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        return mx.random.categorical(logprobs * (1.0 / self.temperature),
                                     key=token_key(self.seed, index))


def make_request_sampler(params: SamplingParams) -> Sampler:
    """A sampler for one request.

    Greedy requests share mlx-lm's ``greedy_sampler`` object so the batch
    samples them in one call. A seeded request gets a ``SeededSampler`` of its own,
    so its tokens do not depend on what else is in the batch.
    """
    if params.temperature == 0:
        return greedy_sampler
    if params.seed is None:
        return make_sampler(temp=params.temperature, top_p=params.top_p)
    return SeededSampler(params.seed, params.temperature, params.top_p, params.first_index)


def draw(sampler: Sampler, logprobs: mx.array, ahead: int) -> mx.array:
    """What ``sampler`` draws from ``logprobs`` (one position, ``(1, vocab)``) as the token
    ``ahead`` positions after the next one it would draw, without moving it on: a seeded
    sampler with that token's own key (the token plain decoding draws there), any other
    as it draws (the process's generator: unseeded, nothing to match)."""
    if isinstance(sampler, SeededSampler):
        return sampler.at(logprobs, sampler.index + ahead)
    return sampler(logprobs)


def advance(sampler: Sampler, drawn: int) -> None:
    """Move ``sampler`` past ``drawn`` tokens drawn with ``draw`` (a verify step's)."""
    if isinstance(sampler, SeededSampler):
        sampler.index += drawn


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
