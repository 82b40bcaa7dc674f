"""Speculative decoding (``serve_app/serving/speculative.py``) on the real engine.

At temperature 0 every path gives exactly the tokens of plain decoding: dense and hybrid,
rows keeping different numbers of drafts in one batch, grammars and logprobs at every
draft position, stop tokens and ``max_tokens`` inside a drafted run. Above it a seeded
request gives plain decoding's tokens too, token for token, whatever its batch-mates and
depth (one key per output position); an unseeded one is distributed as plain decoding's:
a two-sample test that passes plain against plain and speculative against plain fails a
planted bug (drafts kept while they are the argmax).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from serve_app.config.profile import ModelProfile, ProfileError, parse_profile
from serve_app.models.embedded import materialize
from serve_app.serving import speculative
from serve_app.serving.drafts import (
    ControlledDraft,
    DraftModel,
    DraftRow,
    MTPDraft,
    NgramDraft,
    lookup,
)
from serve_app.serving.engine import Engine
from serve_app.serving.samplers import SeededSampler, advance, draw, make_request_sampler
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.speculative import (
    SpeculationSettings,
    Speculator,
    VerifyCost,
    expected_tokens,
)
from serve_app.serving.structured import compile_response_format
from tests.support.engine import Collector
from tests.support.formats import DENSES as DENSES_
from tests.support.formats import HYBRIDS as HYBRIDS_

# ---- units ----------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    history = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(history, 3, max_n=3, min_n=1) == [7, 8, 5]  # "2 3" last seen before 7
    assert lookup(history, 1, max_n=3, min_n=1) == [7]
    assert lookup(np.array([4, 5, 6]), 3, 3, 1) == []  # nothing repeats
    assert lookup(np.array([4, 4, 4, 4]), 2, 3, 1) == [4]  # the match may overlap
    assert NgramDraft(2, 2).propose(DraftRow(1, [1, 2, 3, 1, 2], 2), 4) == [3, 1, 2]


def test_expected_tokens_and_interpolated_verify_cost():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens(0.3, 0) == 1.0 and expected_tokens(1.0, 4) == 5.0
    cost = VerifyCost({1: [1.0, 1.2, 1.4], 9: [1.0, 2.0, 3.0]})
    assert cost.ratio(1, 1) == 1.0 and cost.ratio(1, 3) == 1.4
    assert cost.ratio(5, 3) == pytest.approx(2.2)  # halfway between batch 1 and 9
    assert cost.ratio(9, 6) == pytest.approx(6.0)  # beyond the measured: linear
    assert cost.ratio(20, 2) == 2.0


def test_a_seeded_sampler_draws_token_i_with_the_key_of_position_i():
    """What a plain step draws as a request's ``i``-th token (calls in order) is what a
    verify step draws there (``draw``, any step ahead, without moving the sampler on);
    ``advance`` moves it past what a verify step drew. Another seed, other tokens."""
    logprobs = mx.log(mx.softmax(mx.array([[0.1 * (i % 7) for i in range(64)]]), axis=-1))
    plain_steps = SeededSampler(7, 1.0)
    calls = [int(plain_steps(logprobs).item()) for _ in range(24)]
    verify = make_request_sampler(SamplingParams(max_tokens=1, temperature=1.0, seed=7))
    assert isinstance(verify, SeededSampler)
    assert [int(draw(verify, logprobs, j).item()) for j in range(24)] == calls
    assert verify.index == 0
    advance(verify, 5)
    assert [int(verify(logprobs).item()) for _ in range(3)] == calls[5:8]
    other = SeededSampler(8, 1.0)
    assert [int(other(logprobs).item()) for _ in range(24)] != calls
    assert len(set(calls)) > 8  # really sampled


@pytest.mark.parametrize("spec,key,words", [
    ({"method": "draft"}, "speculative", "needs draft_model"),
    ({"method": "draft", "draft_model": "embedded:nope"}, "speculative.draft_model",
     "unknown embedded model"),
    ({"method": "mtp", "draft_model": "x"}, "speculative", "draft_model"),
    ({"method": "beam"}, "speculative.method", "ngram"),
    ({"method": "ngram", "num_draft_tokens": 0}, "speculative.num_draft_tokens", "1"),
    ({"method": "ngram", "ngram_min": 4, "ngram_max": 2}, "speculative", "ngram_min"),
    ({"method": "ngram", "draft_model": "x"}, "speculative", "draft_model"),
    ({"method": "ngram", "depth": 3}, "speculative.depth", "unknown key"),
])
def test_a_bad_speculative_key_is_a_config_error_naming_it(spec, key, words):
    profile = {"models": [{"name": "m", "source": "embedded:tiny-dense",
                           "speculative": spec}]}
    with pytest.raises(ProfileError) as err:
        parse_profile(profile, "configs/x.yaml")
    message = str(err.value)
    assert "configs/x.yaml" in message and f"models[0].{key}" in message, message
    assert words in message, message


def test_a_good_speculative_profile_reads():
    model = ModelProfile(name="m", source="embedded:tiny-dense",
                         speculative={"method": "ngram", "num_draft_tokens": 6,
                                      "adaptive": False})
    assert model.speculative is not None and model.speculative.num_draft_tokens == 6
    assert ModelProfile(name="m", source="embedded:tiny-dense").speculative is None


# ---- the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def loaded(request, tmp_path_factory):
    model, tokenizer = mlx_lm.load(str(materialize(request.param,
                                                   tmp_path_factory.mktemp("spec"))))
    return request.param, model, tokenizer


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"prompt {i}: " + "the cat sat on the mat. " * (i + 1))
            for i in range(n)]


def engine_for(model, stops: set[int], speculator: Speculator | None = None) -> Engine:
    engine = Engine(model, stop_tokens=stops, max_batch_size=8, prefill_step_size=32,
                    max_queued_requests=1000,
                    speculator=speculator)
    engine.wait_ready(60)
    return engine


def run(engine: Engine, ps: list[list[int]], params: list[SamplingParams]) -> list[Collector]:
    out = [Collector() for _ in ps]
    for prompt, p, c in zip(ps, params, out, strict=True):
        engine.submit(prompt, p, c)
    for c in out:
        assert c.done.wait(120)
    return out


def plain(model, stops, ps, params) -> list[Collector]:
    engine = engine_for(model, stops)
    try:
        return run(engine, ps, params)
    finally:
        engine.shutdown()


def speculating(model, stops, ps, params, source, k: int = 4, adaptive: bool = False,
                cost: VerifyCost | None = None) -> tuple[list[Collector], Engine]:
    spec = Speculator(source, SpeculationSettings(k, adaptive), stop_tokens=stops)
    engine = engine_for(model, stops, spec)
    if cost is not None:
        spec.cost = cost
    try:
        return run(engine, ps, params), engine
    finally:
        engine.shutdown()


def references(ps, outs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): c.tokens for p, c in zip(ps, outs, strict=True)}


def test_rows_keeping_different_drafts_in_one_batch_give_the_plain_tokens(loaded):
    _, model, tokenizer = loaded
    stops = set(tokenizer.eos_token_ids)
    ps = prompts(tokenizer, 6)
    params = [SamplingParams(max_tokens=30 + 3 * i) for i in range(6)]
    ref = plain(model, stops, ps, params)
    draft = ControlledDraft(references(ps, ref), 0.6, model.args.vocab_size, seed=1)
    out, engine = speculating(model, stops, ps, params, draft)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert [c.finish for c in out] == [c.finish for c in ref]
    stats = engine.snapshot()
    assert len(stats.accepted_lengths) >= 3, stats.accepted_lengths  # 0..4 kept per row
    assert stats.verify_steps and stats.accepted_tokens < stats.drafted_tokens
    assert stats.generated_tokens == sum(len(c.tokens) for c in ref)
    # fewer forwards than tokens: the verify steps emitted several tokens per row
    assert stats.decode_steps < max(len(c.tokens) for c in ref)


def test_prompt_lookup_gives_the_plain_tokens(loaded):
    _, model, tokenizer = loaded
    stops = set(tokenizer.eos_token_ids)
    ps = prompts(tokenizer, 4)
    params = [SamplingParams(max_tokens=40)] * 4
    ref = plain(model, stops, ps, params)
    out, engine = speculating(model, stops, ps, params, NgramDraft(), k=6)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert engine.snapshot().drafted_tokens > 0


def test_a_draft_model_gives_the_plain_tokens(loaded, tmp_path_factory):
    """The target's 4-bit copy drafts for the dense model (high acceptance), the dense
    model for the hybrid one (low): exact either way, and requests that restart their
    draft cache (new ones) or roll it back (rejections) stay in step."""
    name, model, tokenizer = loaded
    stops = set(tokenizer.eos_token_ids)
    drafter = "tiny-dense-q4" if name == "tiny-dense" else "tiny-dense"
    draft, _ = mlx_lm.load(str(materialize(drafter, tmp_path_factory.mktemp("draft"))))
    ps = prompts(tokenizer, 4)
    params = [SamplingParams(max_tokens=36)] * 4
    ref = plain(model, stops, ps, params)
    out, engine = speculating(model, stops, ps, params, DraftModel(draft, context=32), k=4)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    stats = engine.snapshot()
    assert stats.speculative_method == "draft" and stats.verify_steps > 0
    if name == "tiny-dense":  # its own 4-bit copy: mostly right, sometimes not
        assert 0.5 < stats.accepted_tokens / stats.drafted_tokens < 1, stats
    # (an unrelated random model drafting for the hybrid one: every draft rejected)


def test_a_draft_model_with_recurrent_layers_is_refused(tmp_path):
    hybrid, _ = mlx_lm.load(str(materialize("tiny-hybrid", tmp_path)))
    with pytest.raises(ValueError, match="trimmable"):
        DraftModel(hybrid)


def test_a_stop_token_and_max_tokens_inside_a_drafted_run(loaded):
    _, model, tokenizer = loaded
    ps = prompts(tokenizer, 3)
    params = [SamplingParams(max_tokens=n) for n in (7, 13, 40)]
    ref = plain(model, set(tokenizer.eos_token_ids), ps, params)
    stop = ref[2].tokens[9]  # a token the third row produces: it stops there
    stops = {*tokenizer.eos_token_ids, stop}
    ref = plain(model, stops, ps, params)
    draft = ControlledDraft(references(ps, ref), 1.0, model.args.vocab_size)
    out, _ = speculating(model, stops, ps, params, draft, k=5)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert [c.finish for c in out] == [c.finish for c in ref]
    assert ref[2].finish == "stop" and ref[2].tokens[-1] == stop
    lengths = [(c.finish, len(c.tokens), p.max_tokens) for c, p in zip(out, params, strict=True)]
    assert ("length", 7, 7) in lengths, lengths  # max_tokens inside a drafted run


def test_grammars_and_logprobs_apply_at_every_draft_position(loaded):
    _, model, tokenizer = loaded
    stops = set(tokenizer.eos_token_ids)
    grammar = compile_response_format({"type": "json_object"}, tokenizer)
    ps = prompts(tokenizer, 3)

    def params():  # fresh processors per run: they keep state
        return [SamplingParams(max_tokens=25, logprobs=3,
                               logits_processors=(grammar.processor(),) if i != 1 else ())
                for i in range(3)]

    ref = plain(model, stops, ps, params())
    draft = ControlledDraft(references(ps, ref), 0.7, model.args.vocab_size, seed=2)
    out, engine = speculating(model, stops, ps, params(), draft)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert engine.snapshot().accepted_tokens > 0
    for a, b in zip(out, ref, strict=True):
        got = [e for e in a.events if e.token is not None]
        want = [e for e in b.events if e.token is not None]
        for x, y in zip(got, want, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
    text = tokenizer.decode(ref[0].tokens)
    assert text.startswith("{"), text  # the grammar really constrained the output


def test_adaptive_depth_drafts_only_where_it_pays(loaded):
    _, model, tokenizer = loaded
    stops = set(tokenizer.eos_token_ids)
    ps = prompts(tokenizer, 2)
    params = [SamplingParams(max_tokens=30)] * 2
    ref = plain(model, stops, ps, params)
    refs = references(ps, ref)
    linear = VerifyCost({1: [1.0, 2.0, 3.0, 4.0, 5.0], 8: [1.0, 2.0, 3.0, 4.0, 5.0]})
    flat = VerifyCost({1: [1.0, 1.05, 1.1, 1.15, 1.2], 8: [1.0, 1.05, 1.1, 1.15, 1.2]})
    poor = ControlledDraft(refs, 0.3, model.args.vocab_size)
    out, engine = speculating(model, stops, ps, params, poor, adaptive=True, cost=linear)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    assert engine.snapshot().verify_steps == 0  # a verify costs more than it yields
    good = ControlledDraft(refs, 0.9, model.args.vocab_size)
    out, engine = speculating(model, stops, ps, params, good, adaptive=True, cost=flat)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    stats = engine.snapshot()
    assert stats.verify_steps > 0 and stats.accepted_tokens / stats.drafted_tokens > 0.6


# ---- seeded sampling: the same tokens as plain decoding ---------------------------------


def seeded_params(tokenizer) -> list[SamplingParams]:
    """Seeded rows (one with top-p, one under a JSON grammar) beside a greedy row."""
    grammar = compile_response_format({"type": "json_object"}, tokenizer)
    return [SamplingParams(max_tokens=30, temperature=0.9, seed=101),
            SamplingParams(max_tokens=26, temperature=0.7, top_p=0.9, seed=102),
            SamplingParams(max_tokens=22, temperature=0.8, seed=103,
                           logits_processors=(grammar.processor(),)),
            SamplingParams(max_tokens=24)]


def test_a_seeded_request_gives_the_plain_tokens_with_speculation_on(loaded):
    """Above temperature 0, each seeded row gives plain decoding's tokens token for token
    while it keeps 0 to 4 drafts a step (drafts right with probability 0.6: a right one is
    always kept, a wrong one never), under a grammar too: a verify step draws token ``i``
    with the key a plain step would."""
    _, model, tokenizer = loaded
    stops = set(tokenizer.eos_token_ids)
    ps = prompts(tokenizer, 4)
    ref = plain(model, stops, ps, seeded_params(tokenizer))
    draft = ControlledDraft(references(ps, ref), 0.6, model.args.vocab_size, seed=3)
    out, engine = speculating(model, stops, ps, seeded_params(tokenizer), draft)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    stats = engine.snapshot()
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, stats
    assert len(stats.accepted_lengths) >= 3, stats.accepted_lengths
    assert all(len(set(c.tokens)) > 5 for c in ref[:3])  # sampled, not stuck on a token


def test_a_seeded_requests_tokens_do_not_depend_on_its_batch_or_depth(loaded):
    """One seeded request decoded plainly alone, then speculating beside two different
    sets of batch-mates (greedy, seeded, unseeded) at two depths: the same tokens."""
    _, model, tokenizer = loaded
    stops: set[int] = set()  # every request runs to its max_tokens: long enough to tell
    ps = prompts(tokenizer, 5)
    mine = SamplingParams(max_tokens=32, temperature=1.0, seed=2024)
    alone = plain(model, stops, ps[:1], [mine])[0].tokens
    assert len(set(alone)) > 5
    mates = [([SamplingParams(max_tokens=40), SamplingParams(max_tokens=12, temperature=0.8)],
              4, 0.5),
             ([SamplingParams(max_tokens=20, temperature=0.6, seed=9),
               SamplingParams(max_tokens=36, temperature=1.0),
               SamplingParams(max_tokens=8)], 2, 0.9)]
    for others, k, alpha in mates:
        batch = ps[: 1 + len(others)]
        refs = references(batch, plain(model, stops, batch, [mine, *others]))
        draft = ControlledDraft(refs, alpha, model.args.vocab_size, seed=k)
        out, engine = speculating(model, stops, batch, [mine, *others], draft, k=k)
        assert out[0].tokens == alone, (k, alpha)
        assert engine.snapshot().accepted_tokens > 0


# ---- the distribution above temperature 0 ---------------------------------------------


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of two samples of outcomes (rare ones pooled)."""
    ca, cb = Counter(a), Counter(b)
    common = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rows = [[ca[k] for k in common], [cb[k] for k in common]]
    rows[0].append(len(a) - sum(rows[0]))
    rows[1].append(len(b) - sum(rows[1]))
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return chi2_sf(*_chi2(rows))


