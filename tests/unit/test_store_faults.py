"""Faults of the cache store without Ray: a second store on a locked directory is refused
and says why, a hot payload lost with its owner is a shorter restore (never an error), and
a full publish queue drops and counts a block instead of blocking the event loop (the
actor on a real Ray is tests/integration/test_store_faults.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from serve_app.config.profile import CacheStoreProfile
from serve_app.store.actor import make_ssd
from serve_app.store.client import RayCacheClient
from tests.support.blocks import block


def ssd_config(root: Path, **over) -> CacheStoreProfile:
    return CacheStoreProfile(**{"hot_budget": 1 << 20, "ssd": True, "ssd_dir": str(root),
                                "ssd_cache_max_size": 1 << 30, "ssd_min_free": 0, **over})


def test_a_locked_directory_is_refused_not_shared(tmp_path, caplog):
    """flock is per open file description: a second store in this very process is refused
    like a second server would be; it names the directory and the holder's pid."""
    first, reason = make_ssd(ssd_config(tmp_path))
    assert first is not None and reason is None
    with caplog.at_level(logging.ERROR, logger="serve_app.store.actor"):
        second, reason = make_ssd(ssd_config(tmp_path))
    assert second is None
    assert str(tmp_path) in reason and f"process {os.getpid()}" in reason
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert str(tmp_path) in record.getMessage() and str(os.getpid()) in record.getMessage()


def test_a_hot_payload_lost_with_its_owner_is_a_shorter_restore_not_an_error(tmp_path):
    """Hot payloads are resolved together; one whose owner died (``LookupError``) is
    dropped from the index and the lookup retried: the request restores the blocks
    before it and produces exactly the cold tokens."""
    import mlx_lm

    from serve_app.cache.client import LocalCacheClient
    from serve_app.cache.hashing import chain, salted_root
    from serve_app.cache.tiers import TieredStore
    from serve_app.config.profile import ModelProfile
    from serve_app.models.embedded import materialize
    from serve_app.serving.request import CompletionRequest
    from serve_app.serving.service import ModelService
    from tests.support.engine import run

    class LosingClient(LocalCacheClient):
        lost: set[int] = set()

        async def _resolve(self, handle):
            if id(handle) in self.lost:
                raise LookupError("hot block lost with its owner")
            return handle

    bs = 16
    path = materialize("tiny-dense", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    store = TieredStore(1 << 30)
    client = LosingClient(store)
    services = [ModelService(ModelProfile(name=n, source="embedded:tiny-dense", cache=c),
                             model, tokenizer, path, client if n == "warm" else None)
                for n, c in (("warm", {"block_size": bs}), ("cold", {"enabled": False}))]
    warm, cold = services
    try:
        prompt = [5 + (i * 7) % 240 for i in range(3 * bs + 5)]

        def ask(service):
            return run(service, CompletionRequest(model="m", prompt=prompt, max_tokens=6,
                                                  temperature=0))

        first = ask(warm)
        ids = chain(salted_root(warm.cache.root, None, None), prompt, bs)
        second_block = store.hot.entry(ids[1])
        client.lost.add(id(second_block.handle))
        again = ask(warm)
        assert again["cached"] == bs  # the first block only: the second was lost
        assert again["text"] == first["text"] == ask(cold)["text"]
        assert warm.cache_stats.summary()["hit_tokens"] >= bs
    finally:
        for s in services:
            s.shutdown()


def test_a_promotion_never_blocks_the_event_loop_on_a_full_publish_queue():
    """``publish(wait=False)`` (SSD promotions on the replica's event loop, and the
    engine's captured blocks) drops and counts a block the publish queue cannot take now."""
    import queue
    import threading

    from serve_app.cache.client import CircuitBreaker

    class NeverWait(queue.Queue):
        """A full queue that fails a caller ready to wait for room."""

        def put(self, item, block=True, timeout=None):
            assert not block, "publish(wait=False) waited for room in the publish queue"
            super().put(item, block=False)

    client = object.__new__(RayCacheClient)  # no actor and no publisher thread: a full queue
    client.breaker, client.timeout = CircuitBreaker(), 3600.0
    client._queue = NeverWait(maxsize=1)
    client._queue.put("taken", block=False)
    client._cv = threading.Condition()
    client._seq, client._unacked, client.dropped, client._unreported = 0, set(), 0, 0
    client.publish("m", block(1), None, wait=False)
    assert client.dropped == 1 and client._unreported == 1 and not client._unacked
