"""Hardening of the HTTP front: startup readiness and bad input.

A server of its own (started here, so its startup can be watched from the
moment the port listens) with a small request-size limit and prompt bound.
In-process tests cover JSON nesting, the prompt bound before tokenizing and
the engine warm-up. The last live test kills the model replica mid-request.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import mlx_lm
import pytest

from bench.devserver import ServerProcess, descendants, free_port, write_config
from serve_app.api.body import MAX_JSON_DEPTH, parse_json
from serve_app.config.profile import ModelProfile, parse_profile
from serve_app.models.embedded import materialize
from serve_app.serving.request import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from serve_app.serving.service import ModelService
from tests.support.servers import running

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
    seen: list[dict] = []
    with running(server):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _listening(port):
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server never listened; log:\n{server.log_tail()}")
            time.sleep(0.05)
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            while not (seen and seen[-1]["what"] == "health" and seen[-1].get("status") == 200):
                if server.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"never ready; seen {seen[-4:]}; log:\n"
                                       f"{server.log_tail()}")
                seen.append(_observe(client, "complete"))
                seen.append(_observe(client, "health"))
                time.sleep(0.05)
            seen.append(_observe(client, "complete"))
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


# ---- request size ---------------------------------------------------------------------


def _chunks(data: bytes, size: int = 16 * 1024):
    for i in range(0, len(data), size):
        yield data[i:i + size]


# ---- JSON nesting ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,ok",
    [
        (nested(MAX_JSON_DEPTH), True),
        (nested(MAX_JSON_DEPTH + 1), False),
        ('{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1), False),
        (nested(100_000), False),  # the C parser's RecursionError
        (json.dumps({"s": "[" * 1000, "l": list(range(1000))}), True),  # brackets in a string
        (json.dumps([[i] for i in range(1000)]), True),  # many brackets, shallow
        # Escaped quotes and backslashes do not end a string early: its brackets never count.
        (json.dumps({"s": '\\"' + "[" * 100, "t": "\\", "u": "]" * 100}), True),
        (json.dumps({"s": '\\"]]', "l": json.loads(nested(MAX_JSON_DEPTH))}), False),
        ("[]," * 100_000 + "[]", True),  # wide: the depth comes from the bytes, not a walk
        (nested(MAX_JSON_DEPTH + 1).encode("utf-16"), False),  # json.loads takes UTF-16 too
        (nested(MAX_JSON_DEPTH).encode("utf-16"), True),
    ],
)
def test_parse_json_bounds_nesting(raw, ok):
    raw = raw if isinstance(raw, bytes) else raw.encode()
    if raw.startswith(b"[],"):
        raw = b"[" + raw + b"]"
    if ok:
        parse_json(raw)
        return
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert info.value.status == 400 and info.value.code == "json_too_deep"


# ---- prompt bound before tokenizing ----------------------------------------------------


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


class _NoTokenizer:
    """Fails any tokenizer use: the prompt bound must not need one."""

    def __init__(self, real) -> None:
        self.real = real

    def apply_chat_template(self, *a, **kw):
        raise AssertionError("tokenizer called")

    def encode(self, *a, **kw):
        raise AssertionError("tokenizer called")


@pytest.fixture(scope="module")
def service(model_home):
    path = materialize("tiny-dense", model_home)
    model, tokenizer = mlx_lm.load(str(path))
    profile = ModelProfile(name="m", source="embedded:tiny-dense", context_length=64,
                           cache={"enabled": False})
    svc = ModelService(profile, model, tokenizer)
    yield svc
    svc.shutdown()


def test_prompt_bound_is_checked_before_tokenizing(service):
    real = service.preparer.tokenizer
    service.preparer.tokenizer = _NoTokenizer(real)
    limit = 32 * 64  # derived from context_length
    try:
        for request in (
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "a" * 2049}]),
            CompletionRequest(model="m", prompt="a" * (limit + 1)),
            CompletionRequest(model="m", prompt=[1] * 64),
        ):
            with pytest.raises(ApiError) as info:
                service.prepare(request)
            assert info.value.code == "context_length_exceeded"
        with pytest.raises(AssertionError, match="tokenizer called"):  # under it: tokenized
            service.prepare(CompletionRequest(model="m", prompt="a" * limit))
    finally:
        service.preparer.tokenizer = real


def test_warm_up_leaves_no_trace_in_engine_counters(service):
    seconds = service.warm_up()
    assert seconds > 0
    stats = service.engine.snapshot()
    assert stats.submitted == stats.finished == stats.in_flight == 0
    assert stats.prompt_tokens == stats.generated_tokens == 0


def test_new_profile_keys_have_defaults():
    profile = parse_profile({"models": [{"name": "m", "source": "embedded:tiny-dense",
                                         "context_length": 100}]})
    assert profile.ingress.max_request_bytes == 16 * 1024 * 1024
    assert profile.models[0].max_prompt_chars is None
    assert profile.models[0].prompt_char_limit() == 3200
    profile = parse_profile({"models": [{"name": "m", "source": "embedded:tiny-dense",
                                         "max_prompt_chars": 10}],
                             "ingress": {"max_request_bytes": "2MiB"}})
    assert profile.ingress.max_request_bytes == 2 * 1024 * 1024
    assert profile.models[0].prompt_char_limit() == 10


def test_an_api_error_crosses_ray_intact():
    """A replica's ApiError (e.g. from count_tokens) is pickled back to the ingress."""
    import pickle

    err = pickle.loads(pickle.dumps(ApiError(400, "bad", param="p", code="c",
                                             headers={"Retry-After": "1"})))
    assert (err.status, err.message, err.param, err.code, err.headers) == (
        400, "bad", "p", "c", {"Retry-After": "1"})


def test_the_cache_isolating_key_is_read_from_either_apis_header():
    from starlette.requests import Request

    from serve_app.api.http import caller_of

    def caller(*headers):
        return caller_of(Request({"type": "http", "headers": [
            (k.encode(), v.encode()) for k, v in headers]}))

    bearer = caller(("authorization", "Bearer k1")).api_key_digest
    anthropic_key = caller(("x-api-key", "k1")).api_key_digest
    assert bearer == anthropic_key is not None  # the same key, the same tenant
    assert caller(("x-api-key", "k2")).api_key_digest != bearer
    assert caller().api_key_digest is None