def _chi2(rows: list[list[int]]) -> tuple[float, int]:
    """Pearson's statistic of a 2 x k table and its degrees of freedom."""
    cols = [a + b for a, b in zip(*rows, strict=True)]
    total = sum(cols)
    stat = 0.0
    for row in rows:
        n = sum(row)
        for observed, col in zip(row, cols, strict=True):
            expected = n * col / total
            if expected > 0:
                stat += (observed - expected) ** 2 / expected
    return stat, len(cols) - 1


def chi2_sf(x: float, k: int) -> float:
    """P(chi-square with ``k`` degrees of freedom > ``x``), by Wilson and Hilferty's
    normal approximation (good to a few percent, plenty for a threshold of 1e-3)."""
    import math

    if k <= 0:
        return 1.0
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """One model is enough for the distribution: the sampling does not depend on it."""
    return mlx_lm.load(str(materialize("tiny-dense", tmp_path_factory.mktemp("dist"))))


@pytest.mark.parametrize("planted_bug", [False, True])
def test_sampled_output_is_distributed_as_plain_decoding(dense, planted_bug, monkeypatch):
    model, tokenizer = dense
    stops = set(tokenizer.eos_token_ids)
    prompt = tokenizer.encode("the cat sat on the")
    n = 300
    # Unseeded: a seeded request gives plain decoding's very tokens (tested above); these
    # draw from the process's generator, so only their distribution can match.
    params = [SamplingParams(max_tokens=3, temperature=0.15)] * (2 * n)
    greedy = plain(model, stops, [prompt], [SamplingParams(max_tokens=3)])[0].tokens
    # The draft always proposes the greedy continuation; at this temperature the second
    # token is the greedy one about 60% of the time: often kept, often not. The test is
    # on that token, the first one a verify step decides.
    draft = ControlledDraft({tuple(prompt): greedy}, 1.0, model.args.vocab_size)
    first = [c.tokens[1] for c in plain(model, stops, [prompt] * n, params[:n])]
    second = [c.tokens[1] for c in plain(model, stops, [prompt] * n, params[n:])]
    if planted_bug:  # a draft kept while it is the argmax, as at temperature 0
        monkeypatch.setattr(speculative, "draw",
                            lambda sampler, logprobs, ahead: mx.argmax(logprobs, axis=-1))
    outs, engine = speculating(model, stops, [prompt] * n, params[:n], draft, k=2)
    spec = [c.tokens[1] for c in outs]
    stats = engine.snapshot()
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # both branches taken
    assert chi_square_p(first, second) > 1e-3  # the test passes plain against plain
    if planted_bug:
        assert chi_square_p(spec, first) < 1e-3
    else:
        assert chi_square_p(spec, first) > 1e-3


