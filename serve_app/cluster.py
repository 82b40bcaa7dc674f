"""Several Ray nodes on one machine, to try the cluster profile without several Macs.

Each node is a real raylet with its own object store and its own SSD directory
(``SERVE_APP_SSD_DIR`` in its environment), as ``ray.cluster_utils.Cluster`` runs
them for Ray's own multi-node tests. ``serve run --address ADDRESS
configs/qwen-cluster.yaml`` then places one replica on each.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from serve_app.cache.actor import SSD_DIR_ENV


def run_local_cluster(nodes: int, ssd_root: str) -> int:
    """Start ``nodes`` Ray nodes here and keep them until Ctrl-C (or SIGTERM)."""
    from ray.cluster_utils import Cluster

    if nodes < 1:
        print("error: --nodes must be at least 1")
        return 2
    root = Path(ssd_root).expanduser()
    cpus = max(1, (os.cpu_count() or 2) // nodes)

    def node_args(i: int) -> dict:
        (root / f"node-{i}").mkdir(parents=True, exist_ok=True)
        return {"num_cpus": cpus, "env_vars": {SSD_DIR_ENV: str(root / f"node-{i}")}}

    cluster = Cluster(initialize_head=True,
                      head_node_args={**node_args(1), "include_dashboard": False})
    try:
        for i in range(2, nodes + 1):
            cluster.add_node(**node_args(i))
        print(f"{nodes} Ray nodes are running; SSD directories under {root}.\n"
              f"In another shell:\n"
              f"  serve run --address {cluster.address} configs/qwen-cluster.yaml\n"
              f"Ctrl-C here stops the nodes.", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    finally:
        cluster.shutdown()
    return 0
