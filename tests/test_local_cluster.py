"""``python -m serve_app local-cluster``, as the README runs it: real nodes, own SSD dirs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bench.devserver import descendants

REPO = Path(__file__).resolve().parents[1]


def test_local_cluster_runs_nodes_with_their_own_ssd_directories(tmp_path):
    # A short temp dir: Ray's socket paths must fit in 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="rlc", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    log = tmp_path / "cluster.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serve_app", "local-cluster", "--nodes",
                                 "2", "--ssd-root", str(tmp_path / "kv")], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"serve run --address (\S+) configs/qwen-cluster.yaml",
                                      log.read_text(errors="replace"))):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.5)
        pids.update(descendants(proc.pid))
        ray.init(address=found.group(1), logging_level="ERROR")
        try:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            assert len(nodes) == 2

            @ray.remote(num_cpus=0)
            def ssd_dir() -> str:
                return os.environ.get("SERVE_APP_SSD_DIR", "")

            dirs = ray.get([ssd_dir.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote() for node in nodes], timeout=120)
        finally:
            ray.shutdown()
        assert sorted(dirs) == [str(tmp_path / "kv" / "node-1"), str(tmp_path / "kv" / "node-2")]
        assert all(Path(d).is_dir() for d in dirs)
        pids.update(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)  # stops the nodes it started
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:  # anything left of its nodes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
