"""Per-token logprobs and per-request logits processors in the engine (in-process, no Ray).

Logprobs must be the very vector the token was sampled from (checked against mlx-lm's own
``generate_step``), cost nothing for requests that do not ask, and survive a prefix-cache
restore; processors must constrain only their own request in a shared batch and see the
whole prompt whether or not part of it was restored.
"""

from __future__ import annotations

import json
import math

import jsonschema
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from serve_app.cache.payload import CapturedBlock, RestorePlan
from serve_app.cache.request_plan import RequestPlan
from serve_app.models.embedded import materialize
from serve_app.serving.engine import Engine
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams
from serve_app.serving.structured import compile_response_format
from tests.support.engine import Collector

BS = 16
TOL = 1e-4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


class Recorder:
    """A processor that changes nothing and keeps the ``tokens`` of every call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.calls.append(tokens.tolist())
        return logits


def only(token: int):
    """A processor that allows ``token`` alone."""

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        keep = mx.arange(logits.shape[-1]) == token
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))

    return processor


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def loaded(request, tmp_path_factory):
    return mlx_lm.load(str(materialize(request.param, tmp_path_factory.mktemp("m"))))


@pytest.fixture(scope="module")
def engine(loaded):
    model, tokenizer = loaded
    eng = Engine(model, stop_tokens=tokenizer.eos_token_ids, max_batch_size=4,
                 max_queued_requests=4, prefill_step_size=32)
    eng.wait_ready(60)
    yield eng
    eng.shutdown()


def run(engine: Engine, prompt: list[int], params: SamplingParams,
        plan: RequestPlan | None = None) -> Collector:
    c = Collector()
    engine.submit(prompt, params, c, plan)
    return c


def wait(*collectors: Collector) -> None:
    for c in collectors:
        assert c.done.wait(120)
        assert all(e.error is None for e in c.events), c.events[-1]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def reference(model, prompt: list[int], n: int) -> list[tuple[int, np.ndarray]]:
    """mlx-lm's own greedy decoding of ``prompt``: (token, logprobs vector) per step."""
    out = []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append((int(token), np.array(logprobs.astype(mx.float32))))
    return out


def check_event(event: EngineEvent, k: int) -> None:
    """What holds for any token with logprobs: greedy or not, constrained or not."""
    top = event.top_logprobs
    assert event.logprob is not None and event.logprob <= 0
    assert isinstance(event.logprob, float) and all(isinstance(v, float) for _, v in top)
    assert len(top) <= k and all(math.isfinite(v) and v <= 0 for _, v in top)
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1 + 1e-5
    if top and event.token not in dict(top):
        assert event.logprob <= values[-1]


# ---- logprobs --------------------------------------------------------------------------


def test_params_are_validated():
    for bad in (-1, MAX_TOP_LOGPROBS + 1, True, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(max_tokens=1, logprobs=bad)
    params = SamplingParams(max_tokens=1, logprobs=0, logits_processors=[only(3)])
    assert isinstance(params.logits_processors, tuple)
    hash(params)


def test_greedy_logprobs_match_generate_step(engine, loaded):
    model, tokenizer = loaded
    prompt = encode(tokenizer, "hello there")
    n = 10
    c = run(engine, prompt, SamplingParams(max_tokens=n, logprobs=MAX_TOP_LOGPROBS))
    wait(c)
    ref = reference(model, prompt, n)
    # mlx-lm's generator never stops: the engine's answer is all of it, or all of it up to
    # and including the first stop token.
    stops = set(tokenizer.eos_token_ids)
    end = next((i + 1 for i, (t, _) in enumerate(ref) if t in stops), n)
    ref = ref[:end]
    events = c.scored
    assert [e.token for e in events] == [t for t, _ in ref]
    assert c.finish == ("stop" if end < n or ref[-1][0] in stops else "length")
    for e, (token, vector) in zip(events, ref, strict=True):
        check_event(e, MAX_TOP_LOGPROBS)
        assert len(e.top_logprobs) == MAX_TOP_LOGPROBS
        # Greedy: the chosen token is the most likely, so first of the alternatives.
        assert e.top_logprobs[0] == (token, e.logprob)
        assert e.logprob == max(v for _, v in e.top_logprobs)
        assert abs(e.logprob - vector[token]) < TOL
        expected = np.sort(vector)[::-1][:MAX_TOP_LOGPROBS]
        assert np.allclose([v for _, v in e.top_logprobs], expected, atol=TOL)
        for t, v in e.top_logprobs:
            assert abs(v - vector[t]) < TOL


def test_requests_without_logprobs_get_none_beside_ones_with(engine, loaded):
    _, tokenizer = loaded
    prompt = encode(tokenizer, "abc")
    plain, zero, three, sampled = (
        run(engine, prompt, SamplingParams(max_tokens=6)),
        run(engine, prompt, SamplingParams(max_tokens=6, logprobs=0)),
        run(engine, prompt, SamplingParams(max_tokens=6, logprobs=3)),
        run(engine, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=5)),
    )
    wait(plain, zero, three, sampled)
    assert plain.tokens == zero.tokens == three.tokens
    assert all(e.logprob is None and e.top_logprobs == () for e in plain.events)
    for e in zero.scored:
        check_event(e, 0)
        assert e.top_logprobs == ()
    for e, z in zip(three.scored, zero.scored, strict=True):
        check_event(e, 3)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0] == (e.token, e.logprob)
        assert e.logprob == z.logprob
    for e in sampled.scored:  # sampled: the chosen token need not be the most likely
        check_event(e, 5)
        assert len(e.top_logprobs) == 5
    # Other events (the start, the finish) never carry logprobs.
    assert all(e.logprob is None for c in (zero, three) for e in c.events if e.token is None)


