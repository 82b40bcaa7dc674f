"""The status page of a vision model in a real headless Chromium: the model's badge says it
takes images, and its image figures (encoded, from the feature cache, from the prefix
cache) follow requests and equal /v1/status."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.browser import browser_missing, open_page
from tests.support.clients import openai_client
from tests.support.images import image_part
from tests.support.servers import serving, wait_for

pytestmark = pytest.mark.skipif(browser_missing() is not None,
                                reason=browser_missing() or "")

MODEL = "page-vl"
MODELS = [{"name": MODEL, "source": "embedded:tiny-vl", "context_length": 1024,
           "max_tokens": 32, "cache": {"block_size": 16}}]


def test_a_vision_model_shows_its_images(tmp_path, model_home):
    with serving(tmp_path, MODELS, model_home, cache_store={"ssd_dir": str(tmp_path / "kv")}) \
            as server:
        client = openai_client(server)
        for text in ("What is this?", "And now?"):  # the same image: encoded once
            client.chat.completions.create(
                model=MODEL, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": [{"type": "text", "text": text},
                                                       image_part(3)]}])
        with open_page(f"{server.base_url}/") as bp:
            card = f'.model[data-model="{MODEL}"]'
            bp.page.wait_for_selector(f'{card} [data-role="vision"]')
            assert bp.page.inner_text(f'{card} [data-role="vision"]') == "takes images"

            def shown(field: str) -> int | None:
                path = json.dumps(["models", MODEL, "images", field]).replace(" ", "")
                spans = bp.page.locator(f"{card} span[data-path]")
                for i in range(spans.count()):
                    span = spans.nth(i)
                    if span.get_attribute("data-path").replace(" ", "") == path:
                        return json.loads(span.get_attribute("data-value"))
                return None

            wait_for(lambda: shown("encoded") == 1 and shown("from_feature_cache") == 1,
                     "the page to show 1 image encoded and 1 from the feature cache", 30)
            status = httpx.get(f"{server.base_url}/v1/status", timeout=60).json()
            images = status["models"][MODEL]["images"]
            assert shown("from_prefix_cache") == images["from_prefix_cache"]
            assert not bp.console_errors, bp.console_errors
