"""The status page in a real headless Chromium (playwright driving Debian's chromium) against
`serve run` with two models and API keys on: it asks for a key, then shows both models with
their phases; every figure on it equals the same path in /v1/stats; its figures follow
requests; its buttons unload, load, pin, clear a model's cache (exactly: the answer after a
clear is the cached one) and run the self-benchmark; without a key its controls are refused,
and with admin keys set a tenant's key is refused them too (the page asks for an admin key).
A screenshot of each state is kept in ``screenshot_dir()`` (a test artifact)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from bench.browser import BrowserPage, browser_missing, open_page, screenshot_dir
from bench.devserver import ServerProcess, free_port, write_config
from serve_app.config import api_keys
from tests.support.clients import cached, chat, openai_client, user
from tests.support.clients import text as text_of
from tests.support.servers import running, wait_for

pytestmark = pytest.mark.skipif(browser_missing() is not None,
                                reason=browser_missing() or "")

KEY = "sk-status-page-test-key-5c1e9a7b3d2f4e6a"  # an admin key: everything
USER = "sk-status-page-tenant-key-8a7b6c5d4e3f2a1b"  # a tenant's: no controls
WRONG = "sk-status-page-not-a-key-0000000000000"
DENSE = "page-dense"
HYBRID = "page-hybrid"
MODELS = [
    {"name": DENSE, "source": "embedded:tiny-dense", "context_length": 1024,
     "max_tokens": 64, "cache": {"block_size": 16}},
    {"name": HYBRID, "source": "embedded:tiny-hybrid", "context_length": 1024,
     "max_tokens": 64, "cache": {"block_size": 16}},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_home):
    tmp = tmp_path_factory.mktemp("status-page")
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, MODELS,
                          cache_store={"ssd_dir": str(tmp / "kv")},
                          memory={"max_loaded_models": 2})
    env = {"SERVE_APP_HOME": str(model_home), api_keys.ENV_VAR: USER,
           api_keys.ADMIN_ENV_VAR: KEY}
    with running(ServerProcess.serve_run(config, port, tmp / "serve.log", env=env, api_key=KEY),
                 [m["name"] for m in MODELS]) as proc:
        yield proc


def get(server: ServerProcess, path: str, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.base_url}{path}", headers={**headers, **kw.pop("headers", {})},
                     timeout=60, **kw)


def post(server: ServerProcess, path: str, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{path}", headers={**headers, **kw.pop("headers", {})},
                      timeout=120, **kw)


def at(value: Any, path: list) -> Any:
    for part in path:
        if isinstance(value, list) and isinstance(part, int) and part < len(value):
            value = value[part]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def figures(bp: BrowserPage) -> list[tuple[list, Any, bool]]:
    """Every figure on the page: its path in /v1/stats, its value, whether it is volatile."""
    return bp.page.eval_on_selector_all(
        "[data-path]", "els => els.map(e => [JSON.parse(e.dataset.path), "
                       "JSON.parse(e.dataset.value), e.hasAttribute('data-volatile')])")


def mismatches(bp: BrowserPage, server: ServerProcess) -> list[str]:
    """The page's figures that differ from /v1/stats read now (volatile ones: present in
    both, of the same kind)."""
    stats = get(server, "/v1/stats").json()
    out = []
    for path, value, volatile in figures(bp):
        want = at(stats, path)
        if volatile:
            if type(want) is not type(value):
                out.append(f"{path}: page {value!r}, /v1/stats {want!r}")
        elif want != value:
            out.append(f"{path}: page {value!r}, /v1/stats {want!r}")
    return out


def agrees_with_stats(bp: BrowserPage, server: ServerProcess) -> None:
    """Every figure equals /v1/stats once the page has refreshed (it does every 2 s)."""
    last: list[str] = []

    def same() -> bool:
        last[:] = mismatches(bp, server)
        return not last

    try:
        wait_for(same, "the page's figures to equal /v1/stats", 20)
    except AssertionError:
        raise AssertionError("page vs /v1/stats:\n" + "\n".join(last)) from None


def with_key(bp: BrowserPage, key: str = KEY) -> None:
    """Enter ``key`` in the page's form, as a person does."""
    bp.page.wait_for_selector("#key-form:not([hidden])")
    bp.page.fill("#key", key)
    bp.page.click("#key-form button[type=submit]")


