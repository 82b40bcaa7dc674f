"""The status page's pure parts, without Ray or a server: ``/v1/status`` as ``/v1/stats``
pruned (same paths, nothing else), the error log, the last minute's activity per replica and
merged over replicas, the admin routes' argument and origin checks, and which routes the API
key middleware leaves open (the page itself) or closes (its data and controls)."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from serve_app.api import auth
from serve_app.api import status as status_module
from serve_app.api.auth import wants_html
from serve_app.api.status import (
    MESSAGE_CHARS,
    RECENT_ERRORS,
    ErrorLog,
    ServerInfo,
    pruned,
    status_view,
)
from serve_app.api.status_routes import _benchmark_args, check_same_origin
from serve_app.cache.merge import merge
from serve_app.serving.recent import WINDOW_S, RecentActivity, RecentWindow
from serve_app.serving.request import ApiError
from serve_app.serving.selfbench import MAX_SSD_BYTES, MIN_SSD_BYTES, SSD_BYTES

MODEL = "org.name/Qwen3.5-0.8B/v1.2"  # dots and slashes: a key, never a path


# ---- /v1/status: /v1/stats pruned ------------------------------------------------------


def full_stats() -> dict:
    """A ``/v1/stats`` with the fields the page reads and extra ones at every level."""
    return {
        "server": {"version": "1.0", "started_at": 5.0, "anything": {"deep": 1}},
        "models": {MODEL: {
            "model": MODEL,
            "phase": {"phase": "ready"},
            "engine": {"submitted": 3, "finished": 2, "in_flight": 1,
                       "running_batch_size": 1, "step_seconds": 9.5, "captured_tokens": 7},
            "recent": {"requests": 2, "whatever": [1, 2]},
            "cache": {"enabled": True, "hit_rate": 0.5, "ssd_read_seconds": 0.1},
            "cache_store": {
                "bytes": 100, "blocks": 2, "hot_only_counter": 4,
                "staging": {"pending_bytes": 0, "pending_max_bytes": 10, "inline_writes": 3},
                "dropped": {"hot_full": 1},
                "ssd": {"dir": "/kv", "blocks": 5, "lock_holder": "123"},
            },
            "replica": {"pid": 42, "node_id": "n1", "status": "ok", "argv": ["secret"]},
            "replicas": [{"pid": 42}],
            "replicas_expected": 1,
            "timings": {"x": 1},
        }},
        "memory": {
            "plan": {"budget_bytes": 9, "fits": True, "internal": 1},
            "nodes": {"node.a/1": {"total_memory_bytes": 64, "hot_bytes": 8, "pids": [1]}},
            "rules": ["x"],
        },
        "pool": {"loaded": [MODEL], "models": {MODEL: {"pinned": False}}},
        "nodes": [{"node_id": "n1"}],
        "errors": {"total": 0},
        "benchmarks": {"last": None},
        "cluster": {"replicas": 1},
        "metrics": {"series": 3},
    }


def test_status_view_keeps_exactly_the_listed_fields_at_the_same_paths():
    """Every figure on the page sits at its ``/v1/stats`` path (the browser test compares
    them); anything not listed (at any level) stays out, and ``True`` keeps a subtree
    whole. A model name with dots and slashes is a key like any other."""
    assert status_view(full_stats()) == {
        "server": {"version": "1.0", "started_at": 5.0, "anything": {"deep": 1}},
        "models": {MODEL: {
            "model": MODEL,
            "phase": {"phase": "ready"},
            "engine": {"submitted": 3, "finished": 2, "in_flight": 1,
                       "running_batch_size": 1},
            "recent": {"requests": 2, "whatever": [1, 2]},
            "cache": {"enabled": True, "hit_rate": 0.5},
            "cache_store": {
                "bytes": 100, "blocks": 2,
                "staging": {"pending_bytes": 0, "pending_max_bytes": 10},
                "dropped": {"hot_full": 1},
                "ssd": {"dir": "/kv", "blocks": 5},
            },
            "replica": {"pid": 42, "node_id": "n1", "status": "ok"},
            "replicas_expected": 1,
        }},
        "memory": {
            "plan": {"budget_bytes": 9, "fits": True},
            "nodes": {"node.a/1": {"total_memory_bytes": 64, "hot_bytes": 8}},
        },
        "pool": {"loaded": [MODEL], "models": {MODEL: {"pinned": False}}},
        "nodes": [{"node_id": "n1"}],
        "errors": {"total": 0},
        "benchmarks": {"last": None},
    }


def test_pruned_leaves_missing_keys_out_and_non_dicts_as_they_are():
    """A section a replica lacks is absent (never filled in); a value where the spec
    expects a dict (None, a list) is kept as is."""
    spec = {"a": {"b": True, "c": {"d": True}}, "*": {"x": True}}
    assert pruned({}, spec) == {}
    assert pruned({"a": None}, spec) == {"a": None}
    assert pruned({"a": {"c": [1, 2], "z": 1}}, spec) == {"a": {"c": [1, 2]}}
    assert pruned({"q.r/s": {"x": 1, "y": 2}, "a": {"b": 3}}, spec) == {
        "q.r/s": {"x": 1}, "a": {"b": 3}}
    assert pruned(7, spec) == 7
    assert status_view({"models": {}, "unknown": 1}) == {"models": {}}


# ---- the error log ---------------------------------------------------------------------


@pytest.fixture
def frozen_time(monkeypatch):
    """``time.time`` as the status module reads it, fixed at 1000.0 (settable)."""
    now = SimpleNamespace(t=1000.0)
    monkeypatch.setattr(status_module, "time", SimpleNamespace(time=lambda: now.t))
    return now


def test_error_log_keeps_the_newest_first_and_at_most_recent_errors(frozen_time):
    """The page shows the last ``RECENT_ERRORS``, newest first; the counts by status cover
    every error since start, also those that fell out of the list."""
    log = ErrorLog()
    for i in range(RECENT_ERRORS + 5):
        frozen_time.t = 1000.0 + i
        status = 404 if i % 2 else 503
        log.add(f"/v1/p{i}", f"m{i}", ApiError(status, f"error {i}", code=f"c{i}"))
    report = log.report()
    assert report["total"] == RECENT_ERRORS + 5
    assert report["by_status"] == {"404": 12, "503": 13}
    assert list(report["by_status"]) == ["404", "503"]
    recent = report["recent"]
    assert len(recent) == RECENT_ERRORS
    assert [r["path"] for r in recent] == [f"/v1/p{i}" for i in range(24, 4, -1)]
    assert recent[0] == {"at": 1024.0, "path": "/v1/p24", "model": "m24", "status": 503,
                         "type": "invalid_request_error", "code": "c24", "param": None,
                         "message": "error 24"}


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_an_error_about_the_body_keeps_no_message(status, frozen_time):
    """A message about a body can quote it (another tenant's, with keys on): only its type,
    code and param stay."""
    log = ErrorLog()
    log.add("/v1/chat/completions", None,
            ApiError(status, "messages[0].content: 'my secret prompt' is bad",
                     param="messages", code="bad_body"))
    (record,) = log.report()["recent"]
    assert record["message"] is None
    assert (record["status"], record["param"], record["code"]) == (status, "messages",
                                                                   "bad_body")
    assert log.report()["by_status"] == {str(status): 1}


@pytest.mark.parametrize("status", [409, 429, 503])
def test_other_errors_keep_their_message_truncated(status, frozen_time):
    """The server's own words (busy, overloaded, unavailable) help the reader; a long
    one is cut to ``MESSAGE_CHARS``."""
    log = ErrorLog()
    log.add("/v1/x", "m", ApiError(status, "short"))
    log.add("/v1/x", "m", ApiError(status, "y" * (MESSAGE_CHARS + 50)))
    long, short = log.report()["recent"]
    assert short["message"] == "short"
    assert long["message"] == "y" * MESSAGE_CHARS
    assert log.report()["by_status"] == {str(status): 2}


def test_error_log_keep_is_configurable():
    log = ErrorLog(keep=2)
    for i in range(3):
        log.add("/p", None, ApiError(409, str(i)))
    assert [r["message"] for r in log.report()["recent"]] == ["2", "1"]
    assert log.report()["total"] == 3


def test_server_info_has_its_fields_and_uptime(frozen_time):
    frozen_time.t = 1100.04
    info = ServerInfo(version="0.9", started_at=1000.0, api_keys=True, admin_keys=False,
                      model_pool=False)
    assert info.to_json() == {"version": "0.9", "started_at": 1000.0, "api_keys": True,
                              "admin_keys": False,
                              "model_pool": False, "uptime_s": 100.0}


# ---- the last minute ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ended(w: RecentWindow, ttft: float | None, tokens: int, decode_s: float) -> None:
    """A request whose tokens all came now (its first with ``ttft``), ending now."""
    for i in range(tokens):
        w.token(ttft if i == 0 else None)
    w.finished(tokens, decode_s)


def window_with_four() -> tuple[RecentWindow, Clock]:
    """Four requests ended at 0, 30, 50 and 55 s: one made no token, one only a single
    token (no decode speed from it)."""
    clock = Clock()
    w = RecentWindow(clock=clock)
    for at, ttft, tokens, decode_s in [(0.0, 0.5, 10, 2.0), (30.0, None, 0, 0.0),
                                       (50.0, 0.2, 1, 0.0), (55.0, 1.0, 5, 0.5)]:
        clock.now = at
        ended(w, ttft, tokens, decode_s)
    return w, clock


def test_recent_window_sums_are_exact():
    """Decode speed per stream counts each request's tokens after its first (tokens - 1)
    over its seconds from first to last; a request with no token counts as a request
    only."""
    w, clock = window_with_four()
    clock.now = 59.0
    a = w.activity()
    assert (a.window_s, a.requests, a.output_tokens) == (WINDOW_S, 4, 16)
    assert a.ttft_requests == 3
    assert a.ttft_seconds == pytest.approx(1.7)
    assert a.ttft_max_s == 1.0
    assert (a.decode_tokens, a.decode_seconds) == (9 + 4, 2.5)
    assert a.summary() == {
        "window_s": 60.0, "requests": 4, "output_tokens": 16,
        "output_tokens_per_s": round(16 / 60, 3),
        "ttft_mean_s": round(1.7 / 3, 4), "ttft_max_s": 1.0,
        "decode_tokens_per_s": 5.2,
    }


def test_requests_older_than_the_window_drop_out():
    """The horizon is ``now - window_s``: a request ended exactly then still counts, one
    just before it no longer does (and never comes back)."""
    w, clock = window_with_four()
    clock.now = 60.0
    assert w.activity().requests == 4
    clock.now = 60.5
    a = w.activity()
    assert (a.requests, a.output_tokens, a.ttft_requests) == (3, 6, 2)
    assert a.ttft_max_s == 1.0 and a.ttft_seconds == pytest.approx(1.2)
    assert (a.decode_tokens, a.decode_seconds) == (4, 0.5)
    clock.now = 110.5  # horizon 50.5: only the 55 s one is left
    assert (w.activity().requests, w.activity().output_tokens) == (1, 5)
    clock.now = 115.5
    assert w.activity() == RecentActivity(window_s=60.0)
    clock.now = 200.0
    ended(w, 0.3, 3, 0.2)
    a = w.activity()
    assert (a.requests, a.output_tokens, a.decode_tokens) == (1, 3, 2)


def test_a_long_stream_counts_while_it_runs():
    """Tokens count when they are made and the first token's time when it comes: a stream
    running for minutes shows in the output rate all along, its oldest tokens leaving the
    window as it goes; it counts as a request (and its decode speed) once it ends."""
    clock = Clock()
    w = RecentWindow(clock=clock)
    w.token(0.4)
    for t in range(1, 100):  # a token a second for 100 s
        clock.now = float(t)
        w.token()
    a = w.activity()
    assert (a.requests, a.output_tokens, a.ttft_requests) == (0, 61, 0)  # 39..99 s
    assert a.decode_seconds == 0  # no speed per stream before it ends
    clock.now = 30.0
    w = RecentWindow(clock=clock)
    w.token(0.4)
    a = w.activity()
    assert (a.output_tokens, a.ttft_requests, a.ttft_max_s) == (1, 1, 0.4)
    clock.now = 40.0
    w.token()
    w.finished(2, 10.0)
    a = w.activity()
    assert (a.requests, a.output_tokens, a.decode_tokens, a.decode_seconds) == (1, 2, 1, 10.0)


def test_a_short_window_and_a_request_without_a_token():
    clock = Clock()
    w = RecentWindow(window_s=10.0, clock=clock)
    ended(w, None, 0, 0.0)
    a = w.activity()
    assert (a.requests, a.ttft_requests, a.ttft_seconds) == (1, 0, 0.0)
    assert a.summary()["ttft_mean_s"] is None and a.summary()["ttft_max_s"] is None
    clock.now = 10.5
    assert w.activity().requests == 0


def test_summary_of_nothing_measured_says_none():
    """No request: zero counts and rates, None for what no request measured."""
    assert RecentActivity().summary() == {
        "window_s": WINDOW_S, "requests": 0, "output_tokens": 0,
        "output_tokens_per_s": 0.0, "ttft_mean_s": None, "ttft_max_s": None,
        "decode_tokens_per_s": None}


def test_activity_merges_over_replicas_as_sums_and_max():
    """A model's last minute is its replicas' summed (tokens per second adds up; the mean
    time to first token is weighted by requests), its slowest first token the max."""
    clock = Clock()
    one, two = RecentWindow(clock=clock), RecentWindow(clock=clock)
    ended(one, 0.5, 10, 1.0)
    ended(one, 0.1, 4, 0.5)
    ended(two, 2.0, 31, 3.0)
    ended(two, None, 0, 0.0)
    a = merge([one.activity(), two.activity()])
    assert a == RecentActivity(window_s=60.0, requests=4, output_tokens=45, ttft_requests=3,
                               ttft_seconds=pytest.approx(2.6), ttft_max_s=2.0,
                               decode_tokens=9 + 3 + 30, decode_seconds=4.5)
    assert a.summary() == {
        "window_s": 60.0, "requests": 4, "output_tokens": 45, "output_tokens_per_s": 0.75,
        "ttft_mean_s": round(2.6 / 3, 4), "ttft_max_s": 2.0,
        "decode_tokens_per_s": round(42 / 4.5, 2)}
    assert merge([None, two.activity()]).requests == 2  # a replica without the section


# ---- the admin routes' checks -------------------------------------------------------------


def test_benchmark_args_default_and_accept_the_known_fields():
    assert _benchmark_args({}) == (None, SSD_BYTES)
    assert _benchmark_args({"model": "m/x.y"}) == ("m/x.y", SSD_BYTES)
    assert _benchmark_args({"model": None, "ssd_bytes": MIN_SSD_BYTES}) == (None,
                                                                            MIN_SSD_BYTES)
    assert _benchmark_args({"ssd_bytes": MAX_SSD_BYTES}) == (None, MAX_SSD_BYTES)


@pytest.mark.parametrize(("body", "param"), [
    ({"modle": "m"}, "modle"),
    ({"model": "m", "zeta": 1, "alpha": 2}, "alpha"),
    ({"model": 3}, "model"),
    ({"model": ["m"]}, "model"),
    ({"ssd_bytes": True}, "ssd_bytes"),
    ({"ssd_bytes": 1048576.0}, "ssd_bytes"),
    ({"ssd_bytes": "1048576"}, "ssd_bytes"),
    ({"ssd_bytes": MIN_SSD_BYTES - 1}, "ssd_bytes"),
    ({"ssd_bytes": MAX_SSD_BYTES + 1}, "ssd_bytes"),
    ({"ssd_bytes": -1}, "ssd_bytes"),
    ({"ssd_bytes": None}, "ssd_bytes"),
])
def test_benchmark_args_refuse_a_bad_body_naming_the_param(body, param):
    with pytest.raises(ApiError) as err:
        _benchmark_args(body)
    assert (err.value.status, err.value.param) == (400, param)
    assert param in err.value.message


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_benchmark_args_refuse_a_body_that_is_no_object(body):
    with pytest.raises(ApiError) as err:
        _benchmark_args(body)
    assert err.value.status == 400 and "JSON object" in err.value.message


def request(headers: dict[str, str], method: str = "POST") -> Request:
    return Request({"type": "http", "method": method, "path": "/admin/benchmark",
                    "root_path": "", "query_string": b"",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


@pytest.mark.parametrize("headers", [
    {"host": "localhost:8000"},
    {},
    {"host": "localhost:8000", "origin": "http://localhost:8000"},
    {"host": "mac.local:8000", "origin": "https://mac.local:8000"},
])
def test_same_origin_and_non_browser_posts_pass(headers):
    """No Origin (curl, SDKs) or the page's own origin: the controls work."""
    check_same_origin(request(headers))


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:9000",
                                    "null", "http://localhost:8000.evil.example",
                                    "https://localhost"])
