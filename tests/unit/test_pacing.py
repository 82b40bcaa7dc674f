"""Stream coalescing never holds back the end of an answer (issue 21).

A stream yields at most one batch of events per ``stream_interval_ms`` after its first,
so that each Ray streaming hop carries several tokens; but once the engine has delivered
a request's end, the rest goes out at once. Before, the end of a short answer waited out
a whole interval (25 ms by default) after its first token, which every non-streamed
request paid. In-process, no Ray: the longest interval the profile allows (1 s) makes a
wait impossible to miss.
"""

from __future__ import annotations

import asyncio
import time

import mlx_lm
import pytest

from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.events import Delta, Finish
from serve_app.serving.request import CompletionRequest
from serve_app.serving.service import ModelService
from serve_app.serving.stream import EventChannel

INTERVAL_MS = 1000.0


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    path = materialize("tiny-dense", tmp_path_factory.mktemp("pacing"))
    model, tokenizer = mlx_lm.load(str(path))
    svc = ModelService(ModelProfile(name="m", source="embedded:tiny-dense",
                                    cache={"enabled": False},
                                    stream_interval_ms=INTERVAL_MS), model, tokenizer, path)
    yield svc
    svc.shutdown()


def test_the_end_of_an_answer_is_not_held_for_the_interval(service):
    async def go() -> tuple[list[float], int, int]:
        prepared = service.prepare(CompletionRequest(model="m", prompt=[5, 6, 7, 8],
                                                     max_tokens=6, temperature=0))
        batches, deltas, finishes = [], 0, 0
        async for events in service.stream(prepared):
            batches.append(time.monotonic())
            deltas += sum(isinstance(e, Delta) for e in events)
            finishes += sum(isinstance(e, Finish) for e in events)
        return batches, deltas, finishes

    batches, deltas, finishes = asyncio.run(go())
    assert finishes == 1 and deltas >= 1
    # [Start], the first token's batch, then the rest with the end: not a second later.
    assert len(batches) <= 3
    assert batches[-1] - batches[0] < INTERVAL_MS / 1000 / 2, batches


def test_wait_end_returns_when_the_last_event_is_queued_and_not_before():
    async def go() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        channel = EventChannel(loop)
        started = time.monotonic()
        await channel.wait_end(0.2)  # nothing ends: the whole wait
        waited = time.monotonic() - started
        channel.put(EngineEvent(token=1))  # a token is no end
        started = time.monotonic()
        loop.call_later(0.05, channel.put, EngineEvent(finish_reason="stop"))
        await channel.wait_end(30.0)
        ended = time.monotonic() - started
        started = time.monotonic()
        await channel.wait_end(30.0)  # already ended: no wait at all
        return waited, ended, time.monotonic() - started

    waited, ended, again = asyncio.run(go())
    assert waited >= 0.19
    assert 0.04 <= ended < 10.0
    assert again < 1.0