def shown(bp: BrowserPage, model: str, role: str) -> str:
    return bp.page.inner_text(f'.model[data-model="{model}"] [data-role="{role}"]')


def button(bp: BrowserPage, model: str, action: str):
    return bp.page.locator(f'.model[data-model="{model}"] button[data-action="{action}"]')


def model_status(server: ServerProcess, model: str) -> str:
    return get(server, f"/v1/models/{model}").json()["status"]


def ask(server: ServerProcess, model: str, prompt: str) -> tuple[str, int]:
    """A greedy answer and its cached prompt tokens."""
    r = chat(openai_client(server, KEY), model, user(prompt), 16)
    return text_of(r) or "", cached(r)


def shot(bp: BrowserPage, name: str) -> None:
    bp.page.set_viewport_size({"width": 1400, "height": 1000})
    bp.page.screenshot(path=str(screenshot_dir() / name), full_page=True)


# ---- the tests ------------------------------------------------------------------------------


def test_page_asks_for_a_key_then_shows_both_models(served):
    with open_page(f"{served.base_url}/") as bp:
        wait_for(lambda: bp.page.is_visible("#key-form"), "the key form")
        assert "needs an API key" in bp.page.inner_text("#notice")
        assert bp.page.locator("[data-model]").count() == 0  # no data before a key
        with_key(bp)
        bp.page.wait_for_selector(f'.model[data-model="{HYBRID}"]')
        for name in (DENSE, HYBRID):
            assert shown(bp, name, "phase") == "ready"
            assert shown(bp, name, "pool-status") == "loaded"
        assert bp.page.is_hidden("#key-form")
        agrees_with_stats(bp, served)
        shot(bp, "status-page.png")
        assert bp.console_errors == []


def test_figures_follow_requests(served):
    text = "Tell me about the status page of this server, in a few words. " * 3
    with open_page(f"{served.base_url}/") as bp:
        with_key(bp)
        bp.page.wait_for_selector(f'.model[data-model="{DENSE}"]')
        agrees_with_stats(bp, served)
        before = get(served, "/v1/stats").json()["models"][DENSE]
        first, _ = ask(served, DENSE, text)
        again, cached = ask(served, DENSE, text)
        assert again == first and cached > 0
        after = get(served, "/v1/stats").json()["models"][DENSE]
        # At least these two (the replica's stats may count an earlier request late).
        assert after["engine"]["finished"] >= before["engine"]["finished"] + 2
        assert after["cache"]["hit_tokens"] > before["cache"]["hit_tokens"]
        assert after["recent"]["requests"] >= 2 and after["recent"]["ttft_mean_s"] > 0

        def updated() -> bool:
            page = {tuple(p): v for p, v, _ in figures(bp)}
            m = ("models", DENSE)
            return (page.get((*m, "engine", "finished")) == after["engine"]["finished"]
                    and page.get((*m, "cache", "hit_rate")) == after["cache"]["hit_rate"]
                    and (page.get((*m, "recent", "requests")) or 0) >= 2)

        wait_for(updated, "the page to show the new requests")
        agrees_with_stats(bp, served)
        assert bp.console_errors == []


def test_unload_load_and_pin_from_the_page(served):
    with open_page(f"{served.base_url}/") as bp:
        bp.page.on("dialog", lambda d: d.accept())
        with_key(bp)
        bp.page.wait_for_selector(f'.model[data-model="{DENSE}"]')
        button(bp, DENSE, "unload").click()
        wait_for(lambda: shown(bp, DENSE, "pool-status") == "unloaded", "unloaded on the page")
        assert model_status(served, DENSE) == "unloaded"
        assert model_status(served, HYBRID) == "loaded"
        agrees_with_stats(bp, served)
        shot(bp, "status-page-unloaded.png")

        button(bp, DENSE, "load").click()
        wait_for(lambda: shown(bp, DENSE, "pool-status") == "loaded", "loaded on the page")
        assert model_status(served, DENSE) == "loaded"

        button(bp, DENSE, "pin").click()
        wait_for(lambda: button(bp, DENSE, "unpin").count() == 1, "the pin on the page")
        assert get(served, "/v1/stats").json()["pool"]["models"][DENSE]["pinned"] is True
        assert button(bp, DENSE, "unload").is_disabled()
        refused = post(served, f"/admin/models/{DENSE}/unload")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "model_pinned"
        button(bp, DENSE, "unpin").click()
        wait_for(lambda: button(bp, DENSE, "pin").count() == 1, "the pin gone from the page")
        assert get(served, "/v1/stats").json()["pool"]["models"][DENSE]["pinned"] is False
        assert bp.console_errors == []


