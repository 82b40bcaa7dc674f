"""Structured output (``response_format``): grammar-constrained decoding on the embedded model.

The random-weight model writes noise; constrained, its noise must still be JSON that parses
and validates, greedy and sampled, alone (``mlx_lm.stream_generate``) and in a
``BatchGenerator`` batch beside an unconstrained request that it must not change.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_sampler

from bench.structured import SCHEMA
from serve_app.models.embedded import SPECIAL_TOKENS, materialize
from serve_app.serving.samplers import make_request_sampler
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.structured import (
    Grammar,
    StructuredOutputError,
    compile_response_format,
    parse_response_format,
)

# One schema: what the bench times is what the tests check.
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}
JSON_OBJECT = {"type": "json_object"}
PROMPTS = ["hi", "Give me JSON"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_lm.load(str(materialize("tiny-dense", tmp_path_factory.mktemp("structured"))))


def closing_bias(strength: float):
    """A stand-in for a model that ends its strings: the random model never closes the
    first key of a free-form object, so json_object tests nudge '"', '}' and ']' up."""
    bias = np.zeros(256 + len(SPECIAL_TOKENS), dtype=np.float32)
    bias[[ord('"'), ord("}"), ord("]")]] = strength
    nudge = mx.array(bias)
    return lambda tokens, logits: logits + nudge


def generate(loaded, prompt: str, processors: list, temp: float, seed: int = 0,
             max_tokens: int = 300) -> tuple[str, str | None]:
    model, tokenizer = loaded
    mx.random.seed(seed)
    text, finish = "", None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                             sampler=make_sampler(temp=temp), logits_processors=processors):
        text += r.text
        finish = r.finish_reason
    return text, finish


# ---- generation ------------------------------------------------------------------------


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_schema_output_parses_and_validates(loaded, prompt, temp):
    grammar = compile_response_format(PERSON, loaded[1])
    proc = grammar.processor()
    text, finish = generate(loaded, prompt, [proc], temp, seed=len(prompt))
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert proc.finished and proc.accepting and proc.error is None


@pytest.mark.parametrize("temp,strength", [(0.0, 2.0), (1.0, 4.0)])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_object_output_is_an_object(loaded, prompt, temp, strength):
    grammar = compile_response_format(JSON_OBJECT, loaded[1])
    proc = grammar.processor()
    text, finish = generate(loaded, prompt, [closing_bias(strength), proc], temp)
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)
    assert proc.finished and proc.error is None


def test_unconstrained_output_is_not_json(loaded):
    """The control: without the processor the same generations are not JSON."""
    for prompt in PROMPTS:
        text, _ = generate(loaded, prompt, [closing_bias(2.0)], 0.0, max_tokens=40)
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_speculative_decoding_with_a_draft_model(loaded, tmp_path_factory, temp):
    """mlx-lm's speculative decoding runs the processor for the draft and the target and
    takes rejected tokens back; the output still validates (the 4-bit copy of the model
    drafts, and at temperature 1 many of its tokens are rejected)."""
    model, tokenizer = loaded
    draft, _ = mlx_lm.load(str(materialize("tiny-dense-q4",
                                           tmp_path_factory.mktemp("structured-draft"))))
    proc = compile_response_format(PERSON, tokenizer).processor()
    mx.random.seed(3)
    text, drafted, finish = "", [], None
    for r in stream_generate(model, tokenizer, "Give me JSON", max_tokens=300,
                             draft_model=draft, num_draft_tokens=3,
                             sampler=make_sampler(temp=temp), logits_processors=[proc]):
        text += r.text
        drafted.append(r.from_draft)
        finish = r.finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert proc.error is None and any(drafted)
    if temp:
        assert not all(drafted[:-1])  # some drafts were rejected, so rolled back


def _run_batch(model, eos: set[int], prompts: list[list[int]], processors: list[list],
               params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    """Each prompt's (tokens without EOS, finish reason) from one BatchGenerator."""
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(eos)],
                         completion_batch_size=4, prefill_batch_size=4)
    try:
        uids = gen.insert(prompts, max_tokens=[p.max_tokens for p in params],
                          logits_processors=processors,
                          samplers=[make_request_sampler(p) for p in params])
        out: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        while len(finish) < len(uids):
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
        return [([t for t in out[u] if t not in eos], finish[u]) for u in uids]
    finally:
        gen.close()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=300),
                                    SamplingParams(max_tokens=300, temperature=1.0, seed=7)])
def test_constrained_and_free_requests_share_a_batch(loaded, params):
    """BatchGenerator takes logits processors per request: the constrained row validates,
    the free row gives exactly the tokens it gives alone, and so does the constrained one."""
    model, tokenizer = loaded
    grammar = compile_response_format(PERSON, tokenizer)
    eos = set(tokenizer.eos_token_ids)
    constrained = tokenizer.encode("Give me JSON")
    free, free_params = tokenizer.encode("Tell me a story"), SamplingParams(max_tokens=40)
    proc = grammar.processor()
    both = _run_batch(model, eos, [constrained, free], [[proc], []], [params, free_params])
    (tokens, finish), (free_tokens, free_finish) = both
    assert finish == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    assert proc.finished and proc.error is None
    assert free_finish == "length" and len(free_tokens) == 40
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(free_tokens))
    assert _run_batch(model, eos, [free], [[]], [free_params]) == [both[1]]
    alone = _run_batch(model, eos, [constrained], [[grammar.processor()]], [params])
    assert alone == [both[0]]


# ---- the processor itself ----------------------------------------------------------------


