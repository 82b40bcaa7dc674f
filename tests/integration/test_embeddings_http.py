"""/v1/embeddings, /v1/rerank and /v1/score through ``serve run`` (issue 43): the real
``openai`` client's ``embeddings.create`` (its default base64 and plain floats) gives the
vectors the model gives in process; requests that arrive together share a model call
(Ray Serve's @serve.batch); rerank in Cohere's and Jina's shape, scores in vLLM's; bad
input is a 400 naming the input and nothing else fails; a generation model refuses
embeddings and an embedding model refuses chat; the counters reach /metrics."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from serve_app.models.embedded import materialize
from serve_app.pooling.model import PoolingModel, cosine
from serve_app.pooling.pooler import finish
from tests.support.clients import openai_client
from tests.support.servers import serving

MODELS = [
    {"name": "bert", "source": "embedded:tiny-bert", "pooling": {"max_inputs": 64}},
    {"name": "qwen-embed", "source": "embedded:tiny-dense", "task": "embed",
     "pooling": {"matryoshka": True}},
    {"name": "cross", "source": "embedded:tiny-bert-rerank"},
    {"name": "qwen-rerank", "source": "embedded:tiny-dense", "task": "rerank"},
    {"name": "chat", "source": "embedded:tiny-dense", "max_tokens": 8},
    {"name": "xlmr", "source": "embedded:tiny-xlmr"},
    {"name": "xlmr-rerank", "source": "embedded:tiny-xlmr-rerank"},
    # one request a model call, each waiting 50 ms for company, one more queued at most
    {"name": "narrow", "source": "embedded:tiny-bert", "max_queued_requests": 1,
     "pooling": {"max_batch_size": 1, "batch_wait_timeout_s": 0.05}},
]
TEXTS = ["hello world", "a", "the quick brown fox " * 5]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home):
    with serving(tmp_path_factory.mktemp("embed"), MODELS, model_home, generate=False) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def local(name: str, model_home, task: str = "embed") -> PoolingModel:
    return PoolingModel(materialize(name, model_home), task)  # type: ignore[arg-type]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_openai_client_embeddings_equal_the_model_in_process(client, model_home):
    model = local("tiny-bert", model_home)
    expected = finish(model.embed([model.encode(t) for t in TEXTS]), model.pooling, None)
    got = client.embeddings.create(model="bert", input=TEXTS)  # the client asks for base64
    assert [d.index for d in got.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in got.data], np.float32)
    assert np.array_equal(vectors, expected)
    assert got.usage.prompt_tokens == sum(len(model.encode(t).ids) for t in TEXTS)
    floats = client.embeddings.create(model="bert", input="hello world",
                                      encoding_format="float")
    assert np.array_equal(np.array(floats.data[0].embedding, np.float32), expected[0])


def test_token_ids_and_a_decoder_with_matryoshka_cuts(client, model_home):
    one = client.embeddings.create(model="qwen-embed", input=[[40, 41, 42], [50]])
    full = len(one.data[0].embedding)
    cut = client.embeddings.create(model="qwen-embed", input=[[40, 41, 42]], dimensions=16)
    v = np.array(cut.data[0].embedding)
    assert v.shape == (16,) and abs(np.linalg.norm(v) - 1) < 1e-5
    assert cosine(v, np.array(one.data[0].embedding)[:16]) > 0.99999
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="qwen-embed", input="x", dimensions=full + 1)
    with pytest.raises(openai.BadRequestError, match="not trained to be cut"):
        client.embeddings.create(model="bert", input="x", dimensions=8)


def test_requests_arriving_together_share_model_calls(server, client):
    before = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()[
        "models"]["bert"]["pooling"]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: client.embeddings.create(
            model="bert", input=f"sentence number {i}", encoding_format="float"), range(32)))
    after = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()[
        "models"]["bert"]["pooling"]
    assert all(len(a.data) == 1 for a in answers)
    assert after["requests"] - before["requests"] == 32
    assert after["batches"] - before["batches"] < 32  # some calls took several requests


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_in_cohere_and_jina_shape(server, model_home, path):
    docs = ["x is a letter", "bananas are yellow", {"text": "the letter x"}]
    r = post(server, path, {"model": "cross", "query": "what is x", "documents": docs,
                            "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    model = local("tiny-bert-rerank", model_home, "rerank")
    texts = ["x is a letter", "bananas are yellow", "the letter x"]
    scores = model.scores([model.encode_pair("what is x", t) for t in texts])
    order = list(np.argsort(-scores)[:2])
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert abs(x["relevance_score"] - scores[x["index"]]) < 1e-6
        assert x["document"]["text"] == texts[x["index"]]
    assert body["usage"]["total_tokens"] > 0


def test_xlm_roberta_embeds_and_reranks_as_in_process(server, client, model_home):
    model = local("tiny-xlmr", model_home)
    expected = finish(model.embed([model.encode(t) for t in TEXTS]), model.pooling, None)
    got = client.embeddings.create(model="xlmr", input=TEXTS, encoding_format="float")
    assert np.array_equal(np.array([d.embedding for d in got.data], np.float32), expected)
    reranker = local("tiny-xlmr-rerank", model_home, "rerank")
    docs = ["x is a letter", "red"]
    scores = reranker.scores([reranker.encode_pair("what is x", d) for d in docs])
    body = post(server, "/v1/rerank", {"model": "xlmr-rerank", "query": "what is x",
                                       "documents": docs}).json()
    assert {x["index"]: x["relevance_score"] for x in body["results"]} == pytest.approx(
        dict(enumerate(scores.tolist())), abs=1e-6)


def test_score_pairs_and_a_decoder_reranker(server):
    r = post(server, "/v1/score", {"model": "qwen-rerank", "text_1": "what is x",
                                   "text_2": ["x is a letter", "red"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and all(0 <= d["score"] <= 1 for d in data)
    again = post(server, "/v1/rerank", {"model": "qwen-rerank", "query": "what is x",
                                        "documents": ["red", "x is a letter"],
                                        "return_documents": False}).json()
    by_doc = {x["index"]: x["relevance_score"] for x in again["results"]}
    assert abs(by_doc[1] - data[0]["score"]) < 1e-5 and "document" not in again["results"][0]


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/embeddings", {"model": "bert", "input": ["ok", "x " * 300]}, 400,
     "input\\[1\\] has .* over the model's limit of 128"),
    ("/v1/embeddings", {"model": "bert", "input": []}, 400, "input: must not be empty"),
    ("/v1/embeddings", {"model": "bert", "input": ["ok", ""]}, 400, "input\\[1\\]"),
    ("/v1/embeddings", {"model": "bert", "input": ["x"] * 65}, 400, "max_inputs"),
    ("/v1/embeddings", {"model": "bert", "input": [[1, 99999]]}, 400, "vocabulary"),
    ("/v1/embeddings", {"model": "bert", "input": "x", "encoding_format": "int8"}, 400,
     "encoding_format"),
    ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "does not exist"),
    ("/v1/embeddings", {"model": "chat", "input": "x"}, 400, "generate model"),
    ("/v1/rerank", {"model": "bert", "query": "q", "documents": ["d"]}, 400,
     "embed model, not a rerank model"),
    ("/v1/score", {"model": "cross", "text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_1"),
    ("/v1/chat/completions", {"model": "bert", "messages": [
        {"role": "user", "content": "hi"}]}, 400, "embed model: it answers /v1/embeddings"),
])
def test_bad_requests_are_clear_errors_and_lose_nothing(server, client, path, body, status,
                                                        words):
    import re

    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert re.search(words, r.json()["error"]["message"]), r.json()
    assert len(client.embeddings.create(model="bert", input="still fine").data) == 1


def test_a_full_model_answers_429_and_the_rest_are_served(server):
    """32 requests at once where 4 run and 1 waits: Ray Serve refuses the others, each a
    429 with Retry-After; every request gets one or the other."""
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda i: post(server, "/v1/embeddings", {
            "model": "narrow", "input": f"sentence {i}"}), range(32)))
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.headers.get("retry-after") and \
        refused.json()["error"]["code"] == "queue_full"
    assert post(server, "/v1/embeddings", {"model": "narrow", "input": "x"}).status_code == 200


def test_truncate_cuts_instead_of_refusing(server):
    r = post(server, "/v1/embeddings", {"model": "bert", "input": "x " * 300,
                                        "truncate": True, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    assert vector.shape == (64,) and r.json()["usage"]["prompt_tokens"] == 128


def test_counters_and_models_list(server):
    text = httpx.get(f"{server.base_url}/metrics", timeout=60).text
    assert 'serve_app_pooling_inputs_total{' in text and 'task="embed"' in text
    assert "serve_app_pooling_batch_seconds_bucket" in text
    health = httpx.get(f"{server.base_url}/health", timeout=60)
    assert health.status_code == 200
    models = {m["id"]: m for m in httpx.get(f"{server.base_url}/v1/models",
                                            timeout=60).json()["data"]}
    assert {n: m["task"] for n, m in models.items()} == {
        "bert": "embed", "qwen-embed": "embed", "cross": "rerank", "qwen-rerank": "rerank",
        "chat": "generate", "xlmr": "embed", "xlmr-rerank": "rerank", "narrow": "embed"}
    status = httpx.get(f"{server.base_url}/v1/status", timeout=60).json()["models"]
    assert status["cross"]["pooling"]["task"] == "rerank" and "engine" not in status["cross"]