def test_a_post_from_another_origin_is_refused(origin):
    """A page elsewhere cannot drive this server's controls (its browser names it)."""
    with pytest.raises(ApiError) as err:
        check_same_origin(request({"host": "localhost:8000", "origin": origin}))
    assert (err.value.status, err.value.code, err.value.type) == (403, "cross_origin",
                                                                  "permission_error")
    assert origin in err.value.message


@pytest.mark.parametrize(("accept", "html"), [
    ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", True),
    ("text/html", True),
    ("text/html;q=0.9", True),
    ("*/*", False),
    ("application/json", False),
    ("application/json, text/html", False),
    ("", False),
])
def test_wants_html_reads_the_first_accepted_type(accept, html):
    headers = {"accept": accept} if accept else {}
    assert wants_html(request(headers, method="GET").headers.get("accept", "")) is html


# ---- the API key middleware and the page ---------------------------------------------------

KEY = "sk-status-units-key-0123456789abcdef"
HTML = "text/html,application/xhtml+xml,*/*;q=0.8"


@pytest.fixture
def keys_on():
    auth.configure(auth.ApiKeys([hashlib.sha256(KEY.encode()).hexdigest()]))
    try:
        yield
    finally:
        auth.configure(auth.ApiKeys())


def call(method: str, path: str, headers: dict[str, str],
         root_path: str = "") -> tuple[int, list[str], bytes]:
    """Drive the middleware as an ASGI app over a tiny inner app: (status, paths the inner
    app saw, the answer's body)."""
    reached: list[str] = []
    sent: list[dict] = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"inner"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": root_path + path,
             "root_path": root_path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(auth.ApiKeyMiddleware(inner)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], reached, body