def _finite(logits: mx.array) -> set[int]:
    return set(np.nonzero(np.isfinite(np.array(logits.astype(mx.float32)))[0])[0].tolist())


def test_processor_masks_feeds_and_rolls_back(loaded):
    tokenizer = loaded[1]
    proc = compile_response_format(JSON_OBJECT, tokenizer).processor()
    prompt = tokenizer.encode("hi")
    logits = mx.zeros((1, 259))
    assert _finite(proc(mx.array(prompt), logits)) == {ord("{")}  # the prompt is not fed
    doc = list(b'{"a":1}')
    seen = prompt + doc
    assert _finite(proc(mx.array(seen), logits)) == set(tokenizer.eos_token_ids)
    assert proc.finished
    # Speculative decoding takes tokens back and rewrites them: the matcher follows.
    rewritten = list(b'{"b":[]}')
    assert _finite(proc(mx.array(prompt + rewritten[:-1]), logits)) == {ord(","), ord("}")}
    assert _finite(proc(mx.array(prompt + rewritten), logits)) == set(tokenizer.eos_token_ids)
    assert _finite(proc(mx.array(prompt + doc[:2]), logits)) >= {ord("a"), ord("b")}
    assert not proc.finished
    # A token the mask forbade (another processor changed the logits): EOS only, and why.
    bad = prompt + doc[:2] + [ord("\n")]  # a raw newline inside a string
    assert _finite(proc(mx.array(bad), logits)) == set(tokenizer.eos_token_ids)
    assert proc.error


def test_processor_keeps_dtype_and_fits_the_logits_width(loaded):
    tokenizer = loaded[1]
    grammar = compile_response_format(JSON_OBJECT, tokenizer)
    prompt = mx.array(tokenizer.encode("hi"))
    wide = grammar.processor()(prompt, mx.zeros((1, 300), dtype=mx.bfloat16))  # padded vocab
    assert wide.dtype == mx.bfloat16 and wide.shape == (1, 300)
    assert _finite(wide) == {ord("{")}
    narrow = grammar.processor()(prompt, mx.zeros((1, 200)))
    assert narrow.shape == (1, 200) and _finite(narrow) == {ord("{")}


def test_compiled_grammars_are_cached_by_canonical_schema(loaded):
    tokenizer = loaded[1]
    reordered = {"type": "json_schema", "json_schema": {
        "name": "other_name", "schema": dict(reversed(list(SCHEMA.items())))}}
    first = compile_response_format(PERSON, tokenizer)
    again = compile_response_format(reordered, tokenizer)
    assert isinstance(first, Grammar) and first.kind == "json_schema"
    assert again._template is first._template
    assert first.processor()._matcher is not first.processor()._matcher


# ---- validation ----------------------------------------------------------------------------


def test_text_means_no_grammar(loaded):
    assert compile_response_format({"type": "text"}, loaded[1]) is None
    assert parse_response_format({"type": "json_object"}) == ("json_object", {"type": "object"})


def _schema(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}


@pytest.mark.parametrize("response_format,param,words", [
    ("json", "response_format", "must be an object"),
    (["json_object"], "response_format", "must be an object"),
    ({}, "response_format.type", "required"),
    ({"type": "xml"}, "response_format.type", "'xml'"),
    ({"type": "json_schema"}, "response_format.json_schema", "required"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema", "object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
     "response_format.json_schema.name", "required"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
     "response_format.json_schema.name", "1-64"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format.json_schema.schema", "required"),
    (_schema([1]), "response_format.json_schema.schema", "JSON Schema object"),
    (_schema(SCHEMA, strict="yes"), "response_format.json_schema.strict", "boolean"),
    (_schema(SCHEMA, description=3), "response_format.json_schema.description", "string"),
    (_schema({"type": "nonsense"}), "response_format.json_schema.schema", "nonsense"),
    (_schema({"type": "object", "properties": []}), "response_format.json_schema.schema",
     "properties"),
    (_schema({"type": "string", "pattern": "("}), "response_format.json_schema.schema",
     "regex"),
    (_schema({"$ref": "#/definitions/missing"}), "response_format.json_schema.schema",
     "missing"),
    (_schema({"type": "integer", "minimum": 5, "maximum": 1}),
     "response_format.json_schema.schema", "nsatisfiable"),
    (_schema({"type": "number", "maximum": float("nan")}),
     "response_format.json_schema.schema", "not valid JSON"),
])
def test_bad_response_formats_raise(loaded, response_format, param, words):
    with pytest.raises(StructuredOutputError) as info:
        compile_response_format(response_format, loaded[1])
    assert isinstance(info.value, ValueError)
    assert info.value.param == param
    assert words in str(info.value)


def test_a_bad_schema_fails_again_from_the_cache(loaded):
    bad = _schema({"type": "nonsense"})
    for _ in range(2):
        with pytest.raises(StructuredOutputError, match="nonsense"):
            compile_response_format(bad, loaded[1])


def test_a_hugging_face_tokenizer_works_too(loaded):
    """Besides mlx-lm's TokenizerWrapper, the fast Hugging Face tokenizer it wraps."""
    hf = loaded[1]._tokenizer
    proc = compile_response_format(PERSON, hf).processor()
    prompt = hf.encode("hi")
    assert _finite(proc(mx.array(prompt), mx.zeros((1, 259)))) == {ord("{")}
    doc = list(json.dumps({"name": "A", "age": 1, "role": "user",
                           "address": {"city": "B", "zip": "12345"}, "tags": []},
                          separators=(",", ":")).encode())
    assert _finite(proc(mx.array(prompt + doc), mx.zeros((1, 259)))) == {hf.eos_token_id}
    assert proc.finished and proc.error is None
