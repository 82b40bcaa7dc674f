"""One model over two Ray nodes: ``parallel: {tensor: 2}`` with ``placement: spread`` on a
real two-node cluster (``ray.cluster_utils.Cluster`` on this machine), ranks joined over
MLX's ``ring`` backend. Each rank runs on its own node and caches its share in its own
node's store; the model answers as unsharded and its second turn restores its prefix.
A model spread over more nodes than the cluster has is refused at deploy, naming the key.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from bench.devserver import ServerProcess, free_port, write_config
from tests.support.clients import cached, openai_client, text
from tests.support.servers import running, wait_for
from tests.support.sharded import ask, conversation

BS = 16
MODELS = [
    {"name": "spread", "source": "embedded:tiny-dense", "context_length": 1024,
     "max_batch_size": 4, "parallel": {"tensor": 2}, "cache": {"block_size": BS}},
    {"name": "dense", "source": "embedded:tiny-dense", "context_length": 1024,
     "cache": {"enabled": False}},
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray_cluster_serve")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def serve_run(cluster, config: Path, port: int, log: Path, model_home) -> ServerProcess:
    return ServerProcess.serve_run(config, port, log, env={"SERVE_APP_HOME": str(model_home)},
                                   address=cluster.address)


def test_ranks_on_two_nodes_answer_as_unsharded_and_restore(cluster, tmp_path, model_home):
    port = free_port()
    config = write_config(tmp_path / "serve.yaml", port, MODELS, cache_store={
        "ssd_dir": str(tmp_path / "kv" / "{node_id}")})
    with running(serve_run(cluster, config, port, tmp_path / "serve.log", model_home),
                 ["spread", "dense"], timeout=400) as proc:
        entry = httpx.get(f"{proc.base_url}/v1/models/spread", timeout=30).json()
        nodes = [r["node"] for r in entry["parallel"]["ranks"]]
        assert len(set(nodes)) == 2, entry  # one rank on each node
        client = openai_client(proc, "k")
        first = ask(client, "spread", conversation("spread"))
        assert text(first) == text(ask(client, "dense", conversation("spread")))
        turn = [*conversation("spread"), {"role": "assistant", "content": text(first)},
                {"role": "user", "content": "Once more."}]
        warm = ask(client, "spread", turn)
        assert cached(warm) >= 4 * BS, warm.usage
        assert text(warm) == text(ask(client, "spread", turn, salt=uuid.uuid4().hex))
    # each rank wrote its share of the blocks under its own node's SSD directory
    written = [d for d in (tmp_path / "kv").iterdir()
               if any(p.is_file() for p in d.rglob("*"))]
    assert len(written) == 2, list((tmp_path / "kv").iterdir())


def test_more_ranks_than_nodes_is_refused_at_deploy(cluster, tmp_path, model_home):
    """Four ranks spread over a cluster of two nodes: Serve reports the application's
    deployment failed with the reason (the builder's), not a placement group pending."""
    port = free_port()
    models = [{"name": "too-wide", "source": "embedded:tiny-dense",
               "parallel": {"tensor": 4}, "cache": {"enabled": False}}]
    config = write_config(tmp_path / "serve.yaml", port, models)
    log = tmp_path / "serve.log"

    def refused() -> str | None:
        out = log.read_text(errors="replace")
        return out if "needs 4 nodes" in out else None

    with serve_run(cluster, config, port, log, model_home):
        out = wait_for(refused, lambda: "the refusal; the log:\n"
                       + log.read_text(errors="replace")[-3000:], 240, interval=1)
    assert "models[0].parallel: model 'too-wide' needs 4 nodes" in out, out[-3000:]
    assert "the cluster has 2" in out
