"""``python -m serve_app serve CONFIG``: Serve's own ``serve run`` on a Ray started without
its dashboard (issue 21: Ray's share of memory on one machine).

A real subprocess on loopback, driven over HTTP: it serves, its Prometheus metrics are
there, none of the dashboard's module processes ran, a bad profile is refused before Ray
starts, and an interrupt stops everything it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.devserver import ServerProcess, descendants, free_port, write_config
from tests.support.clients import chat, openai_client, user
from tests.support.servers import running, wait_for

MODEL = "tiny-dense"


def command_lines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # it ended meanwhile
            pass
    return out


@pytest.fixture(scope="module")
def lean(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("lean")
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, [{
        "name": MODEL, "source": f"embedded:{MODEL}", "context_length": 1024,
        "max_tokens": 32}], cache_store={"ssd_dir": str(tmp / "kv")})
    server = ServerProcess([sys.executable, "-m", "serve_app", "serve", str(config)], port,
                           tmp / "serve.log", env={"SERVE_APP_HOME": str(model_home)})
    with running(server, [MODEL]):
        yield server


def test_it_serves_with_metrics_and_without_the_dashboards_processes(lean):
    reply = chat(openai_client(lean, "x"), MODEL, user("Hi there"), 4)
    assert reply.usage.completion_tokens >= 1
    wait_for(lambda: "serve_app_requests" in httpx.get(f"{lean.base_url}/metrics").text,
             lambda: "serve_app_requests in /metrics:\n"
             + httpx.get(f"{lean.base_url}/metrics").text[:2000], 60, interval=1)
    lines = command_lines(descendants(lean.proc.pid))
    assert any("ServeReplica" in line for line in lines), lines  # the tree is ours
    assert any("dashboard.py" in line for line in lines)  # Ray's minimal head stays
    assert not [line for line in lines if "ray-dashboard-" in line or
                "multiprocessing.forkserver" in line or "ray::IDLE" in line], lines


def test_a_bad_profile_is_refused_before_ray_starts(tmp_path):
    port = free_port()
    config = write_config(tmp_path / "bad.yaml", port, [{
        "name": MODEL, "source": f"embedded:{MODEL}", "max_batch_size": 0}])
    ray_tmp = tmp_path / "ray_tmp"  # where a Ray started by the command writes its session
    ray_tmp.mkdir()
    done = subprocess.run([sys.executable, "-m", "serve_app", "serve", str(config)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    assert done.returncode == 2, done.stderr
    assert str(config) in done.stderr and "max_batch_size" in done.stderr
    assert not list(ray_tmp.rglob("session_*")), "a Ray was started"


def test_an_interrupt_stops_everything_it_started(tmp_path, model_home):
    port = free_port()
    config = write_config(tmp_path / "serve.yaml", port, [{
        "name": MODEL, "source": f"embedded:{MODEL}", "context_length": 1024,
        "max_tokens": 8, "cache": {"enabled": False}}])
    server = ServerProcess([sys.executable, "-m", "serve_app", "serve", str(config)], port,
                           tmp_path / "serve.log", env={"SERVE_APP_HOME": str(model_home)})
    with running(server, [MODEL]):
        pids = descendants(server.proc.pid)
        assert pids
        server.proc.send_signal(2)  # SIGINT: what Ctrl-C sends
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        wait_for(lambda: not any(_alive(p) for p in pids),
                 lambda: f"every process it started to end: {command_lines(pids)}", 30, 0.5)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing
    # (os.kill(pid, 0) would count zombies as alive)