# ---- the service: profiles and prefix-cache tiers on every format ---------------------


def test_a_profile_turns_speculation_on_in_the_service(tmp_path: Path):
    """``speculative:`` in a model's profile: prompt lookup, and a draft model given as a
    directory (the 4-bit copy of the weights), give the plain text through the service."""
    from serve_app.serving.request import CompletionRequest
    from serve_app.serving.service import ModelService
    from tests.support.engine import run as ask

    path = materialize("tiny-dense", tmp_path)
    model, tokenizer = mlx_lm.load(str(path))
    draft_dir = materialize("tiny-dense-q4", tmp_path)
    request = CompletionRequest(model="m", prompt="a b c a b c a b c a b", max_tokens=20,
                                temperature=0)
    texts, methods = [], []
    for spec in (None, {"method": "ngram", "num_draft_tokens": 4, "adaptive": False},
                 {"method": "draft", "draft_model": str(draft_dir), "adaptive": False}):
        service = ModelService(ModelProfile(name="m", source="embedded:tiny-dense",
                                            speculative=spec, cache={"enabled": False}),
                               model, tokenizer, path)
        try:
            texts.append(ask(service, request)["text"])
            stats = service.engine.snapshot()
        finally:
            service.shutdown()
        methods.append(stats.speculative_method)
        assert (stats.drafted_tokens > 0) == (spec is not None)
        # One accepted length per drafting row and step, adding up to the accepted tokens,
        # none longer than the drafts.
        lengths = {int(n): k for n, k in stats.accepted_lengths.items()}
        assert sum(lengths.values()) == stats.drafting_row_steps
        assert sum(n * k for n, k in lengths.items()) == stats.accepted_tokens
        assert all(0 <= n <= 4 for n in lengths)
        assert bool(lengths) == (spec is not None)
    assert texts[1:] == texts[:1] * 2
    assert methods == ["", "ngram", "draft"]