# ---- logits processors -----------------------------------------------------------------


def test_a_processor_forces_its_token_and_leaves_its_batch_alone(engine, loaded):
    _, tokenizer = loaded
    forced = next(t for t in range(100, 120) if t not in tokenizer.eos_token_ids)
    free_prompt, forced_prompt = encode(tokenizer, "tell me"), encode(tokenizer, "xyz")
    free = SamplingParams(max_tokens=12)
    alone = run(engine, free_prompt, free)
    wait(alone)
    recorder = Recorder()
    engine.reset_stats()
    together = run(engine, free_prompt, free)
    constrained = run(engine, forced_prompt, SamplingParams(
        max_tokens=8, temperature=1.0, seed=1, logprobs=4,
        logits_processors=(only(forced), recorder)))
    wait(together, constrained)
    assert engine.snapshot().peak_batch_size == 2
    assert together.tokens == alone.tokens
    assert constrained.tokens == [forced] * 8
    # One allowed token: its logprob is 0 and no other token is an alternative.
    assert all(e.logprob == 0.0 and e.top_logprobs == ((forced, 0.0),)
               for e in constrained.scored)
    # The processor sees the prompt, then the prompt and every token generated so far
    # (mlx-lm computes one step ahead: a last call follows the last token).
    assert recorder.calls == [forced_prompt + [forced] * i for i in range(9)]


def test_json_schema_processor_gives_valid_json(engine, loaded):
    _, tokenizer = loaded
    grammar = compile_response_format(RESPONSE_FORMAT, tokenizer)
    eos = set(tokenizer.eos_token_ids)
    params = [SamplingParams(max_tokens=120, logprobs=2, logits_processors=(grammar.processor(),)),
              SamplingParams(max_tokens=120, temperature=1.0, seed=3, logprobs=2,
                             logits_processors=(grammar.processor(),)),
              SamplingParams(max_tokens=20)]
    cs = [run(engine, encode(tokenizer, p), s) for p, s in zip(["json", "JSON!", "free"], params,
                                                                strict=True)]
    wait(*cs)
    for c, p in zip(cs[:2], params, strict=False):
        assert c.finish == "stop"
        doc = json.loads(tokenizer.decode([t for t in c.tokens if t not in eos]))
        jsonschema.validate(doc, SCHEMA)
        assert p.logits_processors[0].finished and p.logits_processors[0].error is None
        for e in c.scored:
            check_event(e, 2)
    assert len(cs[2].tokens) == 20 or cs[2].finish == "stop"


# ---- after a prefix-cache restore ------------------------------------------------------


def cached_blocks(engine: Engine, prompt: list[int]) -> RestorePlan:
    """Serve ``prompt`` once, capturing its blocks; a plan restoring its first two."""
    captured: list[CapturedBlock] = []
    hybrid = engine.layout.hybrid
    plan = RequestPlan(BS, "root", [], sink=captured.append, checkpoint_every=BS * hybrid)
    wait(run(engine, prompt, SamplingParams(max_tokens=2), plan))
    blocks, parent = [], "root"
    for i in range(2):
        block = next(b for b in captured if b.parent_id == parent
                     and b.token_ids == tuple(prompt[i * BS : (i + 1) * BS]))
        blocks.append(block.payload)
        parent = block.block_id
    return RestorePlan([BS, BS], blocks)


def test_logprobs_and_processors_after_a_restore(engine, loaded):
    _, tokenizer = loaded
    prompt = [5 + (i * 7) % 240 for i in range(2 * BS + 5)]
    restore = cached_blocks(engine, prompt)
    n = 8

    def params(*processors) -> SamplingParams:
        return SamplingParams(max_tokens=n, logprobs=5, logits_processors=processors)

    cold_rec, warm_rec = Recorder(), Recorder()
    cold = run(engine, prompt, params(cold_rec))
    wait(cold)
    warm = run(engine, prompt, params(warm_rec), RequestPlan(BS, "root", [], restore))
    wait(warm)
    assert cold.restored == 0 and warm.restored == 2 * BS
    assert warm.tokens == cold.tokens
    for w, c in zip(warm.scored, cold.scored, strict=True):
        check_event(w, 5)
        assert abs(w.logprob - c.logprob) < TOL
        assert [t for t, _ in w.top_logprobs] == [t for t, _ in c.top_logprobs]
        assert np.allclose([v for _, v in w.top_logprobs], [v for _, v in c.top_logprobs],
                           atol=TOL)
    # mlx-lm starts a restored request's history from ``all_tokens``: the processor sees
    # the whole prompt, restored part included, exactly as in the cold request.
    generated = warm.tokens
    assert warm_rec.calls == cold_rec.calls
    assert warm_rec.calls == [prompt + generated[:i] for i in range(len(generated) + 1)]

    # A grammar-constrained request restored from the cache gives the cold request's JSON.
    grammar = compile_response_format(RESPONSE_FORMAT, tokenizer)
    eos = set(tokenizer.eos_token_ids)
    json_params = [SamplingParams(max_tokens=120, logits_processors=(grammar.processor(),))
                   for _ in range(2)]
    cold_json = run(engine, prompt, json_params[0])
    wait(cold_json)
    warm_json = run(engine, prompt, json_params[1], RequestPlan(BS, "root", [], restore))
    wait(warm_json)
    assert warm_json.restored == 2 * BS and warm_json.finish == "stop"
    assert warm_json.tokens == cold_json.tokens
    jsonschema.validate(json.loads(tokenizer.decode([t for t in warm_json.tokens
                                                     if t not in eos])), SCHEMA)
