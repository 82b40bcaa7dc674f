"""A hardened request path: every bad input is a 400 (or 413/429/504) in the API's own
shape, before any expensive work, and the server keeps serving.

One server of its own (``serve run``): a prefix-routed model with two replicas (the
ingress templates its requests, the router picks a replica) and a one-replica model
with one batch slot, each with a tiny queue, and a 3-second request timeout (the checks
that need no server: tests/unit/test_request_limits.py).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from serve_app.serving.request import (
    MAX_CACHE_SALT_CHARS,
)
from tests.support.clients import anthropic_client, openai_client
from tests.support.servers import serving, wait_for
from tests.support.threads import Threads

ROUTED = "limits-routed"
SLOW = "limits-slow"
MAX_MESSAGES = 8
TIMEOUT_S = 3.0
MODELS = [
    {"name": ROUTED, "source": "embedded:tiny-dense", "context_length": 4096,
     "num_replicas": 2, "routing": {"mode": "prefix"}, "max_batch_size": 1,
     "max_queued_requests": 0, "max_tokens": 4000, "max_messages": MAX_MESSAGES,
     "cache": {"block_size": 16}},
    # Default max_messages (4096); one slot and two queued requests.
    {"name": SLOW, "source": "embedded:tiny-dense", "context_length": 4096,
     "max_batch_size": 1, "max_queued_requests": 2, "max_tokens": 4000,
     "cache": {"enabled": False}},
]
# Never satisfiable: compiling it fails, in the prepare stage (a 400 when it runs).
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "bad",
                                                     "schema": {"type": "nonsense"}}}
# An allOf of four 8-way anyOfs (2.8 KB): 2 s to compile under llguidance's defaults.
PATHOLOGICAL = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
    "type": "integer"}}, "required": [f"a{j}_{i}"]} for i in range(8)]} for j in range(4)]}


@pytest.fixture(scope="module")
def limited(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("limits")
    with serving(tmp, MODELS, model_home,
                 ingress={"num_cpus": 0, "request_timeout_s": TIMEOUT_S},
                 cache_store={"ssd_dir": str(tmp / "kv")}) as server:
        yield server


def post(server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("timeout", 120)
    return httpx.post(f"{server.base_url}{path}", content=content,
                      headers={"Content-Type": "application/json", "x-api-key": "k",
                               "anthropic-version": "2023-06-01"}, **kw)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def chat(model: str, content: str = "hello", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **extra}


def messages_body(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}], **extra}


def stats(server, model: str) -> dict:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"][model]


def post_admitted(server, path: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    """``post``, again after each 429 (a replica still busy with a stream just closed:
    Serve may route there before it has seen the cancellation)."""
    deadline = time.monotonic() + timeout
    while True:
        r = post(server, path, body)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def assert_serving(server, model: str) -> None:
    r = post_admitted(server, "/v1/chat/completions", chat(model, uuid.uuid4().hex))
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1


def wait_idle(server, model: str, timeout: float = 60.0) -> dict:
    last: dict = {}

    def idle() -> dict | None:
        last.update(stats(server, model))
        return dict(last) if last["engine"]["in_flight"] == 0 else None

    return wait_for(idle, lambda: f"{model} idle: {last.get('engine')}", timeout, 0.1)


class Held:
    """Streams of ``max_tokens`` 4000 held open (each admitted: its headers came), closed
    on exit, so the model's slot and queue stay full meanwhile. They are opened one after
    the other, each once the one before was admitted: the first takes the slot."""

    def __init__(self, server, model: str, n: int) -> None:
        self.server, self.model, self.n = server, model, n
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = Threads()

    def _hold(self) -> None:
        body = {**chat(self.model, uuid.uuid4().hex), "max_tokens": 4000, "stream": True}
        for _ in range(50):  # Serve's router may pick a busy replica: its engine says 429
            with httpx.stream("POST", f"{self.server.base_url}/v1/chat/completions",
                              json=body, timeout=120) as r:
                if r.status_code == 429 and self.model == ROUTED:
                    time.sleep(0.1)
                    continue
                self.statuses.append(r.status_code)
                self.stop.wait(120)
                return

    def __enter__(self) -> Held:
        try:
            for i in range(self.n):
                thread = self.threads.start(self._hold)
                wait_for(lambda i=i, t=thread: len(self.statuses) > i or not t.is_alive(),
                         f"held stream {i + 1} of {self.n} admitted", 60, interval=0.05)
            assert self.statuses == [200] * self.n, self.statuses
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.threads.join(60)


# ---- cache_salt ------------------------------------------------------------------------


def test_a_lone_surrogate_salt_on_a_prefix_routed_model_is_400_and_serving_goes_on(limited):
    lone = "\ud800"  # valid JSON ("\\ud800"), not encodable as UTF-8
    assert json.dumps(lone) == '"\\ud800"'
    for path, body in (("/v1/chat/completions", chat(ROUTED, cache_salt=lone)),
                       ("/v1/completions", {"model": ROUTED, "prompt": "hi", "max_tokens": 2,
                                            "cache_salt": lone})):
        tic = time.monotonic()
        r = post(limited, path, body, timeout=10)
        print(f"{path}: lone-surrogate salt answered in {time.monotonic() - tic:.3f} s")
        err = openai_error(r, 400)
        assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error", err
    # A paired surrogate (an emoji, escaped) is valid text: served.
    ok = json.dumps(chat(ROUTED, cache_salt="\U0001f600"))
    assert "\\ud83d\\ude00" in ok
    assert post_admitted(limited, "/v1/chat/completions", json.loads(ok)).status_code == 200
    assert_serving(limited, ROUTED)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_salt_over_the_length_bound_is_400(limited, path):
    body = chat(ROUTED) if path.endswith("chat/completions") else {
        "model": ROUTED, "prompt": "hi", "max_tokens": 2}
    err = openai_error(post(limited, path, {**body, "cache_salt": "s" * (MAX_CACHE_SALT_CHARS
                                                                          + 1)}), 400)
    assert err["param"] == "cache_salt" and str(MAX_CACHE_SALT_CHARS) in err["message"]
    r = post_admitted(limited, path, {**body, "cache_salt": "s" * MAX_CACHE_SALT_CHARS})
    assert r.status_code == 200, r.text[:300]


# ---- timeouts ----------------------------------------------------------------------------


def test_a_request_not_answered_in_time_is_504_and_its_work_is_cancelled(limited):
    before = wait_idle(limited, SLOW)["engine"]
    results: dict[str, object] = {}

    def call_openai() -> None:
        client = openai_client(limited, "k")
        try:
            client.chat.completions.create(model=SLOW, max_tokens=4000, temperature=0,
                                           messages=[{"role": "user", "content": "go"}])
            results["openai"] = "answered"
        except openai.APIStatusError as exc:
            results["openai"] = exc

    def call_anthropic() -> None:
        client = anthropic_client(limited, "k")
        try:
            client.messages.create(model=SLOW, max_tokens=4000,
                                   messages=[{"role": "user", "content": "go"}])
            results["anthropic"] = "answered"
        except anthropic.APIStatusError as exc:
            results["anthropic"] = exc

    with Held(limited, SLOW, 1):  # the only slot is taken: both wait in the queue
        calls = Threads()
        for call in (call_openai, call_anthropic):
            calls.start(call)
        calls.join(60)
        exc = results["openai"]
        assert isinstance(exc, openai.APIStatusError) and exc.status_code == 504, exc
        assert exc.body["type"] == "timeout_error" and exc.body["code"] == "request_timeout"
        exc = results["anthropic"]
        assert isinstance(exc, anthropic.APIStatusError) and exc.status_code == 504, exc
        assert exc.body == {"type": "error", "error": {"type": "timeout_error",
                                                       "message": exc.body["error"]["message"]}}
        # Their replica work is gone while the held stream still runs: only it in flight.
        wait_for(lambda: stats(limited, SLOW)["engine"]["in_flight"] <= 1,
                 "the timed-out requests' work cancelled", 10, interval=0.1)
    after = wait_idle(limited, SLOW)["engine"]
    assert after["cancelled"] - before["cancelled"] >= 3  # the two timed out, the held one
    assert after["generated_tokens"] - before["generated_tokens"] < 2 * 4000
    assert_serving(limited, SLOW)


# ---- prompt bounds before expensive work ------------------------------------------------


def test_200000_empty_messages_are_refused_before_templating(limited):
    before = stats(limited, SLOW)
    raw = json.dumps({"model": SLOW, "max_tokens": 2,
                      "messages": [{"role": "user", "content": ""}] * 200_000}).encode()
    assert len(raw) > 6_000_000
    tic = time.monotonic()
    r = post(limited, "/v1/chat/completions", raw)
    print(f"200,000 messages ({len(raw) / 1e6:.1f} MB) refused in "
          f"{time.monotonic() - tic:.3f} s")
    err = openai_error(r, 400)
    assert err["param"] == "messages" and err["code"] == "too_many_messages"
    assert "200000" in err["message"] and "4096" in err["message"]
    # Anthropic's shape on /v1/messages and its count_tokens; Responses names `input`.
    anthropic_raw = raw.replace(b'"role": "user", "content": ""',
                                b'"role": "user", "content": "x"')
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        err = anthropic_error(post(limited, path, anthropic_raw), 400)
        assert err["type"] == "invalid_request_error" and "4096" in err["message"]
    responses_raw = raw.replace(b'"messages"', b'"input"')
    err = openai_error(post(limited, "/v1/responses", responses_raw), 400)
    assert err["param"] == "input" and err["code"] == "too_many_messages"
    after = stats(limited, SLOW)
    assert after["engine"]["submitted"] == before["engine"]["submitted"]
    assert after["replica"]["prepare_runs"] == before["replica"]["prepare_runs"]
    assert_serving(limited, SLOW)


def test_max_messages_is_the_models_own_bound(limited):
    conversation = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                    for i in range(MAX_MESSAGES + 1)]
    body = {"model": ROUTED, "max_tokens": 2, "messages": conversation[:MAX_MESSAGES - 1]}
    assert post_admitted(limited, "/v1/chat/completions", body).status_code == 200
    err = openai_error(post(limited, "/v1/chat/completions",
                            {**body, "messages": conversation}), 400)
    assert err["code"] == "too_many_messages" and str(MAX_MESSAGES) in err["message"]


# ---- admission before templating ---------------------------------------------------------


def test_a_full_model_answers_429_before_templating(limited):
    """At capacity a request whose schema cannot compile gets 429, not that 400: its
    prepare stage never ran. count_tokens is admitted the same way."""
    with Held(limited, SLOW, 3):  # one running, two queued: full
        before = stats(limited, SLOW)["replica"]["prepare_runs"]
        r = post(limited, "/v1/chat/completions", chat(SLOW, response_format=BAD_SCHEMA))
        err = openai_error(r, 429)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
        r = post(limited, "/v1/messages/count_tokens", messages_body(SLOW))
        assert anthropic_error(r, 429)["type"] == "rate_limit_error"
        assert stats(limited, SLOW)["replica"]["prepare_runs"] == before
    wait_idle(limited, SLOW)
    err = openai_error(post(limited, "/v1/chat/completions",
                            chat(SLOW, response_format=BAD_SCHEMA)), 400)
    assert err["param"].startswith("response_format")  # with room, the same request: 400
    assert_serving(limited, SLOW)


def test_a_full_prefix_routed_model_answers_429_at_the_ingress_before_templating(limited):
    with Held(limited, ROUTED, 2):  # each replica's only slot (no queue)
        for body in (chat(ROUTED, response_format=BAD_SCHEMA), chat(ROUTED)):
            err = openai_error(post(limited, "/v1/chat/completions", body), 429)
            assert err["code"] == "queue_full" and "2 requests in flight" in err["message"]
        r = post(limited, "/v1/messages/count_tokens", messages_body(ROUTED))
        assert anthropic_error(r, 429)["type"] == "rate_limit_error"
    # Again after each 429 until the held streams' ends reach the ingress's count.
    r = post_admitted(limited, "/v1/chat/completions", chat(ROUTED, response_format=BAD_SCHEMA))
    assert openai_error(r, 400)["param"].startswith("response_format")
    assert_serving(limited, ROUTED)


# ---- numbers and grammars ---------------------------------------------------------------


@pytest.mark.parametrize("seed,ok", [(-1, False), (2**64, False), (10**30, False),
                                     (0, True), (2**64 - 1, True)])
def test_seeds_outside_64_bits_are_400(limited, seed, ok):
    r = post_admitted(limited, "/v1/chat/completions", chat(ROUTED, seed=seed))
    if ok:
        assert r.status_code == 200, r.text[:300]
    else:
        assert openai_error(r, 400)["param"] == "seed"


def with_huge(body: dict, field: str, digits: int = 5000) -> bytes:
    """``body`` with ``field`` set to an integer of ``digits`` digits, as JSON text."""
    return json.dumps({**body, field: "HUGE"}).replace('"HUGE"', "9" * digits).encode()


@pytest.mark.parametrize("field", ["max_tokens", "seed", "temperature", "top_logprobs"])
def test_an_integer_of_5000_digits_is_a_json_400_on_every_api(limited, field):
    err = openai_error(post(limited, "/v1/chat/completions", with_huge(chat(SLOW), field)), 400)
    assert "4300" in err["message"], err  # Python's digit limit, said in JSON
    err = anthropic_error(post(limited, "/v1/messages",
                               with_huge(messages_body(SLOW), field)), 400)
    assert err["type"] == "invalid_request_error"
    openai_error(post(limited, "/v1/responses",
                      with_huge({"model": SLOW, "input": "hi"}, field)), 400)
    # Long but convertible (4,000 digits): still a 400 naming the field, never a 500.
    r = post(limited, "/v1/chat/completions", with_huge(chat(SLOW), field, 4000))
    assert openai_error(r, 400)["param"] == field


@pytest.mark.parametrize("raw", [b'{"model": "M", "prompt": "hi", "temperature": NaN}',
                                 b'{"model": "M", "prompt": "hi", "max_tokens": Infinity}',
                                 b'{"model": "M", "prompt": "hi", "max_tokens": 1e999}'])
def test_non_finite_numbers_are_400(limited, raw):
    openai_error(post(limited, "/v1/completions", raw.replace(b"M", SLOW.encode())), 400)


def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field(limited):
    raw = json.dumps(chat(SLOW, "a\udc00b")).encode()
    err = openai_error(post(limited, "/v1/chat/completions", raw), 400)
    assert err["param"] == "messages[0].content" and err["code"] == "invalid_unicode"
    err = anthropic_error(post(limited, "/v1/messages", raw), 400)
    assert "messages[0].content" in err["message"]
    raw = b'{"model": "\\ud800", "prompt": "hi"}'  # would also be echoed in a 404
    assert openai_error(post(limited, "/v1/completions", raw), 400)["param"] == "model"


def test_a_pathological_schema_is_400_under_explicit_grammar_limits(limited):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PATHOLOGICAL}}
    tic = time.monotonic()
    r = post(limited, "/v1/chat/completions", chat(SLOW, response_format=fmt))
    print(f"pathological schema refused in {time.monotonic() - tic:.3f} s")
    err = openai_error(r, 400)
    assert err["param"] == "response_format.json_schema.schema"
    assert "too big" in err["message"], err
    assert_serving(limited, SLOW)


def test_stats_list_both_replicas_of_one_node_and_total_them(limited):
    """Two replicas on one node report to the same store: /v1/stats lists both (distinct
    pids), and the totals are their sum. The one-replica model without a cache is its
    own total, complete."""
    for _ in range(4):
        assert_serving(limited, ROUTED)
    seen: dict = {}

    def both_listed() -> dict | None:
        seen.update(wait_idle(limited, ROUTED))
        listed = [r["stats"] for r in seen["replicas"]]
        counted = sum(x["engine"]["finished"] for x in listed) >= 4
        return dict(seen) if seen["replicas_complete"] and counted else None

    s = wait_for(both_listed, lambda: f"both replicas listed: {seen.get('replicas_note')}",
                 60, interval=0.5)
    listed = [r["stats"] for r in s["replicas"]]
    assert len({r["pid"] for r in s["replicas"]}) == 2
    assert len({r["node_id"] for r in s["replicas"]}) == 1
    for key in ("submitted", "finished", "prompt_tokens", "generated_tokens"):
        assert s["engine"][key] == sum(x["engine"][key] for x in listed), key
    for key in ("lookups", "hit_tokens", "missed_tokens"):
        assert s["cache"][key] == sum(x["cache"][key] for x in listed), key
    single = stats(limited, SLOW)
    assert single["replicas_complete"] and single["replicas_expected"] == 1
    assert [r["pid"] for r in single["replicas"]] == [single["replica"]["pid"]]
