"""``serve-app``, the command a user types: ``serve MODEL`` without a YAML file, ``status``,
``--version``, and flags that are wrong refused before Ray starts (real processes,
loopback only, stopped by pid)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import serve_app
from bench.devserver import ServerProcess, free_port
from tests.support.clients import chat, openai_client, text, user
from tests.support.servers import running

SERVE_APP = str(Path(sys.executable).with_name("serve-app"))


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([SERVE_APP, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_version():
    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"serve_app {serve_app.__version__}"


@pytest.mark.parametrize("args, words", [
    (["smollm2-135m", "--context-length", "0"], "--context-length: "),
    (["smollm2-135m", "--max-batch-size", "0"], "--max-batch-size: "),
    (["smollm2-135m", "--port", "70000"], "--port: 70000 is not a TCP port"),
    (["/no/such/model-dir"], "MODEL: "),
    (["embedded:nope"], "known: embedded:smollm2-135m"),
])
def test_bad_flags_are_refused_before_ray_starts(args, words, tmp_path):
    import os

    ray_tmp = tmp_path / "ray_tmp"  # where a Ray started by the command writes its session
    ray_tmp.mkdir()
    done = run("serve", *args, env={**os.environ, "SERVE_APP_HOME": str(tmp_path),
                                    "RAY_TMPDIR": str(ray_tmp)})
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert "Started a local Ray" not in done.stderr + done.stdout
    assert not list(ray_tmp.rglob("session_*")), "a Ray was started"
    assert not list((tmp_path / "run").glob("*.yaml"))  # nothing left behind


def test_status_of_no_server_says_how_to_start_one():
    done = run("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 2 and "serve-app serve embedded:smollm2-135m" in done.stderr


@pytest.mark.slow  # serves the real embedded model, SmolLM2-135M
def test_serve_an_embedded_model_without_a_yaml_file(tmp_path, model_home):
    port = free_port()
    server = ServerProcess([SERVE_APP, "serve", "embedded:smollm2-135m", "--port", str(port),
                            "--ssd-dir", str(tmp_path / "kv"), "--max-batch-size", "4"],
                           port, tmp_path / "serve.log", env={"SERVE_APP_HOME": str(model_home)})
    with running(server, ["smollm2-135m"], timeout=300):
        client = openai_client(server)
        reply = chat(client, "smollm2-135m", user("What is the capital of France?"))
        assert "Paris" in text(reply)
        (entry,) = client.models.list().data
        assert entry.context_length == 8192  # the model's own, without --context-length
        written = (model_home / "run" / "smollm2-135m.yaml").read_text()
        assert "max_batch_size: 4" in written and str(tmp_path / "kv") in written
        done = run("status", "--url", server.base_url)
        assert done.returncode == 0, done.stderr
        assert "smollm2-135m: ready (context 8192)" in done.stdout
        assert "prefix cache:" in done.stdout and "memory plan:" in done.stdout
