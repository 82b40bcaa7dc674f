"""Prompt normalization (serve_app/serving/normalize.py) through the Preparer, with the embedded
model's real tokenizer and chat template: a matched request renders exactly the tokens of
the same request without the quirk; a request the rules do not match renders exactly the
tokens it renders with the rules off."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from serve_app.api.anthropic_request import parse_messages_request, to_chat_input
from serve_app.api.http import chat_request
from serve_app.config.normalize_rules import RULE_NAMES, RULES
from serve_app.config.profile import ModelProfile, parse_profile
from serve_app.models.embedded import materialize
from serve_app.serving.normalize import normalize
from serve_app.serving.prepare import Preparer
from serve_app.serving.request import ChatCompletionRequest

BILLING = "x-anthropic-billing-header: cc_version=2.1.37.a1f; cc_entrypoint=cli; cch={};"
IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."
SYSTEM = "You are an interactive CLI tool that helps users with software engineering tasks. " * 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(materialize("tiny-dense", tmp_path_factory.mktemp("home")))


def preparer(tokenizer, rules: list[str] | None = None) -> Preparer:
    profile = {"name": "m", "source": "embedded:tiny-dense", "context_length": 4096}
    if rules is not None:
        profile["normalize"] = rules
    return Preparer(ModelProfile.model_validate(profile), tokenizer)


def chat(messages: list[dict]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def anthropic(system: list[dict], messages: list[dict] | None = None) -> ChatCompletionRequest:
    body = {"model": "m", "max_tokens": 8, "system": system,
            "messages": messages or [{"role": "user", "content": "List the files."}]}
    parsed = parse_messages_request(body)
    return chat_request(to_chat_input(parsed), "m", False)


def block(text: str, cached: bool = False) -> dict:
    out = {"type": "text", "text": text}
    if cached:
        out["cache_control"] = {"type": "ephemeral"}
    return out


def test_the_rule_table_is_documented_and_named_once():
    assert len(set(RULE_NAMES)) == len(RULES)
    for rule in RULES:
        assert rule.name and rule.prefix and len(rule.why) > 40


def test_claude_codes_rotating_block_renders_as_if_it_were_not_there(tokenizer):
    p = preparer(tokenizer)
    without = p.prepare(anthropic([block(IDENTITY), block(SYSTEM, cached=True)]))
    prompts = []
    for cch in ("3f2a1", "9bc07"):
        prepared = p.prepare(anthropic([block(BILLING.format(cch)), block(IDENTITY),
                                        block(SYSTEM, cached=True)]))
        assert prepared.normalized == ("claude_code_billing_header",)
        prompts.append(prepared.prompt)
    assert prompts[0] == prompts[1] == without.prompt
    assert without.normalized == ()


def test_switched_off_the_block_stays_and_every_request_differs(tokenizer):
    p = preparer(tokenizer, rules=[])
    a, b = (p.prepare(anthropic([block(BILLING.format(c)), block(SYSTEM)])) for c in "ab")
    assert a.prompt != b.prompt and a.normalized == b.normalized == ()
    first = next(i for i, (x, y) in enumerate(zip(a.prompt, b.prompt, strict=False)) if x != y)
    # The difference sits in the first block: nothing after it is reused.
    assert first < len(tokenizer.encode(BILLING.format("a"))) + 8


def test_the_block_is_dropped_wherever_it_stands_among_system_blocks(tokenizer):
    p = preparer(tokenizer)
    moved = p.prepare(anthropic([block(IDENTITY), block(BILLING.format("00000")),
                                 block(SYSTEM)]))
    plain = p.prepare(anthropic([block(IDENTITY), block(SYSTEM)]))
    assert moved.prompt == plain.prompt and moved.normalized == ("claude_code_billing_header",)


def test_openai_shapes_a_part_or_a_first_line_of_a_system_string(tokenizer):
    p = preparer(tokenizer)
    plain = p.prepare(chat([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "hi"}]))
    as_part = p.prepare(chat([
        {"role": "system", "content": [block(BILLING.format("12345") + "\n"), block(SYSTEM)]},
        {"role": "user", "content": "hi"}]))
    flattened = p.prepare(chat([{"role": "system", "content": BILLING.format("54321") + "\n"
                                 + SYSTEM}, {"role": "user", "content": "hi"}]))
    assert as_part.prompt == flattened.prompt == plain.prompt
    assert as_part.normalized == flattened.normalized == ("claude_code_billing_header",)


@pytest.mark.parametrize("messages", [
    # the prefix in user and assistant content, or not at the start of a system block
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": BILLING.format("aaaaa")},
     {"role": "assistant", "content": BILLING.format("bbbbb")},
     {"role": "user", "content": "and again"}],
    [{"role": "system", "content": "Note: " + BILLING.format("ccccc")},
     {"role": "user", "content": "hi"}],
    [{"role": "system", "content": " " + BILLING.format("ddddd") + "\nrest"},
     {"role": "user", "content": "hi"}],
    [{"role": "developer", "content": [block("X-Anthropic-Billing-Header: cch=1;")]},
     {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "no system message at all"}],
])
def test_a_request_the_rules_do_not_match_keeps_its_exact_tokens(tokenizer, messages):
    on = preparer(tokenizer).prepare(chat(messages))
    off = preparer(tokenizer, rules=[]).prepare(chat(messages))
    assert on.prompt == off.prompt and on.normalized == ()


def test_anthropic_requests_without_the_block_keep_their_tokens(tokenizer):
    request = anthropic([block(IDENTITY), block(SYSTEM, cached=True)],
                        [{"role": "user", "content": [block(BILLING.format("zzzzz"))]}])
    on, off = preparer(tokenizer).prepare(request), preparer(tokenizer, []).prepare(request)
    assert on.prompt == off.prompt and on.normalized == ()


def test_an_emptied_system_message_keeps_its_place_for_cache_points(tokenizer):
    only = chat([{"role": "system", "content": BILLING.format("fffff")},
                 {"role": "user", "content": "hi"}])
    out = normalize(only.messages, RULES)
    assert [m["role"] for m in out.messages] == ["system", "user"]
    assert out.messages[0]["content"] == "" and out.applied == ("claude_code_billing_header",)


def test_a_profile_naming_an_unknown_rule_is_refused_with_its_key():
    models = [{"name": "m", "source": "embedded:tiny-dense", "normalize": ["strip_dates"]}]
    with pytest.raises(ValueError, match=r"qwen\.yaml: models\[0\]\.normalize: unknown "
                                         r"normalization rule\(s\) 'strip_dates'"):
        parse_profile({"models": models}, where="qwen.yaml")