@pytest.mark.usefixtures("keys_on")
def test_the_page_itself_is_open_to_a_browser():
    """``GET /`` asking for HTML and the page's two files hold no data: no key needed."""
    assert call("GET", "/", {"accept": HTML}) == (200, ["/"], b"inner")
    assert call("GET", "/status/status.js", {}) == (200, ["/status/status.js"], b"inner")
    assert call("GET", "/status/status.css", {})[0] == 200
    assert call("GET", "/", {"accept": HTML}, root_path="/llm")[:2] == (200, ["/llm/"])


@pytest.mark.usefixtures("keys_on")
@pytest.mark.parametrize(("method", "accept"), [
    ("GET", "*/*"), ("GET", "application/json"), ("GET", None),
    ("POST", HTML), ("HEAD", HTML), ("GET", "application/json, text/html"),
])
def test_root_as_data_or_not_a_browser_get_needs_a_key(method, accept):
    """``GET /`` as JSON says what this server serves (its models): a key; a POST to ``/``
    is never the page."""
    headers = {"accept": accept} if accept is not None else {}
    status, reached, body = call(method, "/", headers)
    assert (status, reached) == (401, [])
    assert b"invalid_api_key" in body
    assert call(method, "/", {**headers, "authorization": f"Bearer {KEY}"})[:2] == (200, ["/"])


@pytest.mark.usefixtures("keys_on")
@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/status"), ("POST", "/admin/models/x/unload"),
    ("POST", "/admin/models/org/x.y/cache/clear"), ("POST", "/admin/benchmark"),
    ("GET", "/status/other.js"),
])
def test_the_pages_data_and_controls_need_a_key(method, path):
    """The page's data and every control: 401 without a key (or with a wrong one), the
    route with the right one; a browser's Accept opens nothing but ``GET /``."""
    assert call(method, path, {"accept": HTML})[:2] == (401, [])
    assert call(method, path, {"authorization": "Bearer wrong-key"})[:2] == (401, [])
    assert call(method, path, {"authorization": f"Bearer {KEY}"})[:2] == (200, [path])
    assert call(method, path, {"x-api-key": KEY})[:2] == (200, [path])


def test_without_keys_everything_passes():
    auth.configure(auth.ApiKeys())
    assert call("GET", "/v1/status", {})[:2] == (200, ["/v1/status"])
    assert call("POST", "/admin/benchmark", {})[:2] == (200, ["/admin/benchmark"])
