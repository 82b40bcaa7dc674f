"""``python -m serve_app local-cluster``, as docs/cluster.md runs it: real nodes, own SSD dirs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bench.devserver import descendants
from serve_app.cli.local_cluster import private_dir
from tests.support import REPO
from tests.support.servers import wait_for


def test_local_cluster_runs_nodes_with_their_own_ssd_directories(tmp_path):
    # A short temp dir: Ray's socket paths must fit in 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="rlc", dir="/tmp")
    # The documented command as it is (docs/cluster.md): the SSD directories go to this user's cache
    # directory (XDG_CACHE_HOME here, ~/.cache by default), not to a shared /tmp.
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    root = tmp_path / "cache" / "serve_app" / "cluster"
    log = tmp_path / "cluster.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serve_app", "local-cluster", "--nodes",
                                 "2"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pids: set[int] = set()
    try:
        def serve_command() -> re.Match | None:
            """The command it prints once its nodes are up."""
            assert proc.poll() is None, log.read_text(errors="replace")
            return re.search(r"serve run --address (\S+) configs/qwen-cluster.yaml",
                             log.read_text(errors="replace"))

        found = wait_for(serve_command, lambda: "the nodes up; its log:\n"
                         + log.read_text(errors="replace"), 120, interval=0.5)
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
        assert sorted(dirs) == [str(root / "node-1"), str(root / "node-2")]
        for d in [root, *map(Path, dirs)]:  # only this user can list or plant files
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
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


def test_a_shared_or_foreign_ssd_root_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    out = subprocess.run([sys.executable, "-m", "serve_app", "local-cluster", "--ssd-root",
                          str(shared)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "other users could plant cache files" in out.stdout, out
    if os.getuid() == 0:  # root can hand a directory to another user
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
    else:
        foreign = Path("/")
    try:
        private_dir(foreign)
    except ValueError as exc:
        assert "not by this server's user" in str(exc)
    else:
        raise AssertionError("a directory of another user was accepted")
