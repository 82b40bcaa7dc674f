"""KV admission and MLX's memory limits in the engine, in-process without Ray: a request
waits for KV while others run, one that could never fit is refused, the plan's limits are
set on Metal (the availability check patched: this machine has no Metal GPU) and not
elsewhere."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest

from serve_app.memory.plan import MemoryLimits
from serve_app.memory.shapes import KV_STEP_TOKENS, cache_shape_from_layout
from serve_app.models.embedded import materialize
from serve_app.serving.admission import KVBudgetError
from serve_app.serving.engine import Engine
from serve_app.serving.sampling import SamplingParams
from tests.support.engine import Collector
from tests.support.servers import wait_for


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def loaded(request, tmp_path_factory):
    return mlx_lm.load(str(materialize(request.param, tmp_path_factory.mktemp("m"))))


@pytest.fixture
def engine(loaded):
    model, tokenizer = loaded
    eng = Engine(model, stop_tokens=set(), max_batch_size=8, max_queued_requests=8,
                 prefill_step_size=64)
    eng.wait_ready(60)
    yield eng
    eng.shutdown()


def one_request_bytes(engine: Engine) -> int:
    """What a request of at most one 256-token step reserves: KV and recurrent state."""
    shape = cache_shape_from_layout(engine.wait_ready())
    return shape.kv_bytes_per_token * KV_STEP_TOKENS + shape.state_bytes_per_sequence


def submit_many(engine: Engine, n: int, max_tokens: int) -> list[Collector]:
    out = []
    for i in range(n):
        c = Collector()
        engine.submit([1, 2, 3, 4 + i], SamplingParams(max_tokens=max_tokens), c)
        out.append(c)
    return out


def test_without_a_budget_all_run_together(engine):
    """The control: the same load batches 6 wide when nothing limits the KV."""
    for c in submit_many(engine, 6, 40):
        assert c.done.wait(60)
    snap = engine.snapshot()
    assert snap.peak_batch_size == 6 and snap.kv_waited == 0 and snap.kv_in_use_bytes == 0


def test_requests_wait_for_kv_while_others_run(engine):
    """A budget of two requests' KV: six requests run at most two at a time, four wait,
    all finish with all their tokens, and every reservation is given back."""
    engine.set_kv_budget(2 * one_request_bytes(engine))
    held = submit_many(engine, 6, 40)
    in_use = [0]  # sampled while they run

    def all_done() -> bool:
        in_use.append(engine.snapshot().kv_in_use_bytes)
        return all(c.done.is_set() for c in held)

    wait_for(all_done, "all six requests to finish", 120, interval=0.001)
    peak_in_use = max(in_use)
    snap = engine.snapshot()
    assert all(c.finish == "length" and len(c.tokens) == 40 for c in held)
    assert snap.peak_batch_size == 2
    assert snap.kv_waited == 4
    assert 0 < peak_in_use <= 2 * one_request_bytes(engine)
    assert snap.kv_in_use_bytes == 0 and snap.kv_waiting == 0 and snap.in_flight == 0


def test_a_request_over_the_budget_by_itself_is_refused(engine):
    per_token = cache_shape_from_layout(engine.wait_ready()).kv_bytes_per_token
    engine.set_kv_budget(one_request_bytes(engine))
    # 4 prompt tokens + 300 generated: two 256-token steps, more than the budget.
    with pytest.raises(KVBudgetError, match="KV budget"):
        engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=300), Collector())
    assert engine.kv.refusal("m", 4, 300) is not None and engine.kv.refusal("m", 4, 200) is None
    assert per_token > 0
    snap = engine.snapshot()
    assert snap.kv_rejected == 1 and snap.in_flight == 0 and snap.submitted == 0


def test_cancelling_a_waiting_request(engine):
    engine.set_kv_budget(one_request_bytes(engine))
    running, waiting = submit_many(engine, 2, 200)
    wait_for(lambda: engine.snapshot().kv_waiting == 1, "the second request to wait for KV",
             interval=0.005)
    engine.cancel(2)  # the second request: still waiting for KV
    assert waiting.done.wait(30) and waiting.finish == "cancelled"
    assert waiting.tokens == []
    assert running.done.wait(60) and running.finish == "length"
    snap = engine.snapshot()
    assert snap.in_flight == 0 and snap.kv_waiting == 0 and snap.kv_in_use_bytes == 0


def boom(tokens, logits):
    raise RuntimeError("a processor that fails the step")


def wait_applied(engine: Engine, timeout: float = 10.0) -> None:
    """A request through the engine: its commands (the limits among them) are done."""
    c = Collector()
    engine.submit([1, 2, 3], SamplingParams(max_tokens=1), c)
    assert c.done.wait(timeout)


def test_limits_are_set_on_metal_after_each_generator(engine, monkeypatch):
    """On Metal the plan's cache limit is what MLX has (read back from MLX itself), set
    again after the engine replaces its BatchGenerator. The wired limit is a no-op on
    this CPU build, so only the engine's record of it is checked."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    before = mx.set_cache_limit(1 << 30)
    try:
        limits = MemoryLimits(wired_bytes=64 << 20, cache_bytes=12_345_678)
        engine.set_memory_limits(limits)
        wait_applied(engine)
        assert engine.applied_limits == limits
        assert mx.set_cache_limit(1 << 30) == 12_345_678  # what the engine set
        # A step that fails makes the engine replace its BatchGenerator (a logits
        # processor that raises is such a step): the limits are set again after it.
        failing = Collector()
        engine.submit([1, 2, 3], SamplingParams(max_tokens=4, logits_processors=(boom,)),
                      failing)
        assert failing.done.wait(30) and failing.error is not None
        wait_applied(engine)
        assert mx.set_cache_limit(1 << 30) == 12_345_678
    finally:
        mx.set_cache_limit(before)


def test_off_metal_nothing_is_set(engine):
    """This machine: no Metal GPU, so the plan is advisory and MLX is left alone."""
    assert not mx.metal.is_available()
    before = mx.set_cache_limit(7_654_321)
    try:
        engine.set_memory_limits(MemoryLimits(wired_bytes=64 << 20, cache_bytes=12_345_678))
        wait_applied(engine)
        assert engine.applied_limits is None
        assert mx.set_cache_limit(before) == 7_654_321
    finally:
        mx.set_cache_limit(before)
