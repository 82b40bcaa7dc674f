"""The one way a test runs a server: ``running(ServerProcess(...), models)`` waits until
every model answers (or, ``generate=False``, shows in ``/v1/stats``), yields the server,
and stops everything it started, by process id, however the block ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.devserver import ServerProcess


@contextmanager
def running(server: ServerProcess, models: Sequence[str] = (), *, timeout: float = 240.0,
            generate: bool = True) -> Iterator[ServerProcess]:
    with server:
        if models:
            server.wait_ready(list(models), timeout=timeout, generate=generate)
        yield server


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0,
             interval: float = 0.25) -> Any:
    """``check()``'s first truthy answer, polled every ``interval``; AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
