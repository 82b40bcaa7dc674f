"""The memory plan over real HTTP (``serve run``, the ``openai`` client): ``/v1/models``'
status and planned footprint, KV admission (requests wait for KV, one that could never fit
is 429), ``/v1/stats``' plan per node and the memory metrics.

The server's ``memory.budget`` is the model's weights + the hot tier + the KV of two
256-token requests, so the plan's KV budget for the model is exactly two such requests."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from serve_app.config.profile import parse_profile
from serve_app.memory.plan import MiB
from serve_app.memory.planning import plan_profile
from serve_app.memory.shapes import KV_STEP_TOKENS
from tests.support.clients import openai_client
from tests.support.servers import serving, wait_for

MODEL = "tiny-admitted"
HOT = 64 * MiB
MODELS = [{"name": MODEL, "source": "embedded:tiny-dense", "context_length": 1024,
           "max_batch_size": 8, "max_queued_requests": 16, "max_tokens": 1000,
           "cache": {"block_size": 16}}]


@pytest.fixture(scope="module")
def planned(model_home):
    """The plan without the budget, to size the budget from: weights and KV per token."""
    plan = plan_profile(parse_profile({"models": MODELS,
                                       "cache_store": {"hot_budget": HOT, "ssd": False}}))
    (m,) = plan.models
    return m


@pytest.fixture(scope="module")
def budget(planned) -> int:
    two_requests = 2 * planned.shape.kv_bytes_per_token * KV_STEP_TOKENS
    return planned.weights_bytes + HOT + two_requests


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home, budget):
    with serving(tmp_path_factory.mktemp("memory_server"), MODELS, model_home,
                 cache_store={"hot_budget": HOT, "ssd": False},
                 memory={"budget": budget}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server)


def stats(server) -> dict:
    r = httpx.get(f"{server.base_url}/v1/stats", timeout=30)
    r.raise_for_status()
    return r.json()


def test_models_show_status_and_planned_memory(server, planned):
    r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    (entry,) = r.json()["data"]
    assert entry["status"] == "loaded"
    # weights + KV of a full batch at full context (8 x 1024 tokens) + the hot tier (one model)
    assert entry["memory_bytes"] == planned.weights_bytes + planned.kv_bytes + HOT
    assert planned.kv_bytes == 8 * 1024 * planned.shape.kv_bytes_per_token
    one = httpx.get(f"{server.base_url}/v1/models/{MODEL}", timeout=30).json()
    assert one["status"] == "loaded" and one["memory_bytes"] == entry["memory_bytes"]


def test_requests_wait_for_kv_and_all_are_served(client, server, planned):
    """Six at once, each reserving 256 tokens of KV, with a budget of two: the engine runs
    at most two together, the others wait (none refused), and all six are answered."""
    before = stats(server)["models"][MODEL]["engine"]

    def ask(i: int) -> str | None:
        r = client.completions.create(model=MODEL, prompt=f"count {i}: one two three",
                                      max_tokens=200, temperature=0)
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(6) as pool:
        reasons = list(pool.map(ask, range(6), timeout=300))
    assert all(r in ("stop", "length") for r in reasons)
    engine = stats(server)["models"][MODEL]["engine"]
    assert engine["peak_batch_size"] <= 2
    assert engine["kv_waited"] > before["kv_waited"]
    assert engine["kv_rejected"] == before["kv_rejected"]
    assert engine["kv_in_use_bytes"] == 0 and engine["kv_waiting"] == 0


def test_a_request_that_could_never_fit_is_429(client, server):
    """max_tokens 600: three 256-token steps of KV, more than the whole budget of two."""
    before = stats(server)["models"][MODEL]["engine"]["kv_rejected"]
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="too long an answer", max_tokens=600)
    err = caught.value
    assert err.response.headers["retry-after"]
    assert err.code == "kv_budget_exceeded"
    assert "KV budget" in err.message
    # the same prompt with a max_tokens that fits is served
    ok = client.completions.create(model=MODEL, prompt="too long an answer", max_tokens=100)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert stats(server)["models"][MODEL]["engine"]["kv_rejected"] == before + 1


def test_stats_show_the_plan_per_node(server, budget, planned):
    memory = stats(server)["memory"]
    assert memory["plan"]["budget_bytes"] == budget
    assert memory["plan"]["advisory"] is True  # this machine has no Metal GPU
    (node,) = memory["nodes"].values()
    assert node["budget_bytes"] == budget
    assert node["advisory"] is True and node["wired_limit_bytes"] is None
    assert node["hot_bytes"] == HOT
    two = 2 * planned.shape.kv_bytes_per_token * KV_STEP_TOKENS
    assert node["planned_bytes"] == planned.weights_bytes + two + HOT == budget
    (replica,) = node["models"][MODEL]
    assert replica["kv_budget_bytes"] == two
    assert replica["planned"]["weights_bytes"] == planned.weights_bytes
    assert replica["wired_limit_bytes"] is None and replica["cache_limit_bytes"] is None


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_show_memory_by_kind(client, server, planned):
    two = 2 * planned.shape.kv_bytes_per_token * KV_STEP_TOKENS
    with pytest.raises(openai.RateLimitError):  # one refused for its KV, counted
        client.completions.create(model=MODEL, prompt="never fits", max_tokens=600)
    rejected = stats(server)["models"][MODEL]["engine"]["kv_rejected"]
    want = (two, planned.weights_bytes, rejected)
    seen: list = [None, ""]

    def exported() -> str | None:
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        seen[:] = [(metric(text, "ray_serve_app_memory_bytes", model=MODEL, kind="kv_budget"),
                    metric(text, "ray_serve_app_memory_bytes", model=MODEL, kind="weights"),
                    metric(text, "ray_serve_app_rejected_requests_total", model=MODEL,
                           reason="kv_budget")), text]
        return text if seen[0] == want else None

    text = wait_for(exported, lambda: f"(kv budget, weights, rejected) {want} in /metrics: "
                    f"{seen[0]}", 60, interval=1)
    assert metric(text, "ray_serve_app_memory_bytes", model=MODEL, kind="wired_limit") is None
