"""API keys: `serve run` started with SERVE_APP_API_KEYS and a key file, through the real
clients and raw HTTP; the key file's checks at `python -m serve_app check`; the
middleware's order (no body is read before the key is checked)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from bench.devserver import ServerProcess, free_port, write_config
from serve_app.config import api_keys
from tests.support import REPO
from tests.support.auth_keys import BS, DENSE, HYBRID, KEY_A, KEY_B, KEY_FILE_KEY, MODELS, WRONG
from tests.support.clients import anthropic_client, openai_client
from tests.support.servers import serving, wait_for

MAX_BYTES = 1 << 20


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("auth")
    key_file = tmp / "keys"
    key_file.write_text(f"# serve_app keys\n\n{KEY_FILE_KEY}\n")
    key_file.chmod(0o600)
    env = {api_keys.ENV_VAR: f"{KEY_A}, {KEY_B}", "RAY_metrics_report_interval_ms": "500"}
    with serving(tmp, MODELS, model_home, env=env, api_key=KEY_A,
                 cache_store={"ssd_dir": str(tmp / "kv")},
                 ingress={"num_cpus": 0, "api_keys_file": str(key_file),
                          "max_request_bytes": MAX_BYTES}) as proc:
        yield proc


def raw(server: ServerProcess, method: str, path: str, key: str | None = None,
        header: str = "authorization", **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers[header] = f"Bearer {key}" if header == "authorization" else key
    return httpx.request(method, f"{server.base_url}{path}", headers=headers, timeout=120,
                         **kw)


CHAT = {"model": DENSE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{DENSE}", None),
    ("GET", "/v1/stats", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": DENSE, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/responses", {"model": DENSE, "input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/messages", {**CHAT, "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", {"model": DENSE, "messages": CHAT["messages"]}),
    ("GET", "/v1/no-such-route", None),
]


def assert_401(r: httpx.Response, path: str, present: bool) -> None:
    assert r.status_code == 401, (path, r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    body = r.json()
    message = "invalid API key" if present else "no API key"
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        assert body["error"]["type"] == "authentication_error"
        assert body["error"]["message"].startswith(message)
    else:
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(message)
    assert WRONG not in r.text


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[p for _, p, _ in ROUTES])
def test_every_route_but_health_needs_a_key(keyed, method, path, body):
    kw = {"json": body} if body is not None else {}
    assert_401(raw(keyed, method, path, **kw), path, present=False)
    assert_401(raw(keyed, method, path, key=WRONG, **kw), path, present=True)
    assert_401(raw(keyed, method, path, key=WRONG, header="x-api-key", **kw), path, True)
    # Another scheme than Bearer is no key.
    assert_401(raw(keyed, method, path, headers={"authorization": f"Basic {KEY_A}"}, **kw),
               path, present=False)
    ok = raw(keyed, method, path, key=KEY_A, **kw)
    assert ok.status_code == (404 if "no-such" in path else 200), (path, ok.text)


def test_health_stays_open(keyed):
    r = raw(keyed, "GET", "/health")
    assert r.status_code == 200 and r.json() == {
        "status": "ok",
        "models": {"auth-dense": {"phase": "ready"}, "auth-hybrid": {"phase": "ready"}}}


def test_both_header_forms_and_every_configured_key_work(keyed):
    for key in (KEY_A, KEY_B, KEY_FILE_KEY):
        for header in ("authorization", "x-api-key"):
            r = raw(keyed, "POST", "/v1/chat/completions", key=key, header=header, json=CHAT)
            assert r.status_code == 200, (header, r.text)
    # x-api-key alone (as Anthropic's SDK sends it) on a GET route too.
    r = raw(keyed, "GET", "/v1/models", headers={"x-api-key": KEY_B})
    assert r.status_code == 200


def test_openai_client_gets_authentication_errors(keyed):
    bad = openai_client(keyed, WRONG)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=DENSE, messages=CHAT["messages"], max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=DENSE, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=DENSE, input="hi", max_output_tokens=2)
    good = openai_client(keyed, KEY_FILE_KEY)
    out = good.chat.completions.create(model=DENSE, messages=CHAT["messages"], max_tokens=2)
    assert out.choices[0].message.content is not None
    assert good.responses.create(model=DENSE, input="hi", max_output_tokens=2).status


def test_anthropic_client_gets_authentication_errors(keyed):
    bad = anthropic_client(keyed, WRONG)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=DENSE, max_tokens=2, messages=CHAT["messages"])
    assert info.value.status_code == 401
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model=DENSE, messages=CHAT["messages"])
    with pytest.raises(anthropic.AuthenticationError):
        with bad.messages.stream(model=DENSE, max_tokens=2, messages=CHAT["messages"]) as s:
            s.get_final_message()
    good = anthropic_client(keyed, KEY_B)
    message = good.messages.create(model=DENSE, max_tokens=2, messages=CHAT["messages"])
    assert message.type == "message"
    assert good.messages.count_tokens(model=DENSE, messages=CHAT["messages"]).input_tokens > 0


def _send_unread(port: int, head: bytes, body_bytes: int) -> bytes:
    """Send a request head, then up to ``body_bytes`` of a longer body while reading the
    answer: the answer's head, or b"" if none came in 60 s (a server reading the body before
    the key waits for the rest of it, which never comes)."""
    sent = 0
    give_up = time.monotonic() + 60
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        s.setblocking(False)
        chunk = b"x" * 65536
        answer = b""
        while time.monotonic() < give_up:
            try:
                answer += s.recv(65536)
            except BlockingIOError:
                pass
            if b"\r\n\r\n" in answer:
                break
            if sent < body_bytes:
                try:
                    sent += s.send(chunk[: body_bytes - sent])
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    time.sleep(0.01)
            else:
                time.sleep(0.01)
    return answer


def test_an_unauthenticated_large_body_is_401_at_once_not_413(keyed):
    size = 16 << 20  # over ingress.max_request_bytes (1 MiB): a 413, were it looked at
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode()
    # 1 MiB of the 16 announced, then nothing: a server that read the body would wait.
    answer = _send_unread(keyed.port, head, 1 << 20)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"invalid_api_key" in answer
    # Chunked, no length to look at, and a body that never ends: 401 all the same.
    head = (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"10000\r\n")
    answer = _send_unread(keyed.port, head, 0x10000)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"authentication_error" in answer
    # With the key, the same oversized body is refused for its size.
    r = raw(keyed, "POST", "/v1/chat/completions", key=KEY_A,
            content=b"x" * (MAX_BYTES + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413


def ask(server: ServerProcess, key: str, model: str, prompt: str) -> int:
    """The cached prompt tokens of a completion of ``prompt`` (no chat template: its
    shared first tokens would be each key's own earlier chats)."""
    client = openai_client(server, key)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("model", [DENSE, HYBRID])
def test_another_keys_prefix_is_never_reused(keyed, model):
    # Several blocks long; unique per model, and unlike any earlier prompt from its start.
    prompt = f"Quarterly {model} numbers for the northern region: " + " ".join(
        f"item{i}" for i in range(120))
    assert ask(keyed, KEY_A, model, prompt) == 0
    again = ask(keyed, KEY_A, model, prompt)
    assert again >= 4 * BS  # the same key reuses its own prefix
    # Other keys: none of A's blocks.
    assert ask(keyed, KEY_B, model, prompt) == 0
    assert ask(keyed, KEY_FILE_KEY, model, prompt) == 0
    # B's second request hits B's own blocks; A still hits A's.
    assert ask(keyed, KEY_B, model, prompt) >= 4 * BS
    assert ask(keyed, KEY_A, model, prompt) >= again
    # The attack: A's prompt (cached under A) plus one guessed token, sent by another key,
    # tells it nothing: 0 cached, whether the guess is right or wrong.
    secret = f"Private {model} notes of user A: the launch code is 4711 " + " ".join(
        f"w{i}" for i in range(80))
    assert ask(keyed, KEY_A, model, secret) == 0
    assert ask(keyed, KEY_A, model, secret) >= 4 * BS
    assert ask(keyed, KEY_B, model, secret + " w80") == 0
    assert ask(keyed, KEY_FILE_KEY, model, secret[: len(secret) // 2] + " zz") == 0


def test_keys_are_never_logged_and_the_start_says_keys_are_on(keyed):
    raw(keyed, "GET", "/v1/stats", key=WRONG)
    stats = raw(keyed, "GET", "/v1/stats", key=KEY_A).text
    metrics = raw(keyed, "GET", "/metrics", key=KEY_A).text
    log = keyed.log_path.read_text(errors="replace")
    assert "API keys required on every route but /health (3 key(s))" in log
    assert "WITHOUT authentication" not in log
    for secret in (KEY_A, KEY_B, KEY_FILE_KEY, WRONG):
        assert secret not in log and secret not in stats and secret not in metrics
        assert secret[8:] not in log  # nor a part of one
        assert api_keys.digest(secret) not in stats


def _uncommented_authorization(config_text: str) -> dict:
    """The commented `authorization:` block of dashboards/prometheus.yml, as YAML."""
    lines = config_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# authorization:")
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not re.match(r"\s*#\s{2,}\S", line):
            break
        block.append(line)
    indent = len(lines[start]) - len(lines[start].lstrip())
    text = "\n".join(line[indent:].replace("# ", "", 1) for line in block)
    return yaml.safe_load(text)["authorization"]


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(not PROMETHEUS, reason="Prometheus is not installed (Debian: apt-get "
                    "install prometheus; the README's test command installs it where it can)")
def test_prometheus_scrapes_metrics_with_the_documented_authorization(keyed, tmp_path):
    config = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
    authorization = _uncommented_authorization(
        (REPO / "dashboards" / "prometheus.yml").read_text())
    assert authorization["type"] == "Bearer" and "credentials_file" in authorization
    secret = tmp_path / "metrics.key"
    secret.write_text(KEY_B + "\n")  # as `echo KEY > file` writes it
    secret.chmod(0o600)
    job = config["scrape_configs"][0]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{keyed.port}"]
    keyed_job = {**job, "job_name": "keyed",
                 "authorization": {**authorization, "credentials_file": str(secret)}}
    config["scrape_configs"] = [{**job, "job_name": "open"}, keyed_job]
    config["global"]["scrape_interval"] = "1s"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/api/v1/query"

        def both_scraped() -> dict[str, str] | None:
            """Each job's ``up`` once both were scraped and the keyed one got in."""
            assert proc.poll() is None, (
                (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:])
            try:
                result = httpx.get(url, params={"query": "up"}, timeout=5).json()
            except httpx.HTTPError:
                return None
            up = {r["metric"]["job"]: r["value"][1] for r in result["data"]["result"]}
            return up if len(up) == 2 and up["keyed"] == "1" else None

        up = wait_for(both_scraped, "Prometheus to scrape the keyed job", 90, interval=1)
        assert up == {"keyed": "1", "open": "0"}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- without a server ---------------------------------------------------------------------


def _check(tmp_path: Path, key_file: Path) -> subprocess.CompletedProcess:
    config = write_config(tmp_path / "serve.yaml", 8000,
                          [{"name": "m", "source": "embedded:tiny-dense"}],
                          ingress={"api_keys_file": str(key_file)})
    return subprocess.run([sys.executable, "-m", "serve_app", "check", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_check_refuses_a_key_file_others_can_read(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_A + "\n")
    where = f"{tmp_path / 'serve.yaml'}: applications[0].args.ingress.api_keys_file"
    for mode in (0o644, 0o640, 0o604, 0o660):
        key_file.chmod(mode)
        out = _check(tmp_path, key_file)
        assert out.returncode == 2, out
        assert where in out.stderr and f"mode {mode:04o}" in out.stderr
        assert f"chmod 600 {key_file}" in out.stderr and KEY_A not in out.stderr
    key_file.chmod(0o600)
    out = _check(tmp_path, key_file)
    assert out.returncode == 0 and "ok" in out.stdout, out
    key_file.chmod(0o400)
    assert _check(tmp_path, key_file).returncode == 0


def test_check_refuses_missing_empty_and_foreign_key_files(tmp_path):
    out = _check(tmp_path, tmp_path / "absent")
    assert out.returncode == 2 and "cannot read it" in out.stderr
    out = _check(tmp_path, Path("keys"))  # relative: to which directory?
    assert out.returncode == 2 and "must be an absolute path" in out.stderr
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    empty.chmod(0o600)
    out = _check(tmp_path, empty)
    assert out.returncode == 2 and "holds no key" in out.stderr
    if os.getuid() == 0:  # root can hand a file to another user
        foreign = tmp_path / "foreign"
        foreign.write_text(KEY_A)
        foreign.chmod(0o600)
        os.chown(foreign, 65534, 65534)
    else:  # a file of root's that this user can read
        foreign = Path("/etc/hostname")
    out = _check(tmp_path, foreign)
    assert out.returncode == 2 and "not by this user" in out.stderr, out