MTPS = [f"tiny-hybrid-mtp-{f}" if f != "fp32" else "tiny-hybrid-mtp"
        for f in ("fp32", "bf16", "fp16", "q4")]
# Fixed depth: every step drafts where the prompt lookup finds a match, on every format.
SPEC = {"method": "ngram", "num_draft_tokens": 4, "adaptive": False}


def looping_prompt(seed: int, blocks: int) -> list[int]:
    """A prompt that repeats itself, so the lookup drafts from the first step."""
    period = [5 + (i * seed) % 240 for i in range(11)]
    return (period * (blocks * 16 // 11 + 2))[: blocks * 16 + 3]


MTP_SPEC = {"method": "mtp", "num_draft_tokens": 3, "adaptive": False}


@pytest.mark.parametrize("name,storage,spec", [
    *((n, s, SPEC) for n in HYBRIDS_ for s in ("ssd_sidecar", "embedded")),
    *((n, "auto", SPEC) for n in DENSES_),  # no recurrent state: KV block files only
    *((n, "ssd_sidecar", MTP_SPEC) for n in MTPS),  # Qwen3.5 layout, its own MTP head
])
def test_every_format_warm_and_restored_from_ssd_gives_the_plain_tokens(name, storage, spec,
                                                                        home, tmp_path):
    """Speculating: cold, warm multi-turn from the hot tier, and after a restart from SSD
    (hybrid checkpoints in sidecars and embedded in the block files), the tokens of a cold
    plain prefill and plain decoding; decode-time blocks captured while drafting restore
    exactly too."""
    from tests.support.formats import Server

    cache = {"gdn_snapshot_storage": storage}
    first = Server(name, home, tmp_path, cache, speculative=spec)
    prompt = looping_prompt(7, 3)
    a = first.ask(prompt, n=24)
    assert a["text"] == first.cold_text(prompt, n=24)
    turn = prompt + first.service.tokenizer.encode(a["text"]) + prompt[:8]
    b = first.ask(turn, n=24)  # warm: its prompt and its own decoded blocks
    assert b["cached"] >= 3 * 16 and b["text"] == first.cold_text(turn, n=24)
    assert first.service.engine.snapshot().drafted_tokens > 0
    first.drain()
    first.close()
    again = Server(name, home, tmp_path, cache, speculative=spec)
    c = again.ask(turn, n=24)  # restored from SSD after a restart
    assert c["cached"] >= 3 * 16 and c["text"] == b["text"]
    assert again.service.cache_stats.hit_tokens_by_tier.get("ssd", 0) >= 3 * 16
    again.close()


@pytest.mark.parametrize("name", [*DENSES_, *HYBRIDS_, *MTPS])
def test_a_verify_forward_gives_the_logits_of_one_position_steps_bit_for_bit(name, home):
    """What exactness above temperature 0 rests on (and at 0, beyond the argmax): a
    forward of five positions for a left-padded batch of three gives, on this backend,
    the very logits five one-position steps give, on every embedded format."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(materialize(name, home)))
    prompts = [list(range(5, 45)), list(range(60, 77)), list(range(100, 131))]

    def batch_cache() -> list:
        rows = []
        for prompt in prompts:
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            rows.append(cache)
        return [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]

    fed = mx.array([[7, 19, 33, 90, 4], [8, 8, 8, 8, 8], [200, 3, 150, 2, 1]])
    steps = batch_cache()
    one_by_one = mx.concatenate([model(fed[:, j : j + 1], cache=steps) for j in range(5)],
                                axis=1)
    verify = model(fed, cache=batch_cache())
    assert verify.dtype == one_by_one.dtype
    assert mx.array_equal(verify, one_by_one).item(), name


# ---- the model's own MTP head ------------------------------------------------------------


class LoggedMTP(MTPDraft):
    """Keeps every proposal with the history it was made from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[DraftRow, list[int]]] = []

    def propose(self, row: DraftRow, k: int) -> list[int]:
        out = super().propose(row, k)
        self.log.append((row, out))
        return out


@pytest.fixture(scope="module", params=MTPS)
def mtp_model(request, tmp_path_factory):
    path = materialize(request.param, tmp_path_factory.mktemp("mtp"))
    model, tokenizer = mlx_lm.load(str(path))
    return request.param, path, model, tokenizer


def test_the_mtp_head_gives_the_plain_tokens_on_every_format(mtp_model):
    """The MTP head of the Qwen3.5-layout checkpoint, loaded quantized like the trunk, drafts
    for four rows at once; their tokens are plain decoding's."""
    import mlx.core as mx

    from serve_app.models.mtp import load_mtp_head

    name, path, model, tokenizer = mtp_model
    head, parts = load_mtp_head(model, path)
    if name.endswith("q4"):
        assert type(head.fc).__name__ == "QuantizedLinear" and head.fc.bits == 4
    else:
        assert head.fc.weight.dtype == parts.inner.norm.weight.dtype != mx.uint32
    stops = set(tokenizer.eos_token_ids)
    ps = prompts(tokenizer, 4)
    params = [SamplingParams(max_tokens=24 + 3 * i) for i in range(4)]
    ref = plain(model, stops, ps, params)
    out, engine = speculating(model, stops, ps, params,
                              MTPDraft(head, parts.embed, parts.logits), k=3)
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    stats = engine.snapshot()
    assert stats.speculative_method == "mtp" and stats.drafted_tokens > 0


def test_the_mtp_head_reads_the_models_hidden_states_at_every_position(tmp_path):
    """Each first draft is what the head gives over the request's decoded positions, read
    offline from one forward of the whole sequence: every plain and verify step handed the
    head the right hidden state with the right next token."""
    import mlx.core as mx

    from serve_app.models.mtp import load_mtp_head

    path = materialize("tiny-hybrid-mtp", tmp_path)  # fp32: the offline forward rounds alike
    model, tokenizer = mlx_lm.load(str(path))
    head, parts = load_mtp_head(model, path)
    stops = set(tokenizer.eos_token_ids)
    ps = prompts(tokenizer, 2)
    params = [SamplingParams(max_tokens=20)] * 2
    source = LoggedMTP(head, parts.embed, parts.logits)
    out, _ = speculating(model, stops, ps, params, source, k=1)
    checked = 0
    for row, proposal in source.log:
        n, first = len(row.tokens), row.prompt_len
        if not proposal:
            assert n - 2 < first  # only a request's first decode step has no hidden state
            continue
        hidden = parts.inner(mx.array([row.tokens[:-1]]))
        entries = list(range(first, n - 1))
        g = head(parts.embed(mx.array([[row.tokens[q + 1] for q in entries]])),
                 hidden[:, first : n - 1], head.make_cache())
        assert proposal == [int(mx.argmax(parts.logits(g)[0, -1]).item())], (n, first)
        checked += 1
    assert checked >= 20
