"""The status page of an embedding and a rerank model in a real headless Chromium: each
card says what the model does and its figures (requests, inputs, model calls) follow
requests and equal /v1/status, with no engine figures asked of them."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.browser import browser_missing, open_page
from tests.support.clients import openai_client
from tests.support.servers import serving, wait_for

pytestmark = pytest.mark.skipif(browser_missing() is not None,
                                reason=browser_missing() or "")

MODELS = [{"name": "page-embed", "source": "embedded:tiny-bert"},
          {"name": "page-rerank", "source": "embedded:tiny-bert-rerank"}]


def test_embedding_and_rerank_models_show_their_work(tmp_path, model_home):
    with serving(tmp_path, MODELS, model_home, generate=False) as server:
        openai_client(server).embeddings.create(model="page-embed", input=["a", "b", "c"])
        httpx.post(f"{server.base_url}/v1/rerank", timeout=60, json={
            "model": "page-rerank", "query": "q", "documents": ["x", "y"]}).raise_for_status()
        with open_page(f"{server.base_url}/") as bp:
            for name, says in (("page-embed", "embeds"), ("page-rerank", "reranks")):
                card = f'.model[data-model="{name}"]'
                bp.page.wait_for_selector(f'{card} [data-role="task"]')
                assert bp.page.inner_text(f'{card} [data-role="task"]') == says

            def shown(name: str, field: str) -> int | None:
                path = json.dumps(["models", name, "pooling", field]).replace(" ", "")
                spans = bp.page.locator(f'.model[data-model="{name}"] span[data-path]')
                for i in range(spans.count()):
                    span = spans.nth(i)
                    if span.get_attribute("data-path").replace(" ", "") == path:
                        return json.loads(span.get_attribute("data-value"))
                return None

            wait_for(lambda: shown("page-embed", "inputs") == 3
                     and shown("page-rerank", "inputs") == 2,
                     "the page to show 3 inputs embedded and 2 documents scored", 30)
            status = httpx.get(f"{server.base_url}/v1/status", timeout=60).json()
            assert shown("page-embed", "requests") == \
                status["models"]["page-embed"]["pooling"]["requests"] == 1
            assert not bp.console_errors, bp.console_errors
