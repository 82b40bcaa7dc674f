"""The one way a test runs a server: ``running(ServerProcess(...), models)`` waits until
every model answers (or, ``generate=False``, shows in ``/v1/stats``), yields the server,
and stops everything it started, by process id, however the block ends; ``serving`` is
``running`` of a ``serve run`` of a profile written for it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bench.devserver import ServerProcess, free_port, write_config

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


@contextmanager
def serving(tmp: Path, models: list[dict], model_home: Path, *, env: dict | None = None,
            api_key: str | None = None, timeout: float = 240.0, generate: bool = True,
            **args: Any) -> Iterator[ServerProcess]:
    """``serve run`` of ``models`` (the profile's other sections in ``args``) on a free
    port, its config and log in ``tmp``, the embedded models from ``model_home``: yielded
    once every model answers, stopped after. The one way the tests spell it."""
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, models, **args)
    server = ServerProcess.serve_run(config, port, tmp / "serve.log",
                                     env={"SERVE_APP_HOME": str(model_home), **(env or {})},
                                     api_key=api_key)
    with running(server, [m["name"] for m in models], timeout=timeout,
                 generate=generate) as proc:
        yield proc


@contextmanager
def shared_server(tmp_path_factory: pytest.TempPathFactory,
                  model_home: Path) -> Iterator[ServerProcess]:
    """One ``serve run`` of :data:`TEST_MODELS`: the ``server`` fixture of each layer that
    has one (tests/integration, tests/browser), scoped to its package so that no layer's
    server idles on through the next layer's tests."""
    tmp = tmp_path_factory.mktemp("server")
    with serving(tmp, TEST_MODELS, model_home, cache_store={"ssd_dir": str(tmp / "kv")}) as proc:
        yield proc


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
