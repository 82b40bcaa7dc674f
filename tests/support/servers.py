"""The one way a test runs a server: ``running(ServerProcess(...), models)`` waits until
every model answers (or, ``generate=False``, shows in ``/v1/stats``), yields the server,
and stops everything it started, by process id, however the block ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.devserver import ServerProcess

DENSE = "tiny-dense"
HYBRID = "tiny-hybrid"
LIMITED = "tiny-dense-limited"

# The shared server's models (the ``server`` fixture of tests/integration): the default
# profile's model, a dense one and a deliberately tiny-queue one for back-pressure tests.
# Sizes differ from configs/qwen.yaml, nothing else.
TEST_MODELS = [
    {"name": HYBRID, "source": "embedded:tiny-hybrid", "context_length": 4096,
     "max_batch_size": 8, "max_queued_requests": 16, "max_tokens": 256,
     "cache": {"block_size": 16}},
    {"name": DENSE, "source": "embedded:tiny-dense", "context_length": 1024,
     "max_batch_size": 8, "max_queued_requests": 16, "max_tokens": 256,
     "cache": {"block_size": 16, "isolate_by_api_key": True}},
    {"name": LIMITED, "source": "embedded:tiny-dense", "context_length": 4096,
     "max_batch_size": 1, "max_queued_requests": 1, "max_tokens": 4000,
     "cache": {"enabled": False}},
]


@contextmanager
def running(server: ServerProcess, models: Sequence[str] = (), *, timeout: float = 240.0,
            generate: bool = True) -> Iterator[ServerProcess]:
    with server:
        if models:
            server.wait_ready(list(models), timeout=timeout, generate=generate)
        yield server


def wait_for(check: Callable[[], Any], what: str | Callable[[], str], timeout: float = 30.0,
             interval: float = 0.25) -> Any:
    """``check()``'s first truthy answer, polled every ``interval``; AssertionError naming
    ``what`` after ``timeout`` seconds (a callable ``what`` is asked then, so the message
    can say what was seen last)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {said}")
        time.sleep(interval)
