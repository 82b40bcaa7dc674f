"""``/metrics`` fans out to every node at most once per ``METRICS_CACHE_S``: concurrent or
rapid scrapes share one gather. The node list and the HTTP reads are counted stand-ins
(the merge is real); a real cluster scrape is in ``tests/integration/test_observability.py``."""

from __future__ import annotations

import asyncio
import time

import serve_app.deploy.scrape as app_module

TEXT = ("# HELP ray_serve_app_prompt_tokens_total Prompt tokens.\n"
        "# TYPE ray_serve_app_prompt_tokens_total counter\n"
        'ray_serve_app_prompt_tokens_total{model="m"} %d\n')


def test_concurrent_and_rapid_scrapes_share_one_gather(monkeypatch):
    calls = {"nodes": 0, "fetch": 0}
    nodes = [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "MetricsExportPort": 9000}
             for i in range(3)]

    def list_nodes():
        calls["nodes"] += 1
        return nodes

    def fetch(url):
        calls["fetch"] += 1
        time.sleep(0.2)  # a node takes a while to answer
        return TEXT % calls["fetch"]

    monkeypatch.setattr(app_module.ray, "nodes", list_nodes)
    monkeypatch.setattr(app_module, "_fetch", fetch)
    monkeypatch.setattr(app_module, "_scrapes", app_module._ScrapeCache())

    async def scrape_many(n: int) -> list[str]:
        return await asyncio.gather(*(app_module.gather_node_metrics(0.5) for _ in range(n)))

    async def run() -> None:
        texts = await scrape_many(20)  # at once: one gather, 3 node reads
        assert calls == {"nodes": 1, "fetch": 3}
        assert len(set(texts)) == 1 and "ray_serve_app_prompt_tokens_total" in texts[0]
        await scrape_many(5)  # right after: the cached text
        assert calls == {"nodes": 1, "fetch": 3}
        await asyncio.sleep(0.6)  # older than the cache's age: gathered again
        await scrape_many(5)
        assert calls == {"nodes": 2, "fetch": 6}

    asyncio.run(run())
    assert app_module._scrapes.gathers == 2


def test_a_failed_gather_is_not_cached(monkeypatch):
    """A gather that raises answers its scrapes with the error and is tried again."""
    monkeypatch.setattr(app_module, "_scrapes", app_module._ScrapeCache())
    attempts = []

    def list_nodes():
        attempts.append(1)
        raise RuntimeError("the GCS is busy")

    monkeypatch.setattr(app_module.ray, "nodes", list_nodes)

    async def run() -> None:
        for _ in range(2):
            try:
                await app_module.gather_node_metrics()
            except RuntimeError:
                pass
        assert len(attempts) == 2

    asyncio.run(run())
