"""Hardening of the HTTP front, in-process: JSON nesting bounded, the prompt bound checked
before tokenizing, the engine warm-up leaving no trace in its counters, the new profile
keys' defaults, an ApiError pickled intact and the cache-isolating key read from either
API's header (the live server is tests/integration/test_hardening_http.py)."""

from __future__ import annotations

import json

import mlx_lm
import pytest

from serve_app.api.body import MAX_JSON_DEPTH, parse_json
from serve_app.config.profile import ModelProfile, parse_profile
from serve_app.models.embedded import materialize
from serve_app.serving.request import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from serve_app.serving.service import ModelService


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ---- startup readiness ------------------------------------------------------------------


# ---- request size ---------------------------------------------------------------------


# ---- JSON nesting ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,ok",
    [
        (nested(MAX_JSON_DEPTH), True),
        (nested(MAX_JSON_DEPTH + 1), False),
        ('{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1), False),
        (nested(100_000), False),  # the C parser's RecursionError
        (json.dumps({"s": "[" * 1000, "l": list(range(1000))}), True),  # brackets in a string
        (json.dumps([[i] for i in range(1000)]), True),  # many brackets, shallow
        # Escaped quotes and backslashes do not end a string early: its brackets never count.
        (json.dumps({"s": '\\"' + "[" * 100, "t": "\\", "u": "]" * 100}), True),
        (json.dumps({"s": '\\"]]', "l": json.loads(nested(MAX_JSON_DEPTH))}), False),
        ("[]," * 100_000 + "[]", True),  # wide: the depth comes from the bytes, not a walk
        (nested(MAX_JSON_DEPTH + 1).encode("utf-16"), False),  # json.loads takes UTF-16 too
        (nested(MAX_JSON_DEPTH).encode("utf-16"), True),
    ],
)
def test_parse_json_bounds_nesting(raw, ok):
    raw = raw if isinstance(raw, bytes) else raw.encode()
    if raw.startswith(b"[],"):
        raw = b"[" + raw + b"]"
    if ok:
        parse_json(raw)
        return
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert info.value.status == 400 and info.value.code == "json_too_deep"


# ---- prompt bound before tokenizing ----------------------------------------------------


class _NoTokenizer:
    """Fails any tokenizer use: the prompt bound must not need one."""

    def __init__(self, real) -> None:
        self.real = real

    def apply_chat_template(self, *a, **kw):
        raise AssertionError("tokenizer called")

    def encode(self, *a, **kw):
        raise AssertionError("tokenizer called")


@pytest.fixture(scope="module")
def service(model_home):
    path = materialize("tiny-dense", model_home)
    model, tokenizer = mlx_lm.load(str(path))
    profile = ModelProfile(name="m", source="embedded:tiny-dense", context_length=64,
                           cache={"enabled": False})
    svc = ModelService(profile, model, tokenizer)
    yield svc
    svc.shutdown()


def test_prompt_bound_is_checked_before_tokenizing(service):
    real = service.preparer.tokenizer
    service.preparer.tokenizer = _NoTokenizer(real)
    limit = 32 * 64  # derived from context_length
    try:
        for request in (
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "a" * 2049}]),
            CompletionRequest(model="m", prompt="a" * (limit + 1)),
            CompletionRequest(model="m", prompt=[1] * 64),
        ):
            with pytest.raises(ApiError) as info:
                service.prepare(request)
            assert info.value.code == "context_length_exceeded"
        with pytest.raises(AssertionError, match="tokenizer called"):  # under it: tokenized
            service.prepare(CompletionRequest(model="m", prompt="a" * limit))
    finally:
        service.preparer.tokenizer = real


def test_warm_up_leaves_no_trace_in_engine_counters(service):
    seconds = service.warm_up()
    assert seconds > 0
    stats = service.engine.snapshot()
    assert stats.submitted == stats.finished == stats.in_flight == 0
    assert stats.prompt_tokens == stats.generated_tokens == 0


def test_new_profile_keys_have_defaults():
    profile = parse_profile({"models": [{"name": "m", "source": "embedded:tiny-dense",
                                         "context_length": 100}]})
    assert profile.ingress.max_request_bytes == 16 * 1024 * 1024
    assert profile.models[0].max_prompt_chars is None
    assert profile.models[0].prompt_char_limit() == 3200
    profile = parse_profile({"models": [{"name": "m", "source": "embedded:tiny-dense",
                                         "max_prompt_chars": 10}],
                             "ingress": {"max_request_bytes": "2MiB"}})
    assert profile.ingress.max_request_bytes == 2 * 1024 * 1024
    assert profile.models[0].prompt_char_limit() == 10


def test_an_api_error_crosses_ray_intact():
    """A replica's ApiError (e.g. from count_tokens) is pickled back to the ingress."""
    import pickle

    err = pickle.loads(pickle.dumps(ApiError(400, "bad", param="p", code="c",
                                             headers={"Retry-After": "1"})))
    assert (err.status, err.message, err.param, err.code, err.headers) == (
        400, "bad", "p", "c", {"Retry-After": "1"})


def test_the_cache_isolating_key_is_read_from_either_apis_header():
    from starlette.requests import Request

    from serve_app.api.http import caller_of

    def caller(*headers):
        return caller_of(Request({"type": "http", "headers": [
            (k.encode(), v.encode()) for k, v in headers]}))

    bearer = caller(("authorization", "Bearer k1")).api_key_digest
    anthropic_key = caller(("x-api-key", "k1")).api_key_digest
    assert bearer == anthropic_key is not None  # the same key, the same tenant
    assert caller(("x-api-key", "k2")).api_key_digest != bearer
    assert caller().api_key_digest is None
