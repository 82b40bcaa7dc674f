"""What a model did in the last minute: requests finished, tokens, decode speed and time to
first token, for the status page and ``/v1/stats``' ``recent``.

Prometheus answers "over the last minute" with ``rate()`` over its histograms; a person
without Prometheus asks the server. Each replica keeps what happened in the window
(``RecentWindow``, deques pruned as they grow and on read): tokens when they are made (a
long stream shows in the output rate while it runs, not only once it ends), each time to
first token when the first token comes, and the requests that ended (their count and their
per-stream decode speed). It reports the sums (``RecentActivity``), which add up across
replicas like every other stat: a model's tokens per second is the sum of its replicas',
its mean time to first token the weighted mean.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve_app.cache.merge import merged

WINDOW_S = 60.0


@dataclass(frozen=True)
class FinishedRequest:
    """One request that ended: when, its tokens, and the seconds from its first token to
    its last."""

    at: float
    tokens: int
    decode_s: float


@dataclass
class RecentActivity:
    """Sums over the requests that ended in the last ``window_s`` (one replica's, or a
    model's over its replicas)."""

    window_s: float = merged("answering", default=WINDOW_S)
    requests: int = merged("sum", default=0)  # ended in the window
    output_tokens: int = merged("sum", default=0)  # made in the window
    ttft_requests: int = merged("sum", default=0)  # first tokens made in the window
    ttft_seconds: float = merged("sum", default=0.0)
    ttft_max_s: float = merged("max", default=0.0)
    # Of the requests that ended in the window: their tokens after each one's first, and
    # its seconds from first to last.
    decode_tokens: int = merged("sum", default=0)
    decode_seconds: float = merged("sum", default=0.0)

    def summary(self) -> dict[str, Any]:
        """``/v1/stats``' ``recent``: the sums and what they mean per second and per
        request (None where no request measured it)."""
        out: dict[str, Any] = {
            "window_s": self.window_s, "requests": self.requests,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens / self.window_s, 3),
            "ttft_mean_s": (round(self.ttft_seconds / self.ttft_requests, 4)
                            if self.ttft_requests else None),
            "ttft_max_s": round(self.ttft_max_s, 4) if self.ttft_requests else None,
            # per stream: how fast one request's tokens came once it had its first
            "decode_tokens_per_s": (round(self.decode_tokens / self.decode_seconds, 2)
                                    if self.decode_seconds > 0 else None),
        }
        return out


class RecentWindow:
    """Tokens made, first tokens and requests ended in the last ``window_s``;
    thread-safe (the event loop adds, the metrics pump's thread reads)."""

    def __init__(self, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._tokens: deque[float] = deque()  # when each token was made
        self._first: deque[tuple[float, float]] = deque()  # (when, time to first token)
        self._done: deque[FinishedRequest] = deque()
        self._lock = threading.Lock()

    def token(self, ttft_s: float | None = None) -> None:
        """A token made now; ``ttft_s`` with a request's first (its time to it)."""
        with self._lock:
            now = self.clock()
            self._tokens.append(now)
            if ttft_s is not None:
                self._first.append((now, ttft_s))
            self._prune(now)

    def finished(self, tokens: int, decode_s: float) -> None:
        """A request ended now, with its tokens and seconds from its first to its last."""
        with self._lock:
            now = self.clock()
            self._done.append(FinishedRequest(now, tokens, decode_s))
            self._prune(now)

    def activity(self) -> RecentActivity:
        with self._lock:
            self._prune(self.clock())
            out = RecentActivity(window_s=self.window_s, requests=len(self._done),
                                 output_tokens=len(self._tokens),
                                 ttft_requests=len(self._first))
            for _, ttft in self._first:
                out.ttft_seconds += ttft
                out.ttft_max_s = max(out.ttft_max_s, ttft)
            for r in self._done:
                if r.tokens > 1 and r.decode_s > 0:
                    out.decode_tokens += r.tokens - 1
                    out.decode_seconds += r.decode_s
        return out

    def _prune(self, now: float) -> None:  # the lock held
        horizon = now - self.window_s
        while self._tokens and self._tokens[0] < horizon:
            self._tokens.popleft()
        while self._first and self._first[0][0] < horizon:
            self._first.popleft()
        while self._done and self._done[0].at < horizon:
            self._done.popleft()
