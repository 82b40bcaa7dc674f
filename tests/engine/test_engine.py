"""The engine in-process, without Ray: batching, cancellation, back-pressure."""

from __future__ import annotations

import mlx_lm
import pytest

from serve_app.models.embedded import materialize
from serve_app.serving.admission import QueueFullError
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
    eng = Engine(model, stop_tokens=tokenizer.eos_token_ids, max_batch_size=8,
                 max_queued_requests=2, prefill_step_size=32)
    yield eng
    eng.shutdown()


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"prompt {i} " + "xy" * (5 * i)}],
        add_generation_prompt=True) for i in range(n)]


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> Collector:
    c = Collector()
    engine.submit(prompt, params, c)
    return c


def test_batched_equals_solo_and_really_batches(engine, loaded):
    _, tokenizer = loaded
    params = SamplingParams(max_tokens=24)
    ps = prompts(tokenizer, 6)
    solo = []
    for p in ps:
        c = run(engine, p, params)
        assert c.done.wait(60)
        solo.append(c.tokens)
    assert engine.snapshot().peak_batch_size == 1
    together = [run(engine, p, params) for p in ps]
    for c in together:
        assert c.done.wait(60)
    assert [c.tokens for c in together] == solo
    assert engine.snapshot().peak_batch_size == 6
    assert all(c.finish in ("length", "stop") for c in together)


def test_long_prompt_is_prefilled_in_chunks_and_matches(engine, loaded):
    """prefill_step_size=32 cuts this prompt in several chunks; same tokens as one chunk."""
    model, tokenizer = loaded
    prompt = tokenizer.encode("a much longer prompt " * 8, add_special_tokens=False)
    assert len(prompt) > 3 * 32
    chunked = run(engine, prompt, SamplingParams(max_tokens=12))
    assert chunked.done.wait(60)
    one = Engine(model, stop_tokens=tokenizer.eos_token_ids, prefill_step_size=4096)
    try:
        whole = run(one, prompt, SamplingParams(max_tokens=12))
        assert whole.done.wait(60)
    finally:
        one.shutdown()
    assert chunked.tokens == whole.tokens


def test_cancel_frees_the_slot(engine, loaded):
    _, tokenizer = loaded
    c = run(engine, prompts(tokenizer, 1)[0], SamplingParams(max_tokens=100000))
    wait_for(lambda: len(c.tokens) >= 3, "three tokens", interval=0.01)
    rid = engine.stats.submitted
    engine.cancel(rid)
    assert c.done.wait(30)
    assert c.finish == "cancelled"
    snap = engine.snapshot()
    assert snap.in_flight == 0 and snap.cancelled == 1


def test_queue_full_rejects(engine, loaded):
    _, tokenizer = loaded
    limit = engine.max_batch_size + engine.max_queued_requests
    held = [run(engine, [1, 2, 3], SamplingParams(max_tokens=100000)) for _ in range(limit)]
    with pytest.raises(QueueFullError, match="at capacity"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=1), Collector())
    assert engine.snapshot().rejected == 1
    for rid in range(1, limit + 1):
        engine.cancel(rid)
    for c in held:
        assert c.done.wait(30)
    assert engine.snapshot().in_flight == 0


def test_seeded_sampling_is_independent_of_batch(engine, loaded):
    _, tokenizer = loaded
    p = prompts(tokenizer, 2)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42)
    alone = run(engine, p[0], params)
    assert alone.done.wait(60)
    pair = [run(engine, p[0], params), run(engine, p[1], SamplingParams(max_tokens=16,
                                                                          temperature=0.8))]
    for c in pair:
        assert c.done.wait(60)
    assert pair[0].tokens == alone.tokens


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError):
        engine.submit([], SamplingParams(max_tokens=1), Collector())
