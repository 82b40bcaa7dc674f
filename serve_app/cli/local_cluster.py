"""Several Ray nodes on one machine, to try the cluster profile without several Macs.

Each node is a real raylet with its own object store and its own SSD directory
(``SERVE_APP_SSD_DIR`` in its environment), as ``ray.cluster_utils.Cluster`` runs
them for Ray's own multi-node tests. ``serve run --address ADDRESS
configs/qwen-cluster.yaml`` then places one replica on each.

The SSD directories default to a per-user directory (``~/.cache/serve_app/cluster``),
created 0700: under a shared ``/tmp`` another local user could plant block files.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from serve_app.cache.ssd_fs import make_dirs, untrusted_reason
from serve_app.config.paths import default_ssd_root
from serve_app.store.actor import SSD_DIR_ENV


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can change: created 0700 if missing; an
    existing one must pass the SSD tier's own check (``untrusted_reason``: this user's,
    not writable by group or others). Raises ``ValueError`` saying what is wrong."""
    make_dirs(path)
    reason = untrusted_reason(path)
    if reason is not None:
        raise ValueError(f"{path}: {reason}: other users could plant cache files in it; "
                         "choose another --ssd-root")
    return path


def run_local_cluster(nodes: int, ssd_root: str | None = None) -> int:
    """Start ``nodes`` Ray nodes here and keep them until Ctrl-C (or SIGTERM)."""
    from ray.cluster_utils import Cluster

    if nodes < 1:
        print("error: --nodes must be at least 1")
        return 2
    root = Path(ssd_root).expanduser() if ssd_root else default_ssd_root()
    try:
        private_dir(root)
        for i in range(1, nodes + 1):
            private_dir(root / f"node-{i}")
    except (ValueError, OSError) as exc:
        print(f"error: SSD root: {exc}")
        return 2
    cpus = max(1, (os.cpu_count() or 2) // nodes)

    def node_args(i: int) -> dict:
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