def test_cache_clear_from_the_page_is_exact(served):
    text = "A conversation whose prefix the page is about to clear from every tier. " * 4
    cold, _ = ask(served, HYBRID, text)
    warm, cached = ask(served, HYBRID, text)
    assert warm == cold and cached > 0
    with open_page(f"{served.base_url}/") as bp:
        bp.page.on("dialog", lambda d: d.accept())
        with_key(bp)
        bp.page.wait_for_selector(f'.model[data-model="{HYBRID}"]')
        with bp.page.expect_response(re.compile(r".*/cache/clear$")) as response:
            button(bp, HYBRID, "clear-cache").click()
        cleared = response.value.json()["cleared"]
        assert response.value.status == 200
        assert cleared["hot_blocks"] + cleared["ssd_files"] > 0
        wait_for(lambda: "done" in bp.page.inner_text("#notice"), "the page to say done")
        assert bp.console_errors == []
    after, cached_after = ask(served, HYBRID, text)
    assert cached_after == 0  # nothing left to restore: a cold prefill
    assert after == cold  # and the same tokens as the first cold answer


def test_self_benchmark_from_the_page(served):
    with open_page(f"{served.base_url}/") as bp:
        with_key(bp)
        bp.page.wait_for_selector(f'.model[data-model="{HYBRID}"]')
        bp.page.select_option("#bench-model", HYBRID)
        bp.page.click("#bench-run")
        row = f'#bench tr[data-model="{HYBRID}"]'
        bp.page.wait_for_selector(row, timeout=120_000)
        bench = get(served, "/v1/stats").json()["benchmarks"][HYBRID]
        assert bench["ssd"]["write_bytes_per_s"] > 0 and bench["ssd"]["read_bytes_per_s"] > 0
        assert bench["model_speed"]["prompt_tokens"] == 512
        assert bench["model_speed"]["decode_tokens"] == 127  # 128 tokens: 127 after the first
        assert bench["model_speed"]["decode_tokens_per_s"] > 0
        agrees_with_stats(bp, served)
        shot(bp, "status-page-benchmark.png")
        assert bp.console_errors == []


