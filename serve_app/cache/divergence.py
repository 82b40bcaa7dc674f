"""Cache-bust diagnostics: prompts that leave a cached prompt early, then rejoin it.

A client that puts something changing (a timestamp, a counter, a session id) near
the start of every prompt gets nothing from a prefix cache: each request diverges
from the cached one within its first tokens, and the rest, identical, is prefilled
again. ``DivergenceTracker`` keeps the last prompts a replica served and, for each
new one, finds the recent prompt it shares the longest prefix with. When that
prefix ends in the first ``EARLY_FRACTION`` of a long cached prompt, and the two
prompts become equal again a few tokens later (they *resync*), the request is a
cache bust: returned to the manager (which counts it by position bucket and
keeps the recent ones for ``/v1/stats``), and logged once per position as a
WARNING that says where and how long, never what (no prompt text).

Requiring the resync keeps two unrelated conversations that share only a template
header, or a new session sharing only a system prompt, from being reported.

No MLX and no Ray: unit-tested in ``tests/unit/test_divergence.py``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

EARLY_FRACTION = 0.10  # diverging within this share of the cached prompt is early
RESYNC_WINDOW = 64  # tokens after the divergence, on either side, to look for a resync
RESYNC_RUN = 8  # equal tokens that count as a resync
MIN_MATCH_AFTER = 32  # and at least this many equal tokens from there on
MAX_PROMPTS = 32  # recent prompts kept
MAX_KEPT_TOKENS = 32768  # of each, the first this many tokens
WARN_AFTER = 2  # occurrences of one position before it is logged (once)
MAX_WARNED = 1024  # positions remembered as logged
# Position buckets of the counter (token positions; labels of the metric).
POSITION_EDGES = (64, 256, 1024, 4096)
POSITION_BUCKETS = ("0-63", "64-255", "256-1023", "1024-4095", "4096+")


def position_bucket(position: int) -> str:
    """The counter's label for a divergence at ``position``."""
    for edge, label in zip(POSITION_EDGES, POSITION_BUCKETS, strict=False):
        if position < edge:
            return label
    return POSITION_BUCKETS[-1]


@dataclass(frozen=True)
class CacheBust:
    """A prompt that diverged early from a cached one and rejoined it: lengths only."""

    position: int  # the first token that differs
    cached_prompt_tokens: int  # the length of the cached prompt it diverged from
    prompt_tokens: int
    differing_tokens: int  # in this prompt, before the two are equal again
    differing_cached_tokens: int  # the same stretch in the cached prompt
    matching_after: int  # equal tokens from where they rejoin (of the kept tokens)

    def describe(self) -> str:
        share = 100 * self.position / self.cached_prompt_tokens
        return (f"diverged at token {self.position} of a {self.cached_prompt_tokens}-token "
                f"cached prompt ({share:.1f}%): {self.differing_tokens} tokens differ "
                f"({self.differing_cached_tokens} in the cached prompt), then "
                f"{self.matching_after} tokens match it again")


@dataclass(eq=False)  # kept prompts are told apart by identity
class _Kept:
    root: str  # the salted chain root: prompts of other tenants are never compared
    tokens: np.ndarray  # the first MAX_KEPT_TOKENS tokens
    length: int  # the whole prompt's length


@dataclass
class DivergenceTracker:
    """Recent prompts of one replica, compared with each new one."""

    model: str
    min_tokens: int  # a cached prompt shorter than this is not "long": never reported
    _prompts: deque[_Kept] = field(default_factory=lambda: deque(maxlen=MAX_PROMPTS))
    _seen: dict[int, int] = field(default_factory=dict)  # position -> occurrences
    _warned: set[int] = field(default_factory=set)

    def observe(self, root: str, prompt: list[int]) -> CacheBust | None:
        """Compare ``prompt`` with the recent prompts of its root, then keep it."""
        tokens = np.asarray(prompt[:MAX_KEPT_TOKENS], dtype=np.int64)
        candidates = [(self._common(k.tokens, tokens), k) for k in self._prompts
                      if k.root == root]
        bust = self._bust(tokens, len(prompt), candidates)
        # A prompt that extends a kept one (the next turn) replaces it.
        for common, kept in candidates:
            if common == min(len(kept.tokens), len(tokens)) and kept.length <= len(prompt):
                self._prompts.remove(kept)
        self._prompts.append(_Kept(root, tokens, len(prompt)))
        if bust is not None:
            self._warn(bust)
        return bust

    def _bust(self, tokens: np.ndarray, length: int,
              candidates: list[tuple[int, _Kept]]) -> CacheBust | None:
        # The cached prompts this one leaves earliest relative to their length, longest
        # shared prefix first: a resync with any of them is a bust.
        for common, kept in sorted(candidates, key=lambda c: (-c[0], -c[1].length)):
            if kept.length < self.min_tokens or common >= EARLY_FRACTION * kept.length:
                continue
            if common >= min(len(kept.tokens), len(tokens)):
                continue  # one is a prefix of the other: no divergence
            found = _resync(kept.tokens, tokens, common)
            if found is None:
                continue
            in_cached, in_prompt = found
            after = self._common(kept.tokens[in_cached:], tokens[in_prompt:])
            if after < MIN_MATCH_AFTER:
                continue
            return CacheBust(common, kept.length, length, in_prompt - common,
                             in_cached - common, after)
        return None

    def _warn(self, bust: CacheBust) -> None:
        """One WARNING per position, once it has been seen ``WARN_AFTER`` times."""
        seen = self._seen[bust.position] = self._seen.get(bust.position, 0) + 1
        if seen >= WARN_AFTER and bust.position not in self._warned \
                and len(self._warned) < MAX_WARNED:
            self._warned.add(bust.position)
            logger.warning(
                "model %s: requests keep leaving a cached prompt early and rejoining it (a "
                "cache buster: something near the start of the prompt changes on every "
                "request, such as a timestamp, a counter or a session id); %s; seen %d times. "
                "Everything after that position is prefilled again on every request.",
                self.model, bust.describe(), seen)
        if len(self._seen) > MAX_WARNED:  # bounded: start counting afresh
            self._seen.clear()

    @staticmethod
    def _common(a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        return int(differ[0]) if len(differ) else n


def _resync(cached: np.ndarray, prompt: np.ndarray, at: int) -> tuple[int, int] | None:
    """Where the two become equal again after ``at``: the first positions (cached,
    prompt), each within ``RESYNC_WINDOW`` of ``at``, from which ``RESYNC_RUN``
    tokens are equal; None where they do not rejoin."""
    runs: dict[bytes, int] = {}
    end = min(len(cached) - RESYNC_RUN, at + RESYNC_WINDOW)
    for j in range(at, end + 1):
        runs.setdefault(cached[j:j + RESYNC_RUN].tobytes(), j)
    for i in range(at, min(len(prompt) - RESYNC_RUN, at + RESYNC_WINDOW) + 1):
        found = runs.get(prompt[i:i + RESYNC_RUN].tobytes())
        if found is not None:
            return found, i
    return None
