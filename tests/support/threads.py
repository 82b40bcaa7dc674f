"""Threads whose failures reach the test: an exception in one (an assert included) is
raised again in the test's own thread, and a thread still running at the deadline fails
the test instead of hanging it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Threads:
    """Start targets with ``start``; ``join(timeout)`` waits for them all, then raises the
    first exception any of them raised, or an AssertionError for one still running."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.on_error: list[Callable[[], None]] = []

    def start(self, target: Callable[..., Any], *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:
                self.errors.append(exc)
                for wake in self.on_error:  # e.g. break a barrier the others wait at
                    wake()

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        running = sum(t.is_alive() for t in self.threads)
        assert not running, f"{running} thread(s) still running after {timeout:.0f} s"
