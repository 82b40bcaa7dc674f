"""Run a server as a real subprocess on loopback and stop all it started, by pid.

Used by the tests and the benchmarks: they drive the real ``serve run`` (and
``mlx_lm.server`` as a baseline) and must leave no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, found through /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def write_config(path: Path, port: int, models: list[dict], **args) -> Path:
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/",
                "import_path": "serve_app.app:build_app",
                "args": {"models": models, "ingress": {"num_cpus": 0}, **args},
            }
        ],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _default_sigint() -> None:
    """In the child, before exec: SIGINT's default action, whatever the parent had. A
    command a shell started in the background (``cmd &``, no job control) ignores SIGINT,
    and so would every server it starts: ``stop()``'s SIGINT would do nothing (Python
    installs its KeyboardInterrupt handler only over the default action)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    """A server subprocess on loopback (its own session), with its log file."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict | None = None,
                 api_key: str | None = None) -> None:
        self.port = port
        # Sent by the readiness probes, for a server started with API keys.
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self._log = open(log, "wb")
        full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
        self._pids: set[int] = set()
        self._stopped = False

    @classmethod
    def serve_run(cls, config: Path, port: int, log: Path, env: dict | None = None,
                  api_key: str | None = None, address: str | None = None):
        """``serve run CONFIG``: our app, exactly as a user starts it (``address``: on that
        running Ray cluster, ``serve run --address ADDRESS CONFIG``)."""
        serve_bin = str(Path(sys.executable).with_name("serve"))
        where = ["--address", address] if address else []
        return cls([serve_bin, "run", *where, str(config)], port, log, env, api_key)

    def headers(self) -> dict[str, str]:
        """The Authorization header of ``api_key`` (none without one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, models: list[str], timeout: float = 240.0,
                   generate: bool = True) -> None:
        """Wait until every model answers a one-token completion.

        ``generate=False`` waits for every model's replica through ``/v1/stats``
        instead, so that no request shows in the server's counters.
        """
        deadline = time.monotonic() + timeout
        pending = list(models)
        while pending:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited early; log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready; log:\n{self.log_tail()}")
            self._pids.update(descendants(self.proc.pid))
            try:
                if generate and self._completes(pending[0]):
                    pending.pop(0)
                    continue
                if not generate:
                    pending = [m for m in pending if m not in self._stats_models()]
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if pending:
                time.sleep(1.0)
        self._pids.update(descendants(self.proc.pid))

    def _completes(self, model: str) -> bool:
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{self.base_url}/v1/completions", data=body,
            headers={"Content-Type": "application/json", **self.headers()},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status == 200

    def _stats_models(self) -> set[str]:
        request = urllib.request.Request(f"{self.base_url}/v1/stats", headers=self.headers())
        with urllib.request.urlopen(request, timeout=60) as r:
            return set(json.loads(r.read())["models"]) if r.status == 200 else set()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL the server and everything below it at once, as a crash would."""
        self._pids.update(descendants(self.proc.pid))
        for pid in [self.proc.pid, *self._pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._log.close()
        self._stopped = True  # its pids are free for the system to give out again

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGINT (serve shuts down cleanly), then SIGKILL whatever is left, by pid. Once:
        a second stop (a test stopped it, then its fixture) would kill pids the system may
        have given to other processes meanwhile."""
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            self._pids.update(descendants(self.proc.pid))
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in self._pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
