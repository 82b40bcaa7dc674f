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

import mlx_lm
import pytest

from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.drafts import (
    DraftRow,
    MTPDraft,
)
from serve_app.serving.engine import Engine
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.speculative import (
    SpeculationSettings,
    Speculator,
    VerifyCost,
)
from serve_app.serving.structured import compile_response_format
from tests.support.engine import Collector

# ---- units ----------------------------------------------------------------------------


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


    # (an unrelated random model drafting for the hybrid one: every draft rejected)


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, model_home):
    """``speculative.draft_model`` named in the error: SmolLM2 cannot draft for the tiny
    models (a byte-level tokenizer of their own)."""
    from serve_app.serving.service import load_draft_model

    _, tokenizer = mlx_lm.load(str(materialize("tiny-dense", tmp_path)))
    source = str(materialize("smollm2-135m", model_home))
    with pytest.raises(ValueError, match="speculative.draft_model: .* another tokenizer"):
        load_draft_model(source, tokenizer)


# ---- seeded sampling: the same tokens as plain decoding ---------------------------------


def seeded_params(tokenizer) -> list[SamplingParams]:
    """Seeded rows (one with top-p, one under a JSON grammar) beside a greedy row."""
    grammar = compile_response_format({"type": "json_object"}, tokenizer)
    return [SamplingParams(max_tokens=30, temperature=0.9, seed=101),
            SamplingParams(max_tokens=26, temperature=0.7, top_p=0.9, seed=102),
            SamplingParams(max_tokens=22, temperature=0.8, seed=103,
                           logits_processors=(grammar.processor(),)),
            SamplingParams(max_tokens=24)]


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


# ---- the service: profiles and prefix-cache tiers on every format ---------------------


MTPS = [f"tiny-hybrid-mtp-{f}" if f != "fp32" else "tiny-hybrid-mtp"
        for f in ("fp32", "bf16", "fp16", "q4")]
# Fixed depth: every step drafts where the prompt lookup finds a match, on every format.
SPEC = {"method": "ngram", "num_draft_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("spec-formats")


@pytest.fixture(scope="module", autouse=True)
def _close_formats():
    from tests.support.formats import close_loaded

    yield
    close_loaded()


def looping_prompt(seed: int, blocks: int) -> list[int]:
    """A prompt that repeats itself, so the lookup drafts from the first step."""
    period = [5 + (i * seed) % 240 for i in range(11)]
    return (period * (blocks * 16 // 11 + 2))[: blocks * 16 + 3]


MTP_SPEC = {"method": "mtp", "num_draft_tokens": 3, "adaptive": False}


def test_check_refuses_a_draft_model_with_another_tokenizer(tmp_path, model_home):
    """``serve-app check`` reads both tokenizers (local files) and names the key; a draft
    with the same tokenizer passes."""
    import os
    import subprocess
    import sys

    import yaml

    def check(draft: str) -> subprocess.CompletedProcess:
        path = tmp_path / f"{draft.replace(':', '-')}.yaml"
        path.write_text(yaml.safe_dump({"applications": [{
            "name": "llm", "import_path": "serve_app.app:build_app",
            "args": {"models": [{"name": "m", "source": "embedded:tiny-dense",
                                 "speculative": {"method": "draft",
                                                 "draft_model": draft}}]}}]}))
        env = {**os.environ, "SERVE_APP_HOME": str(model_home), "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)],
                              capture_output=True, text=True, env=env, timeout=600)

    bad = check("embedded:smollm2-135m")
    assert bad.returncode == 2, bad.stderr
    assert ("applications[0].args.models[0].speculative.draft_model: 'embedded:smollm2-135m' "
            "has another tokenizer") in bad.stderr
    good = check("embedded:tiny-dense-q4")
    assert good.returncode == 0, good.stderr


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


def test_mtp_without_an_mtp_head_is_refused_by_check_and_at_load(tmp_path, model_home):
    """``serve-app check`` names ``speculative.method`` for a checkpoint with no MTP head
    (the model beside it, which has one, passes); loading it anyway fails the same way."""
    import os
    import subprocess
    import sys

    import yaml

    from serve_app.serving.service import ModelService

    path = tmp_path / "mtp.yaml"
    models = [{"name": n, "source": f"embedded:{n}",
               "speculative": {"method": "mtp"}} for n in ("tiny-hybrid", "tiny-hybrid-mtp")]
    path.write_text(yaml.safe_dump({"applications": [{
        "name": "llm", "import_path": "serve_app.app:build_app", "args": {"models": models}}]}))
    env = {**os.environ, "SERVE_APP_HOME": str(model_home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "applications[0].args.models[0].speculative.method: the checkpoint" in done.stderr
    assert "no mtp.* weights" in done.stderr and "models[1]" not in done.stderr
    hybrid = materialize("tiny-hybrid", model_home)
    model, tokenizer = mlx_lm.load(str(hybrid))
    with pytest.raises(ValueError, match=r"speculative.method: mtp: .*no mtp\.\* weights"):
        ModelService(ModelProfile(**models[0]), model, tokenizer, hybrid)
