"""The vision tower's work inside continuous batching (issue 42): images of requests that
arrive together go through the tower in one call, their features exactly each image's
alone (every weight format), kept until each request joins; a prefill chunk's worth of
tower work a step at most, so the rows already decoding get a step between tower calls; a
request waiting for the tower counts against the KV budget and can be cancelled; a tower
that fails fails only its requests."""

from __future__ import annotations

import asyncio
import types

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from serve_app.config.catalog import FORMATS, variant_name
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.events import Delta, Failure, Finish
from serve_app.serving.request import ChatCompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import make_services, run
from tests.support.images import image_part

OFF = {"enable_thinking": False}


def chat(seeds: list[int], n: int = 8) -> ChatCompletionRequest:
    content = [{"type": "text", "text": "Compare these."}] + [image_part(s) for s in seeds]
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}],
                                 max_tokens=n, temperature=0, chat_template_kwargs=OFF)


def held(service: ModelService, rid: int, seeds: list[int]) -> types.SimpleNamespace:
    """An engine request as ``VisionRuntime.hold`` reads it (no cache plan)."""
    return types.SimpleNamespace(rid=rid, cache=None,
                                 vision=service.prepare(chat(seeds)).vision)


@pytest.fixture(scope="module", params=FORMATS)
def services(request, tmp_path_factory):
    warm, cold, _ = make_services(variant_name("tiny-vl", request.param),
                                  tmp_path_factory.mktemp("vlb"))
    yield warm, cold
    warm.shutdown()
    cold.shutdown()


def test_images_arriving_together_share_one_tower_call_and_match_each_alone(services):
    _, cold = services
    runtime = cold.engine.vision
    reqs = [held(cold, 1000 + i, seeds) for i, seeds in enumerate([[31], [32, 33], [31, 34]])]
    before = (runtime.stats.calls, runtime.stats.images)
    assert all(runtime.hold(r) for r in reqs)
    assert runtime.busy
    ready = runtime.encode_step(budget=4096)
    assert [r.rid for r in ready] == [r.rid for r in reqs] and not runtime.busy
    # one call for four distinct images (31 is sent twice: encoded once)
    assert (runtime.stats.calls, runtime.stats.images) == (before[0] + 1, before[1] + 4)
    for r in reqs:
        for span in r.vision.spans:
            together = np.array(runtime._features(span.image).astype(mx.float32))
            alone = np.array(runtime.features.tower.encode([span.image])[0].astype(mx.float32))
            assert np.array_equal(together, alone)
    runtime.drop_all()


def test_concurrent_image_requests_answer_as_each_alone(services):
    _, cold = services
    requests = [chat([41]), chat([42, 43]), chat([44])]

    async def together():
        async def one(request):
            out = []
            async for events in cold.stream(cold.prepare(request)):
                out += [e.text for e in events if isinstance(e, Delta)]
            return "".join(out)
        return await asyncio.gather(*(one(r) for r in requests))

    answers = asyncio.run(together())
    cold.engine.vision.features.clear()
    assert answers == [run(cold, r)["text"] for r in requests]


def test_tower_work_is_a_prefill_chunk_a_step(services):
    """Images of 6 tokens and a budget of 12: three images take two tower calls, the
    requests join as their own images are done, in the order they came."""
    _, cold = services
    runtime = cold.engine.vision
    a, b = held(cold, 2001, [51, 52]), held(cold, 2002, [53])
    assert runtime.hold(a) and runtime.hold(b)
    calls = runtime.stats.calls
    assert [r.rid for r in runtime.encode_step(budget=12)] == [2001]
    assert runtime.busy and runtime.stats.calls == calls + 1
    assert [r.rid for r in runtime.encode_step(budget=12)] == [2002]
    assert runtime.stats.calls == calls + 2 and not runtime.busy
    # a larger image than the budget still goes (alone)
    c = held(cold, 2003, [54, 55])
    assert runtime.hold(c)
    assert runtime.encode_step(budget=1) == [] and runtime.encode_step(budget=1) == [c]


def test_a_running_row_decodes_between_tower_calls(tmp_path):
    """The engine with a prefill chunk of 6 tokens: a request with three images (6 tokens
    each) waits three steps for the tower while a text row decodes a token in each."""
    path = materialize("tiny-vl", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-vl",
                                        cache={"enabled": False}, prefill_step_size=6),
                           model, tokenizer, path, None)
    try:
        runtime = service.engine.vision
        steps_at_calls: list[int] = []
        encode = runtime.features.encode

        def counted(images):
            steps_at_calls.append(service.engine.stats.decode_steps)
            return encode(images)
        runtime.features.encode = counted
        text = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Count."}],
                                     max_tokens=48, temperature=0, chat_template_kwargs=OFF)

        async def go():
            ends = []

            async def one(request, started=None):
                async for events in service.stream(service.prepare(request)):
                    for e in events:
                        if started is not None and isinstance(e, Delta) and not started.done():
                            started.set_result(True)
                        if isinstance(e, Finish):
                            ends.append(request is text)
            started = asyncio.get_running_loop().create_future()
            running = asyncio.create_task(one(text, started))
            await started  # the text row decodes
            await one(chat([61, 62, 63], n=4))
            await running
            return ends

        ends = asyncio.run(go())
        assert ends == [False, True]  # the text row outlived the image request
        assert len(steps_at_calls) == 3  # one image (6 tokens) a step
        assert steps_at_calls == sorted(set(steps_at_calls))  # a decode step between each
    finally:
        service.shutdown()


