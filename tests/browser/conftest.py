"""Fixtures of the browser layer: the shared test server, for the page without keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.devserver import ServerProcess
from tests.support.servers import shared_server


@pytest.fixture(scope="package")  # stopped once this layer is done: no idle server after it
def server(tmp_path_factory, model_home) -> Iterator[ServerProcess]:
    """One ``serve run`` of the shared test models (no API keys)."""
    with shared_server(tmp_path_factory, model_home) as proc:
        yield proc
