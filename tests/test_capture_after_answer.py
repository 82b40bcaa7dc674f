"""An answer never waits on cache bookkeeping, and the next turn still finds its blocks.

The engine delivers a request's last token and its end before it captures and publishes
the blocks the end makes due (the generation-end tail, the held decode checkpoint); a
lookup that comes meanwhile waits for those captures. In-process, no Ray: the store's
publish is slowed down on purpose (a fault no real store can be made to show on cue).
"""

from __future__ import annotations

import asyncio
import time

import mlx_lm

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.tiers import TieredStore
from serve_app.embedded import materialize
from serve_app.profile import ModelProfile
from serve_app.serving.events import Finish
from serve_app.serving.service import ModelService
from tests.test_cache_exact import chat, run

BS = 16
SLOW_S = 0.3


class SlowPublish(LocalCacheClient):
    """Every publish takes ``SLOW_S`` (on the engine thread); records when each ended."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(store)
        self.published_at: list[float] = []
        self.engine = None
        self.capturing_at_lookup: list[bool] = []

    def publish(self, model, block, disk, wait=True) -> None:
        time.sleep(SLOW_S)
        super().publish(model, block, disk, wait)
        self.published_at.append(time.perf_counter())

    async def _match(self, q):
        self.capturing_at_lookup.append(self.engine.capturing)
        return await super()._match(q)


def test_the_end_comes_before_the_capture_and_the_next_turn_waits_for_it(tmp_path):
    path = materialize("tiny-hybrid-bf16", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    client = SlowPublish(TieredStore(1 << 30))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-hybrid-bf16",
                                        cache={"block_size": BS}), model, tokenizer, path,
                           client)
    client.engine = service.engine
    try:
        first = [{"role": "user", "content": "Tell me about the harbour town archive."}]

        async def one() -> float:
            prepared = service.prepare(chat(first, n=6))
            async for events in service.stream(prepared):
                if any(isinstance(e, Finish) for e in events):
                    return time.perf_counter()
            raise AssertionError("no finish")

        client.published_at.clear()
        finished_at = asyncio.run(one())
        deadline = time.monotonic() + 10
        while service.engine.capturing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.published_at, "nothing was captured"
        # The end's blocks were published after the answer had ended.
        assert max(client.published_at) > finished_at + SLOW_S / 2

        # The next request, sent the moment one ended, looks up only once the end's
        # blocks are in the store.
        client.capturing_at_lookup.clear()
        finished_at = asyncio.run(one())
        assert service.engine.capturing  # the end's blocks are still being captured
        run(service, chat(first, n=6))
        assert client.capturing_at_lookup == [False, False]
    finally:
        service.shutdown()