def test_errors_show_on_the_page(served):
    missing = post(served, "/v1/chat/completions",
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 404
    bad = post(served, "/v1/chat/completions",
               json={"model": DENSE, "messages": [{"role": "user", "content": "secret words"}],
                     "temperature": "hot"})
    assert bad.status_code == 400
    with open_page(f"{served.base_url}/") as bp:
        with_key(bp)
        bp.page.wait_for_selector("#errors table")
        errors = bp.page.inner_text("#errors")
        assert "model_not_found" in errors  # its code; not its message, which names
        assert "no-such-model" not in errors  # what the body asked for
        assert "not kept" in errors and "secret words" not in errors
        agrees_with_stats(bp, served)
        assert bp.console_errors == []


def test_controls_refuse_without_a_key(served):
    for path in (f"/admin/models/{DENSE}/unload", f"/admin/models/{DENSE}/pin",
                 f"/admin/models/{DENSE}/cache/clear", "/admin/benchmark"):
        for key in (None, WRONG):
            r = post(served, path, key=key)
            assert r.status_code == 401, (path, key, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert model_status(served, DENSE) == "loaded"  # nothing changed
    assert get(served, "/v1/status", key=None).status_code == 401
    assert get(served, "/", key=None).status_code == 401  # the JSON index needs a key
    page = get(served, "/", key=None, headers={"Accept": "text/html,*/*"})
    assert page.status_code == 200 and 'content="on"' in page.text  # the page has no data
    assert get(served, "/status/status.js", key=None).status_code == 200
    # No state changes on a GET, nor from another site's page, nor for unknown models.
    assert get(served, f"/admin/models/{DENSE}/unload").status_code == 405
    evil = post(served, f"/admin/models/{DENSE}/unload",
                headers={"Origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "cross_origin"
    assert post(served, "/admin/models/nope/unload").status_code == 404
    bad = post(served, "/admin/benchmark", json={"ssd_bytes": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ssd_bytes"
    assert model_status(served, DENSE) == "loaded"

    with open_page(f"{served.base_url}/") as bp:  # a refused key: no data, no controls
        with_key(bp, WRONG)
        wait_for(lambda: "refused" in bp.page.inner_text("#notice"), "the refusal")
        assert bp.page.locator("button[data-action]").count() == 0
        # Chromium logs the refused fetch itself as a console error: nothing else.
        assert all("401" in e for e in bp.console_errors), bp.console_errors


def test_controls_need_an_admin_key(served):
    """With admin keys set, a tenant's key reads the status and is answered, but every
    control refuses it (403 ``admin_key_required``) and nothing changes; on the page its
    click asks for an admin key with the data still shown; the admin key then does it."""
    tenant = openai_client(served, USER)
    assert tenant.chat.completions.create(model=DENSE, max_tokens=4, messages=[
        {"role": "user", "content": "hello"}]).choices[0].message.content is not None
    assert get(served, "/v1/status", key=USER).status_code == 200
    assert get(served, "/v1/stats", key=USER).json()["server"]["admin_keys"] is True
    text = "A prefix the tenant's refused cache clear must leave in place. " * 4
    ask(served, HYBRID, text)

    def refused(path: str) -> None:
        r = post(served, path, key=USER)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "admin_key_required", r.text

    def pool(model: str) -> dict:
        return get(served, "/v1/stats").json()["pool"]["models"][model]

    refused(f"/admin/models/{DENSE}/unload")
    assert model_status(served, DENSE) == "loaded"
    refused(f"/admin/models/{DENSE}/pin")
    assert pool(DENSE)["pinned"] is False
    assert post(served, f"/admin/models/{DENSE}/pin").status_code == 200  # the admin's
    refused(f"/admin/models/{DENSE}/unpin")
    assert pool(DENSE)["pinned"] is True
    assert post(served, f"/admin/models/{DENSE}/unpin").status_code == 200
    assert post(served, f"/admin/models/{DENSE}/unload").status_code == 200
    refused(f"/admin/models/{DENSE}/load")
    assert model_status(served, DENSE) == "unloaded"
    assert post(served, f"/admin/models/{DENSE}/load").status_code == 200
    refused(f"/admin/models/{HYBRID}/cache/clear")
    assert ask(served, HYBRID, text)[1] > 0  # still cached
    benchmarks = get(served, "/v1/stats").json()["benchmarks"]
    refused("/admin/benchmark")
    assert get(served, "/v1/stats").json()["benchmarks"] == benchmarks

    with open_page(f"{served.base_url}/") as bp:
        bp.page.on("dialog", lambda d: d.accept())
        with_key(bp, USER)
        bp.page.wait_for_selector(f'.model[data-model="{DENSE}"]')
        button(bp, DENSE, "unload").click()
        wait_for(lambda: "needs an admin key" in bp.page.inner_text("#notice"),
                 "the page to ask for an admin key")
        assert bp.page.is_visible("#key-form")
        bp.page.wait_for_timeout(2500)  # a refresh later: still asking, the data still shown
        assert "needs an admin key" in bp.page.inner_text("#notice")
        assert bp.page.locator(".model[data-model]").count() == 2
        assert model_status(served, DENSE) == "loaded"
        with_key(bp, KEY)
        wait_for(lambda: bp.page.is_hidden("#key-form"), "the admin key taken")
        button(bp, DENSE, "unload").click()
        wait_for(lambda: shown(bp, DENSE, "pool-status") == "unloaded", "unloaded on the page")
        assert model_status(served, DENSE) == "unloaded"
        button(bp, DENSE, "load").click()
        wait_for(lambda: shown(bp, DENSE, "pool-status") == "loaded", "loaded on the page")
        # Chromium logs the refused fetch itself as a console error: nothing else.
        assert all("403" in e for e in bp.console_errors), bp.console_errors


def test_page_without_keys(server):
    """The shared test server (no keys): the page shows its data at once, no key asked."""
    with open_page(f"{server.base_url}/") as bp:
        bp.page.wait_for_selector("[data-model]")
        assert bp.page.is_hidden("#key-form")
        names = bp.page.eval_on_selector_all(".model[data-model]", "els => els.map(e => "
                                             "e.dataset.model)")
        assert set(names) == set(get(server, "/v1/stats", key=None).json()["models"])
        assert bp.console_errors == []
