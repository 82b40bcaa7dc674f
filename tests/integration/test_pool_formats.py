"""A model the pool unloaded restores its conversation exactly, on every weight format.

One server lists the eight embedded variants with ``memory.max_loaded_models: 1``: every
request for a model unloads the one before it (its hot blocks leave RAM for the SSD
tier). Each model first answers a conversation cold; after all eight took turns, each
answers it again, reloaded, restored from the cache: the same tokens at temperature 0,
with more than half of the prompt restored."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai.types.chat import ChatCompletion

from bench.devserver import ServerProcess
from serve_app.models.embedded import EMBEDDED_MODELS
from tests.support.clients import chat, openai_client
from tests.support.servers import serving

BS = 16
VARIANTS = sorted(n for n, spec in EMBEDDED_MODELS.items() if not spec.encoder)
MODELS = [{"name": f"fmt-{v}", "source": f"embedded:{v}", "context_length": 1024,
           "max_batch_size": 2, "max_queued_requests": 4, "cache": {"block_size": BS}}
          for v in VARIANTS]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("pool_formats")
    with serving(tmp, MODELS, model_home, generate=False,
                 cache_store={"ssd_dir": str(tmp / "kv")},
                 memory={"max_loaded_models": 1}) as proc:
        yield proc


def conversation(name: str) -> list[dict]:
    return [{"role": "system", "content": f"You are {name}, restored after an unload. " * 6},
            {"role": "user", "content": "What did you say before?"}]


def test_every_format_restores_exactly_after_an_unload(server):
    client = openai_client(server, "k")
    names = [m["name"] for m in MODELS]

    def ask(name: str) -> ChatCompletion:
        return chat(client, name, conversation(name))

    def stats() -> dict:
        return httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()

    cold = {name: ask(name) for name in names}
    tiers = {}
    for name in names:
        again = ask(name)
        prompt = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens > prompt // 2, name
        assert again.choices[0].message.content == cold[name].choices[0].message.content, name
        cache = stats()["models"][name]["cache"]  # loaded now: its service's counters
        assert cache["restore_failures"] == 0 and cache["incompatible_payloads"] == 0, name
        tiers[name] = cache["hit_tokens_by_tier"]
    # Unloading took each model's blocks out of RAM: every restore read the SSD tier.
    assert all(t.get("ssd", 0) > 0 for t in tiers.values()), tiers
    pool = stats()["pool"]["models"]
    # Every model was unloaded to make room and loaded again: nothing was restored from a
    # model that stayed in memory.
    assert all(pool[n]["unloads"]["capacity"] >= 1 and pool[n]["loads"] >= 1 for n in names)
    assert sum(1 for n in names if pool[n]["status"] == "loaded") == 1
