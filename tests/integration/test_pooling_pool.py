"""Embedding and rerank models in the model pool (issue 43): with room for one model, an
embedding model, a rerank model and a chat model take turns (each request loads its model,
unloading the one before); an embedding model unloads after its idle time and answers the
same vectors when loaded again."""

from __future__ import annotations

import httpx
import numpy as np

from tests.support.clients import chat, openai_client
from tests.support.servers import serving, wait_for

MODELS = [
    {"name": "p-embed", "source": "embedded:tiny-bert", "idle_unload_s": 3},
    {"name": "p-rerank", "source": "embedded:tiny-bert-rerank"},
    {"name": "p-chat", "source": "embedded:tiny-dense", "max_tokens": 4},
]


def statuses(server) -> dict[str, str]:
    r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    return {m["id"]: m["status"] for m in r.json()["data"]}


def test_embedding_models_take_turns_in_the_pool(tmp_path, model_home):
    with serving(tmp_path, MODELS, model_home, generate=False,
                 memory={"max_loaded_models": 1}) as server:
        client = openai_client(server)
        first = np.array(client.embeddings.create(model="p-embed", input="hello",
                                                  encoding_format="float").data[0].embedding)
        assert statuses(server)["p-embed"] == "loaded"
        r = httpx.post(f"{server.base_url}/v1/rerank", timeout=120, json={
            "model": "p-rerank", "query": "q", "documents": ["a", "b"]})
        assert r.status_code == 200, r.text
        assert statuses(server) == {"p-embed": "unloaded", "p-rerank": "loaded",
                                    "p-chat": "unloaded"}
        assert chat(client, "p-chat", [{"role": "user", "content": "hi"}], 2).choices
        assert statuses(server)["p-rerank"] == "unloaded"
        again = np.array(client.embeddings.create(model="p-embed", input="hello",
                                                  encoding_format="float").data[0].embedding)
        assert np.array_equal(first, again)  # loaded again: the same vectors
        wait_for(lambda: statuses(server)["p-embed"] == "unloaded",
                 "the embedding model to unload after 3 s idle", 30)
        replica = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()[
            "models"]["p-embed"]["replica"]
        assert replica["loads"] >= 1 and replica["unloads"]["idle"] >= 1
