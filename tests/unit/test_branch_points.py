"""Branch points from one rendering: the prompt's own text, tokenized once with offsets,
gives the same prompt and the same branch points as rendering shorter conversations.

Checked on the embedded tokenizers (dense and hybrid) against the render-based search
(``find_branch_points``) over conversations of every shape the preparer sees: system
blocks as text parts, tools, tool calls, an assistant turn last, a client's
``cache_control`` points; and a template that rewrites contents falls back cleanly.
"""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from serve_app.cache.prefix import branch_points_in_text, find_branch_points
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.prepare import Preparer
from serve_app.serving.request import Caller, ChatCompletionRequest

LONG = "The archive keeps letters, ledgers and maps from the old harbour town. " * 20
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
CONVERSATIONS = {
    "system and user": [{"role": "system", "content": LONG},
                        {"role": "user", "content": "What is in the archive?"}],
    "user only": [{"role": "user", "content": "hello there"}],
    "two turns": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "one " * 40},
                  {"role": "assistant", "content": "ok " * 30},
                  {"role": "user", "content": "two " * 40}],
    "system parts": [{"role": "system", "content": [{"type": "text", "text": LONG},
                                                    {"type": "text", "text": "Second block."}]},
                     {"role": "user", "content": "Go on."}],
    "assistant last": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Start a story."},
                       {"role": "assistant", "content": "Once upon a time"}],
    "tool call": [{"role": "system", "content": "You read files."},
                  {"role": "user", "content": "Show me a.txt"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "read_file",
                                                "arguments": "{\"path\": \"a.txt\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "the contents of a"},
                  {"role": "user", "content": "Thanks, and b.txt?"}],
    "repeated content": [{"role": "system", "content": "same"},
                         {"role": "user", "content": "same"},
                         {"role": "assistant", "content": "same"},
                         {"role": "user", "content": "same"}],
}


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def preparer(request, tmp_path_factory):
    path = materialize(request.param, tmp_path_factory.mktemp("branch-points"))
    profile = ModelProfile(name="m", source=f"embedded:{request.param}", context_length=8192)
    return Preparer(profile, load_tokenizer(path))


def rendered_twice(preparer: Preparer, request: ChatCompletionRequest):
    """The prompt and branch points as they were found before: by rendering again."""
    rendered = preparer.template_input(request)
    prompt = preparer.prompt_tokens(request, rendered)
    return prompt, preparer.branch_points(request, prompt, rendered)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_one_rendering_finds_what_rendering_again_finds(preparer, name):
    body = {"model": "m", "messages": CONVERSATIONS[name], "max_tokens": 4}
    if name == "tool call":
        body["tools"] = TOOLS
    if name == "assistant last":
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    request = ChatCompletionRequest.model_validate(body)
    saved = preparer.renders_saved
    prepared = preparer.prepare(request, Caller())
    assert preparer.renders_saved == saved + 1, "the one-rendering path was not taken"
    prompt, points = rendered_twice(preparer, request)
    assert prepared.prompt == prompt
    assert prepared.branch_points == points


def test_cache_control_points_still_count(preparer):
    request = ChatCompletionRequest.model_validate({
        "model": "m", "max_tokens": 4,
        "messages": [{"role": "system", "content": LONG},
                     {"role": "user", "content": "first " * 20},
                     {"role": "assistant", "content": "reply " * 20},
                     {"role": "user", "content": "second " * 20}]})
    request._cache_points = (2,)  # as the Anthropic route sets it from cache_control
    prepared = preparer.prepare(request, Caller())
    _, points = rendered_twice(preparer, request)
    assert prepared.branch_points == points and len(points) == 3


def test_a_content_the_template_rewrites_falls_back_to_rendering():
    messages = [{"role": "system", "content": "Keep it short."},
                {"role": "user", "content": "  spaced  "}]
    text = "<s>system: Keep it short.</s><s>user: spaced</s>"  # the template trimmed it
    assert branch_points_in_text(messages, text, list(range(1, len(text) + 1))) is None


def test_positions_map_to_the_tokens_before_them():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = "<sys>S</sys><user>U</user>"
    # One token per character: a content starting at character c starts at token c.
    ends = list(range(1, len(text) + 1))
    assert branch_points_in_text(messages, text, ends) == (text.index("U"),)

    def render(conversation):
        out = ""
        for m in conversation:
            tag = "sys" if m["role"] == "system" else "user"
            out += f"<{tag}>{m['content']}</{tag}>"
        return [ord(c) for c in out]

    prompt = [ord(c) for c in text]
    assert find_branch_points(messages, prompt, render) == (text.index("U"),)
