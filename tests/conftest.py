from __future__ import annotations

import inspect
import os
import re
from functools import cache
from pathlib import Path

import pytest

from bench.devserver import ServerProcess, free_port, write_config
from tests.servers import running

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
    with running(ServerProcess.serve_run(config, port, tmp / "serve.log", env=env),
                 [m["name"] for m in TEST_MODELS]) as proc:
        yield proc


# ---- markers: what a test starts, read from its source and its fixtures' --------------

STARTS_SERVER = re.compile(r"ServerProcess|serve_run|ray\.init|local_ray|start_ours|open_page|"
                           r"start_mlx_lm_server|subprocess|Popen|cluster_utils")
STARTS_CLUSTER = re.compile(r"cluster_utils|\bCluster\(|LocalCluster|local_cluster")
REAL_MODEL = re.compile(r"smollm2")


@cache
def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def test_kinds(item: pytest.Item) -> set[str]:
    """``server``, ``cluster`` and ``slow`` as the test's function and the fixtures it uses
    say (a fixture that starts a server makes each of its users a server test); else
    ``unit``."""
    sources = [_source(getattr(item, "function", None))]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        sources += [_source(d.func) for d in defs]
    params = getattr(getattr(item, "callspec", None), "id", "")
    kinds = set()
    if any(STARTS_SERVER.search(s) for s in sources):
        kinds.add("server")
    if any(STARTS_CLUSTER.search(s) for s in sources):
        kinds |= {"server", "cluster"}
    if any(REAL_MODEL.search(s) for s in sources) or REAL_MODEL.search(params):
        kinds.add("slow")
    return kinds or {"unit"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for kind in sorted(test_kinds(item)):
            item.add_marker(kind)
