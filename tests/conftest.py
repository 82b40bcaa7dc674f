from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.devserver import ServerProcess, free_port, write_config

DENSE = "tiny-dense"
HYBRID = "tiny-hybrid"
LIMITED = "tiny-dense-limited"

# The default profile's model, plus a dense one and a deliberately tiny-queue
# one for back-pressure tests. Sizes differ from configs/qwen.yaml, nothing else.
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


@pytest.fixture(scope="module")
def local_ray():
    """A one-node Ray of this process, for tests of the store actor without Serve."""
    import ray

    os.environ.setdefault("RAY_TMPDIR", "/tmp/rayB")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             object_store_memory=200 * 1024 * 1024,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def model_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("serve_app_home")
    os.environ["SERVE_APP_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("server")
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, TEST_MODELS,
                          cache_store={"ssd_dir": str(tmp / "kv")})
    env = {"SERVE_APP_HOME": str(model_home)}
    proc = ServerProcess.serve_run(config, port, tmp / "serve.log", env=env)
    try:
        proc.wait_ready([m["name"] for m in TEST_MODELS])
        yield proc
    finally:
        proc.stop()
