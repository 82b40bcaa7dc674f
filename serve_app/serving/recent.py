"""What a model did in the last minute: requests finished, tokens, decode speed and time to
first token, for the status page and ``/v1/stats``' ``recent``.

Prometheus answers "over the last minute" with ``rate()`` over its histograms; a person
without Prometheus asks the server. Each replica keeps the requests that ended in the
window (``RecentWindow``, a deque pruned on read) and reports their sums
(``RecentActivity``), which add up across replicas like every other stat: a model's tokens
per second is the sum of its replicas', its mean time to first token the weighted mean.
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
    """One request that ended: when, its time to first token (None: it made no token),
    its tokens, and the seconds from its first token to its last."""

    at: float
    ttft_s: float | None
    tokens: int
    decode_s: float


@dataclass
class RecentActivity:
    """Sums over the requests that ended in the last ``window_s`` (one replica's, or a
    model's over its replicas)."""

    window_s: float = merged("answering", default=WINDOW_S)
    requests: int = merged("sum", default=0)
    output_tokens: int = merged("sum", default=0)
    ttft_requests: int = merged("sum", default=0)  # the requests that made a first token
    ttft_seconds: float = merged("sum", default=0.0)
    ttft_max_s: float = merged("max", default=0.0)
    decode_tokens: int = merged("sum", default=0)  # tokens after each request's first
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
    """The requests that ended in the last ``window_s``; thread-safe (the event loop
    adds, the metrics pump's thread reads)."""

    def __init__(self, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._done: deque[FinishedRequest] = deque()
        self._lock = threading.Lock()

    def add(self, ttft_s: float | None, tokens: int, decode_s: float) -> None:
        with self._lock:
            self._done.append(FinishedRequest(self.clock(), ttft_s, tokens, decode_s))
            self._prune()

    def activity(self) -> RecentActivity:
        with self._lock:
            self._prune()
            done = list(self._done)
        out = RecentActivity(window_s=self.window_s, requests=len(done))
        for r in done:
            out.output_tokens += r.tokens
            if r.ttft_s is not None:
                out.ttft_requests += 1
                out.ttft_seconds += r.ttft_s
                out.ttft_max_s = max(out.ttft_max_s, r.ttft_s)
            if r.tokens > 1 and r.decode_s > 0:
                out.decode_tokens += r.tokens - 1
                out.decode_seconds += r.decode_s
        return out

    def _prune(self) -> None:
        horizon = self.clock() - self.window_s
        while self._done and self._done[0].at < horizon:
            self._done.popleft()
