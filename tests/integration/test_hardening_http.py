"""Hardening of the HTTP front, live: startup readiness, bad input, a replica killed.

A server of its own (started here, so its startup can be watched from the moment the
port listens) with a small request-size limit and prompt bound. One test kills the model
replica mid-request and waits until Serve has replaced it, so the others find a ready
server in any order (the in-process checks: tests/unit/test_hardening_http.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid

import httpx
import pytest

from bench.devserver import ServerProcess, descendants, free_port, write_config
from serve_app.api.body import MAX_JSON_DEPTH
from serve_app.serving.request import (
    MESSAGE_OVERHEAD_CHARS,
)
from tests.support.servers import running, wait_for

MODEL = "tiny-hybrid"
CONTEXT = 4096
MAX_PROMPT_CHARS = 3000
MAX_REQUEST_BYTES = 256 * 1024
MODELS = [{"name": MODEL, "source": "embedded:tiny-hybrid", "context_length": CONTEXT,
           "max_prompt_chars": MAX_PROMPT_CHARS, "max_tokens": 16,
           "cache": {"block_size": 16}}]
STARTUP_TIMEOUT_S = 240.0


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat_body(content: str = "hello", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0, **extra}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _observe(client: httpx.Client, what: str) -> dict:
    """One request during startup: what the client saw, or the transport error."""
    tic = time.monotonic()
    try:
        if what == "health":
            r = client.get("/health")
        else:
            r = client.post("/v1/completions",
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    except httpx.HTTPError as exc:
        return {"what": what, "error": repr(exc), "seconds": time.monotonic() - tic}
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return {"what": what, "status": r.status_code, "retry_after": r.headers.get("retry-after"),
            "body": body, "seconds": time.monotonic() - tic}


def _observe_until_ready(server: ServerProcess, timeout: float) -> list[dict]:
    """Completion and /health answers, alternating, until /health says 200, then one more
    completion: everything a client saw, in order."""
    seen: list[dict] = []
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        def ready() -> bool:
            assert server.proc.poll() is None, f"the server exited; log:\n{server.log_tail()}"
            seen.append(_observe(client, "complete"))
            seen.append(_observe(client, "health"))
            return seen[-1].get("status") == 200

        wait_for(ready, lambda: f"/health to say 200; seen {seen[-4:]}; log:\n"
                                f"{server.log_tail()}", timeout, interval=0.05)
        seen.append(_observe(client, "complete"))
    return seen


@pytest.fixture(scope="module")
def young(tmp_path_factory, model_home):
    """A server watched from the moment its port listens until /health says 200.

    Yields (server, observations): every /health and completion answer seen
    during startup, alternating, in order.
    """
    tmp = tmp_path_factory.mktemp("hardening")
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, MODELS,
                          ingress={"num_cpus": 0, "max_request_bytes": MAX_REQUEST_BYTES},
                          cache_store={"ssd_dir": str(tmp / "kv")})
    server = ServerProcess.serve_run(config, port, tmp / "serve.log",
                                     env={"SERVE_APP_HOME": str(model_home)})
    with running(server):
        def listening() -> bool:
            assert server.proc.poll() is None, f"the server exited; log:\n{server.log_tail()}"
            return _listening(port)

        wait_for(listening, "the server's port to listen", STARTUP_TIMEOUT_S, interval=0.05)
        seen = _observe_until_ready(server, STARTUP_TIMEOUT_S)
        server.wait_ready([MODEL], timeout=30)  # records the pids to stop
        yield server, seen


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=60, **kw)


# ---- startup readiness ------------------------------------------------------------------


def _proxy_not_found(o: dict) -> bool:
    """Serve's proxy itself, before our application's route exists: 404, plain text."""
    return o.get("status") == 404 and isinstance(o["body"], str) and "not found" in o["body"]


def _not_ready(o: dict) -> bool:
    body = o.get("body")
    return (o.get("status") == 503 and o["retry_after"] is not None
            and int(o["retry_after"]) >= 1 and isinstance(body, dict)
            and body["error"]["code"] == "model_not_ready"
            and body["error"]["type"] == "service_unavailable"
            and MODEL in body["error"]["message"])


def test_startup_never_resets_or_fails(young):
    _, seen = young
    assert not [o for o in seen if "error" in o], "a request was reset or timed out"
    odd = [o for o in seen if not (_proxy_not_found(o) or _not_ready(o) or o["status"] == 200)]
    assert not odd, odd
    # Serve's own 404 only comes before our ingress has answered anything.
    ours = [i for i, o in enumerate(seen) if not _proxy_not_found(o)]
    assert all(not _proxy_not_found(o) for o in seen[ours[0]:])


def test_health_is_503_with_retry_after_until_ready_then_200(young):
    _, seen = young
    health = [o for o in seen if o["what"] == "health" and not _proxy_not_found(o)]
    assert _not_ready(health[0]), health[0]  # the ingress answers before the model is warm
    assert health[-1]["status"] == 200 and health[-1]["body"] == {
        "status": "ok", "models": {MODEL: {"phase": "ready"}}}
    first_ok = next(i for i, o in enumerate(health) if o["status"] == 200)
    assert all(o["status"] == 200 for o in health[first_ok:])


def test_completion_before_ready_is_503_with_retry_after(young):
    server, seen = young
    complete = [o for o in seen if o["what"] == "complete" and not _proxy_not_found(o)]
    assert any(_not_ready(o) for o in complete)
    assert complete[-1]["status"] == 200  # the one sent after /health turned 200
    r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert r.status_code == 200 and "retry-after" not in r.headers


# ---- request size ---------------------------------------------------------------------


def test_body_over_limit_with_content_length_is_413(young):
    server, _ = young
    body = json.dumps(chat_body("x" * (MAX_REQUEST_BYTES + 10))).encode()
    r = post(server, "/v1/chat/completions", content=body,
             headers={"Content-Type": "application/json"})
    err = error_of(r, 413)
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert str(MAX_REQUEST_BYTES) in err["message"]


def _chunks(data: bytes, size: int = 16 * 1024):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_chunked_body_over_limit_is_413(young):
    server, _ = young
    data = json.dumps(chat_body("x" * (MAX_REQUEST_BYTES + 10))).encode()
    r = post(server, "/v1/chat/completions", content=_chunks(data),
             headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers  # really sent chunked
    assert error_of(r, 413)["code"] == "request_too_large"


def test_chunked_body_under_limit_is_served(young):
    server, _ = young
    data = json.dumps(chat_body("hello " * 40)).encode()
    r = post(server, "/v1/chat/completions", content=_chunks(data, 100),
             headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---- JSON nesting ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 100_000])
def test_deeply_nested_json_is_400(young, depth):
    server, _ = young
    body = f'{{"model": "{MODEL}", "messages": {nested(depth)}}}'
    err = error_of(post(server, "/v1/chat/completions", content=body.encode()), 400)
    assert err["code"] == "json_too_deep" and str(MAX_JSON_DEPTH) in err["message"]


def test_nesting_within_the_limit_in_an_ignored_field_is_served(young):
    server, _ = young
    inner = nested(MAX_JSON_DEPTH - 3)  # with the body and "metadata": 64 levels
    body = json.dumps(chat_body())[:-1] + f', "metadata": {{"x": {inner}}}}}'
    r = post(server, "/v1/chat/completions", content=body.encode())
    assert r.status_code == 200, r.text[:300]


# ---- prompt bound before tokenizing ----------------------------------------------------


def test_chat_prompt_over_char_limit_is_400(young):
    server, _ = young
    # Two messages: the bound is on the sum of their contents, each message's markup
    # counted as MESSAGE_OVERHEAD_CHARS.
    user = MAX_PROMPT_CHARS + 1 - 2 * MESSAGE_OVERHEAD_CHARS - 2000
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": "s" * 2000},
                         {"role": "user", "content": "u" * user}]}
    err = error_of(post(server, "/v1/chat/completions", json=body), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert str(MAX_PROMPT_CHARS) in err["message"] and str(MAX_PROMPT_CHARS + 1) in err["message"]


@pytest.mark.parametrize("prompt", ["p" * (MAX_PROMPT_CHARS + 1), ["p" * (MAX_PROMPT_CHARS + 1)]])
def test_completion_prompt_over_char_limit_is_400(young, prompt):
    server, _ = young
    err = error_of(post(server, "/v1/completions",
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(MAX_PROMPT_CHARS) in err["message"]


def test_completion_token_ids_over_context_are_400(young):
    server, _ = young
    err = error_of(post(server, "/v1/completions",
                        json={"model": MODEL, "prompt": [5] * CONTEXT, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]


def _replica_pids(server) -> list[int]:
    out = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ServeReplica:llm:model-" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def _in_flight(server) -> int:
    r = httpx.get(f"{server.base_url}/v1/stats", timeout=30)
    return r.json()["models"][MODEL]["engine"]["in_flight"]


def test_replica_killed_mid_request_is_503_then_recovers(young):
    """It takes the model down; however it ends, it waits for Serve's new replica, so the
    tests after it find the server ready."""
    server, _ = young
    try:
        _kill_the_replica_mid_request(server)
    finally:
        server.wait_ready([MODEL], timeout=STARTUP_TIMEOUT_S)


def _kill_the_replica_mid_request(server: ServerProcess) -> None:
    (pid,) = _replica_pids(server)
    # Long, uncached prefills, one each (two requests of one prompt would not run together:
    # the second waits for the first's blocks and restores them).
    prompts = {s: uuid.uuid4().hex * (MAX_PROMPT_CHARS // 32 - 2) for s in (False, True)}
    results: dict[bool, object] = {}

    def call(stream: bool) -> None:
        body = {"model": MODEL, "prompt": prompts[stream], "max_tokens": 16, "stream": stream}
        try:
            with httpx.Client(base_url=server.base_url, timeout=120) as client:
                r = client.post("/v1/completions", json=body)
                results[stream] = (r.status_code, r.headers.get("retry-after"), r.text)
        except httpx.HTTPError as exc:
            results[stream] = exc

    threads = [threading.Thread(target=call, args=(stream,)) for stream in (False, True)]
    for t in threads:
        t.start()
    # Both running (or, on a fast machine, both already answered: then the kill finds an
    # idle replica and the answers are 200s, which the checks below accept).
    wait_for(lambda: _in_flight(server) >= 2 or not any(t.is_alive() for t in threads),
             "both requests in flight", 30, interval=0.01)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung after its replica was killed"
    # The whole answer had sent nothing: it is sent again, and answered by the replica Serve
    # starts in place of the dead one, or (no replica took it in time) 503 with Retry-After.
    status, retry_after, text = results[False]
    if status == 200:
        assert json.loads(text)["choices"][0]["text"] is not None
    else:
        assert status == 503, text
        assert json.loads(text)["error"]["code"] in ("replica_lost", "not_routed"), text
        assert retry_after is not None
    status, retry_after, text = results[True]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if status == 200 and '"error"' in text:
        # It had started and goes on after its tokens on the replica Serve starts in place
        # of the dead one; none took it in time (one replica, reloading): the error event.
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] in (
            "replica_lost", "not_routed", "request_timeout", "model_not_ready"), events[-2]
    elif status == 200:  # sent again, or continued after its tokens, and answered
        assert events[-1] == "[DONE]"
    else:
        assert status == 503, text
        assert json.loads(text)["error"]["code"] in ("replica_lost", "not_routed"), text
    # Until Serve has replaced and warmed the replica: 503 with Retry-After, never a hang.
    seen = _observe_until_ready(server, STARTUP_TIMEOUT_S)
    assert all(_not_ready(o) or o.get("status") == 200 for o in seen), seen
    assert seen[-1]["status"] == 200
