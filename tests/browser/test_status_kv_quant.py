"""The status page of a model with quantized K/V in a real headless Chromium: its card
shows the K/V's format and bytes a token, the figures /v1/status and /v1/stats give."""

from __future__ import annotations

import httpx
import pytest

from bench.browser import browser_missing, open_page
from tests.support.servers import serving

pytestmark = pytest.mark.skipif(browser_missing() is not None,
                                reason=browser_missing() or "")

MODEL = "page-q8"
MODELS = [{"name": MODEL, "source": "embedded:tiny-dense", "context_length": 512,
           "max_tokens": 16, "kv_cache": {"bits": 8, "group_size": 32}}]


def test_a_model_with_quantized_kv_shows_its_format_and_bytes(tmp_path, model_home):
    with serving(tmp_path, MODELS, model_home) as server:
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()
        kv = stats["models"][MODEL]["kv_cache"]
        assert kv["kv_format"] == "q8g32"
        assert 0 < kv["kv_bytes_per_token"] < 0.4 * kv["float_kv_bytes_per_token"]
        with open_page(f"{server.base_url}/") as bp:
            card = f'.model[data-model="{MODEL}"]'
            bp.page.wait_for_selector(f'{card} [data-role="kv-format"]')
            assert bp.page.inner_text(f'{card} [data-role="kv-format"]') == "q8g32"
            assert not bp.console_errors, bp.console_errors
