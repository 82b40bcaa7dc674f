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


def test_the_end_of_an_answer_is_not_held_for_the_interval(service, monkeypatch):
    """Every pause the stream takes (``EventChannel.wait_end``) ends because the answer
    ended, never because the interval ran out."""
    pauses: list[bool] = []  # per pause: did the end cut it short?
    real_wait_end = EventChannel.wait_end

    async def recorded(channel: EventChannel, timeout: float) -> None:
        # The real wait without its own limit, given the pause's: done within it only if
        # the end woke it.
        wait = asyncio.ensure_future(real_wait_end(channel, 3600.0))
        done, _ = await asyncio.wait({wait}, timeout=timeout)
        pauses.append(wait in done)
        wait.cancel()

    monkeypatch.setattr(EventChannel, "wait_end", recorded)

    async def go() -> tuple[int, int, int]:
        prepared = service.prepare(CompletionRequest(model="m", prompt=[5, 6, 7, 8],
                                                     max_tokens=6, temperature=0))
        batches, deltas, finishes = 0, 0, 0
        async for events in service.stream(prepared):
            batches += 1
            deltas += sum(isinstance(e, Delta) for e in events)
            finishes += sum(isinstance(e, Finish) for e in events)
        return batches, deltas, finishes

    batches, deltas, finishes = asyncio.run(go())
    assert finishes == 1 and deltas >= 1
    # [Start], the first token's batch, then the rest with the end, after one pause.
    assert batches <= 3
    assert pauses and all(pauses), pauses


async def _settle() -> None:
    """Let the event loop run what is ready (a woken waiter, a finished task)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_wait_end_returns_when_the_last_event_is_queued_and_not_before():
    async def go() -> None:
        loop = asyncio.get_running_loop()
        channel = EventChannel(loop)
        await channel.wait_end(0.01)  # nothing ends: the wait runs out and returns
        assert channel._end_waiter is None
        waiting = asyncio.create_task(channel.wait_end(3600.0))
        await _settle()
        channel.put(EngineEvent(token=1))  # a token is no end
        await _settle()
        assert not waiting.done()
        channel.put(EngineEvent(finish_reason="stop"))
        await _settle()
        assert waiting.done()
        again = asyncio.create_task(channel.wait_end(3600.0))  # already ended: no wait
        await _settle()
        assert again.done()

    asyncio.run(go())
