"""``python -m serve_app serve CONFIG``: ``serve run CONFIG`` on a lean one-machine Ray.

``serve run`` starts Ray with everything on: the dashboard head with its nine module
processes and their fork server (~1 GB resident, measured by ``bench/serving.py``).
Ray lets only the process that starts a cluster choose that (``ray.init``'s
``include_dashboard``; no environment variable or Serve config field reaches it), so
this command starts Ray itself, without the dashboard and without a pool of idle
workers (every process of ours is an actor; ~80 MiB), then runs Serve's own
``serve run`` in the same process: the same config parsing, deployment, console and
Ctrl-C handling, and when it exits, the cluster it started goes with it.

What stays: Prometheus metrics (each node's dashboard agent exports them; ``/metrics``
reads them), replica logs on the console, the Grafana dashboards. What goes: Ray's
dashboard UI and its REST API (``ray list``, jobs, ``serve status``); ``--dashboard``
keeps them.
"""

from __future__ import annotations

import ray

from serve_app.models.compat import LEAN_RAY_SYSTEM_CONFIG, run_serve_cli

SERVE_NAMESPACE = "serve"  # where ``serve run`` puts Serve (ray.serve._private.constants)


def serve(config: str, dashboard: bool = False) -> int:
    """Start a local Ray (without its dashboard unless ``dashboard``), then ``serve run
    config`` on it until interrupted; the exit status of ``serve run``."""
    ray.init(namespace=SERVE_NAMESPACE, include_dashboard=dashboard,
             _system_config=LEAN_RAY_SYSTEM_CONFIG)
    try:
        return run_serve_cli([config])
    finally:
        ray.shutdown()
