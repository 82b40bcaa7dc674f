"""Requests that arrive together with a new shared prefix, through the live server: one
prefills it, the others wait for its blocks and restore them, and every answer is the
cold one (temperature 0), on an attention-only and a hybrid (GDN) model."""

from __future__ import annotations

import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai.types.chat import ChatCompletion

from tests.support.clients import chat, openai_client
from tests.support.servers import DENSE, HYBRID

WORDS = ("alpha", "beacon", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "iris",
         "jasper", "kelp", "lumen", "maple", "nickel", "onyx", "prism", "quartz", "raven")


def inflight(server, model: str) -> tuple[int, int]:
    cache = httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()["models"][model]["cache"]
    return cache["inflight_waits"], cache["lookups"]


@pytest.mark.parametrize(("model", "chars"), [(HYBRID, 1800), (DENSE, 700)])
def test_requests_arriving_together_prefill_their_shared_prefix_once(server, model, chars):
    rng = random.Random(uuid.uuid4().int)  # a prefix no earlier test cached
    document = " ".join(rng.choice(WORDS) for _ in range(chars // 6))[:chars]
    messages = [{"role": "system", "content": document},
                {"role": "user", "content": "Summarize."}]
    client = openai_client(server, "key-one", timeout=300)
    waits_before, _ = inflight(server, model)

    def ask(_) -> ChatCompletion:
        return chat(client, model, messages, 8)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4), timeout=600))
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    # One computed the document cold (a few template tokens another test cached may be
    # restored before it), the others restored it.
    assert cached[0] < 16, cached
    assert all(c >= chars // 2 for c in cached[1:]), cached
    assert inflight(server, model)[0] - waits_before >= 1
    # Restored or cold, the same answer; and the same as a request alone, restored again.
    texts = {r.choices[0].message.content for r in replies}
    assert texts == {ask(0).choices[0].message.content}, texts