def test_a_request_waiting_for_the_tower_can_be_cancelled(services):
    _, cold = services
    engine, runtime = cold.engine, cold.engine.vision
    stop = runtime.encode_step
    runtime.encode_step = lambda budget: []  # the tower never gets to it
    try:
        prepared = cold.prepare(chat([71]))

        async def go():
            events = []
            stream = cold.stream(prepared)
            async for batch in stream:
                events += batch
                break  # the Start event: it is queued
            while not runtime.busy:
                await asyncio.sleep(0.01)
            await stream.aclose()  # the client goes away
            while runtime.busy:
                await asyncio.sleep(0.01)
        asyncio.run(go())
        assert engine.snapshot().kv_in_use_bytes == 0 and engine.snapshot().in_flight == 0
    finally:
        runtime.encode_step = stop


def test_a_failing_tower_fails_only_its_requests(services):
    _, cold = services
    runtime = cold.engine.vision
    tower = runtime.features.tower
    real = tower.encode
    bad = cold.prepare(chat([81])).vision.spans[0].image.digest

    def broken(images):
        if any(i.digest == bad for i in images):
            raise RuntimeError("the tower broke")
        return real(images)
    tower.encode = broken
    try:
        async def go():
            async def one(request):
                out = []
                async for events in cold.stream(cold.prepare(request)):
                    for e in events:
                        if isinstance(e, Failure):
                            return e
                        out += [e.text] if isinstance(e, Delta) else []
                return "".join(out)
            return await asyncio.gather(one(chat([81])), one(chat([82])))
        failed, answered = asyncio.run(go())
    finally:
        tower.encode = real
    assert isinstance(failed, Failure) and "tower broke" in failed.message
    assert answered == run(cold, chat([82]))["text"]


def test_features_encoded_together_stay_until_each_request_joins(tmp_path):
    """With no feature cache at all (``feature_cache_mb: 0``), requests released by one
    tower call still find their features when each joins: nothing is encoded twice."""
    path = materialize("tiny-vl", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-vl",
                                        cache={"enabled": False},
                                        vision={"feature_cache_mb": 0}),
                           model, tokenizer, path, None)
    try:
        runtime = service.engine.vision
        a, b = held(service, 3001, [91]), held(service, 3002, [92, 91])
        assert runtime.hold(a) and runtime.hold(b)
        assert runtime.encode_step(budget=4096) == [a, b]
        images = runtime.stats.images
        for r in (a, b):
            runtime._segments(r.rid, r.vision, 0, [list(r.vision.tokens)])
            runtime.joined(r.rid, r.rid)
        assert runtime.stats.images == images == 2  # 91 once, 92 once, none again
        assert not runtime._pinned  # all joined: nothing kept (there is no cache)
        for r in (a, b):
            runtime.ended(r.rid)
    finally:
        service.shutdown()


def test_requests_held_for_the_tower_count_against_the_kv_budget(tmp_path):
    """Two image requests whose KV together is over the budget: the second waits for KV
    (it used to be held beside the first, both reserving, nothing running)."""
    path = materialize("tiny-vl", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    service = ModelService(ModelProfile(name="m", source="embedded:tiny-vl",
                                        cache={"enabled": False}),
                           model, tokenizer, path, None)
    try:
        requests = [chat([101], n=6), chat([102], n=6)]
        service.engine.set_kv_budget(1 << 40)  # the shape, to size the real budget with
        need = max(service.engine.kv.bytes_for(len(service.prepare(r).prompt), 6)
                   for r in requests)
        service.engine.set_kv_budget(int(need * 1.5))
        service.engine.vision.features.clear()

        runtime = service.engine.vision
        encode = runtime.encode_step
        runtime.encode_step = lambda budget: []  # the tower waits until both are admitted

        async def both():
            async def one(request):
                out = []
                async for events in service.stream(service.prepare(request)):
                    out += [e.text for e in events if isinstance(e, Delta)]
                return "".join(out)
            tasks = [asyncio.create_task(one(r)) for r in requests]
            while runtime.held + service.engine.snapshot().kv_waiting < 2:
                await asyncio.sleep(0.01)
            runtime.encode_step = encode
            return await asyncio.gather(*tasks)

        answers = asyncio.run(both())
        snap = service.engine.snapshot()
        assert snap.kv_waited >= 1 and snap.kv_in_use_bytes == 0
        assert answers == [run(service, r)["text"] for r in requests]
    finally:
        service.shutdown()
