"""Fixtures of the integration layer: the shared ``serve run`` and a one-node Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.devserver import ServerProcess
from tests.support.servers import shared_server


@pytest.fixture(scope="module")
def local_ray():
    """A one-node Ray of this process, for tests of the store actor without Serve."""
    import ray

    os.environ.setdefault("RAY_TMPDIR", "/tmp/rayB")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             object_store_memory=200 * 1024 * 1024,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="package")  # stopped once this layer is done: no idle server after it
def server(tmp_path_factory, model_home) -> ServerProcess:
    """One ``serve run`` of :data:`TEST_MODELS` shared by the tests that only talk to it."""
    with shared_server(tmp_path_factory, model_home) as proc:
        yield proc
