"""The layers of the suite, set by where a test lives (never guessed from its text):

- ``tests/unit``: no Ray, no process, no server, no network; quick MLX on tiny models.
- ``tests/engine``: the engine and the cache in this process on the tiny (and, marked
  ``slow``, the real) embedded models, in every weight format: exactness, speculation,
  structured output, SSD files. No Ray, no process, no server either.
- ``tests/integration``: a real ``serve run`` or ``serve-app`` process, real clients, a
  one-node Ray, the command line.
- ``tests/cluster``: several Ray nodes on this machine.
- ``tests/browser``: a real headless Chromium against a real server.

Each test gets its layer's marker (``pytest -m unit`` is ``pytest tests/unit``) and a
timeout (pytest-timeout) sized to its layer, so a hang fails one test with its stack. The
guard of :mod:`tests.support.guard` fails a unit or engine test that starts a process or
reaches past loopback.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.guard import guarded

# Seconds a test may take, setup (a server's start) and teardown included.
TIMEOUTS = {"unit": 120, "engine": 300, "integration": 900, "cluster": 1200, "browser": 900}
GUARDED = {"unit", "engine"}


def layer_of(item: pytest.Item) -> str:
    """The layer folder a test lives in (``tests/<layer>/test_*.py``)."""
    parts = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parent).parts
    if len(parts) < 2 or parts[0] not in TIMEOUTS:
        raise pytest.UsageError(f"{item.nodeid}: every test lives in one of the layers "
                                f"{sorted(TIMEOUTS)} (tests/<layer>/test_*.py)")
    return parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        layer = layer_of(item)
        item.add_marker(layer)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUTS[layer]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if layer_of(item) not in GUARDED:
        return (yield)
    with guarded(item):
        return (yield)


@pytest.fixture(scope="session")
def model_home(tmp_path_factory) -> Path:
    """Where the embedded models are materialized for this run (one place, every layer)."""
    home = tmp_path_factory.mktemp("serve_app_home")
    os.environ["SERVE_APP_HOME"] = str(home)
    return home
