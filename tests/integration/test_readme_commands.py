"""The README's commands, run as a newcomer runs them: clone, the one run command, the wait
for ready, curl, the ``openai`` snippet, ``serve-app status`` and the model-name line.

The clone is of this checkout (no network host to clone from here); the run command runs
word for word in it, with a fresh ``.venv`` (pip installs from the package registry, its
wheel cache warm from the test command's own install). What cannot run here: the Mac model
(a hub download) and the coding agents themselves; their commands are checked for the
names they must agree on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.devserver import descendants
from tests.support import REPO

README = (REPO / "README.md").read_text()


def blocks(lang: str, section: str) -> list[str]:
    start = README.index(section)
    end = README.find("\n## ", start + 1)
    return re.findall(rf"```{lang}\n(.*?)\n```", README[start:end if end > 0 else None], re.S)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_home):
    """The README's clone and run command, serving on 127.0.0.1:8000 as it says."""
    if not port_free(8000):
        pytest.fail("port 8000 is taken: the README's command serves there")
    tmp = tmp_path_factory.mktemp("readme")
    clone_cmd, run_cmd = blocks("bash", "## Run it")[:2]
    assert clone_cmd.startswith("git clone <this repository's URL> serve_app")
    subprocess.run(clone_cmd.replace("<this repository's URL>", str(REPO)), shell=True,
                   cwd=tmp, check=True, capture_output=True, timeout=120)
    clone = tmp / "serve_app"
    if (REPO / ".git").exists():  # the working tree as it is, uncommitted changes too
        shutil.copytree(REPO, clone, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", ".git", "site", "*.egg-info",
                                                      "__pycache__", ".*_cache"))
    log = open(tmp / "run.log", "wb")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if ".venv" not in p)
    env["SERVE_APP_HOME"] = str(model_home)  # the model already materialized by the suite
    proc = subprocess.Popen(["bash", "-c", run_cmd], cwd=clone, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pids: set[int] = set()
    try:
        yield clone, proc, tmp / "run.log", pids
    finally:
        pids.update(descendants(proc.pid))
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for pid in [proc.pid, *pids, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def sh(command: str, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


@pytest.mark.slow  # the README's commands serve the real embedded model, SmolLM2-135M
def test_the_readme_commands_serve_real_answers(served):
    clone, proc, log, pids = served
    wait, ask = blocks("bash", "## Talk to it")[:2]
    try:  # installs, downloads nothing (the model home is warm), starts, warms up
        health = sh(wait.replace("--retry 60", "--retry 400"), clone, timeout=1200)
    except AssertionError:
        raise AssertionError(log.read_text(errors="replace")[-4000:]) from None
    pids.update(descendants(proc.pid))
    assert json.loads(health) == json.loads(wait.split("# ", 1)[1])  # as the README shows

    answer = json.loads(sh(ask, clone))
    shown = json.loads(re.findall(r"```json\n(.*?)\n```", README, re.S)[0]
                       .replace('"chatcmpl-..."', '"x"'))
    assert answer["choices"][0]["message"] == shown["choices"][0]["message"]
    # cached_tokens is 0 on a fresh home; this one's SSD tier has seen the prompt before.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [answer["usage"][k] for k in counts] == [shown["usage"][k] for k in counts]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] in range(
        answer["usage"]["prompt_tokens"])

    (snippet,) = blocks("python", "## Talk to it")
    assert "`pip install openai`" in README
    sh(". .venv/bin/activate && pip install -q openai", clone)
    python = clone / ".venv" / "bin" / "python"
    out = subprocess.run([str(python), "-c", snippet], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == snippet.rsplit("# ", 1)[1].strip()  # the comment's answer

    agents = blocks("bash", "### Coding agents")[0].splitlines()
    model_line = next(line for line in agents if line.startswith("MODEL="))
    assert sh(f"{model_line} && echo $MODEL", clone).strip() == "smollm2-135m"
    status_line = next(line for line in agents if line.startswith("serve-app status"))
    status = sh(f". .venv/bin/activate && {status_line}", clone)
    assert "smollm2-135m: ready" in status


def test_the_agents_configs_name_the_model_serve_app_serve_gives_it():
    from serve_app.cli.quickstart import model_name, source_of

    serve_line = blocks("bash", "### Coding agents")[0].splitlines()[0]
    repo = serve_line.split()[2]
    name = model_name(source_of(repo))
    toml = blocks("toml", "### Coding agents")[0]
    assert f'model = "{name}"' in toml
    assert f'"{name}"' in blocks("json", "### Coding agents")[0]
    assert sys.executable  # (the agents themselves are not run here)
