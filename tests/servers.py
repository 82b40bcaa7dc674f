"""The one way a test runs a server: ``running(ServerProcess(...), models)`` waits until
every model answers (or, ``generate=False``, shows in ``/v1/stats``), yields the server,
and stops everything it started, by process id, however the block ends."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from bench.devserver import ServerProcess


@contextmanager
def running(server: ServerProcess, models: Sequence[str] = (), *, timeout: float = 240.0,
            generate: bool = True) -> Iterator[ServerProcess]:
    with server:
        if models:
            server.wait_ready(list(models), timeout=timeout, generate=generate)
        yield server
