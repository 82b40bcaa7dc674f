"""Thought and answer split on token ids, streaming-safe; the budget and the answer's
grammar gate (serve_app.reasoning), without an engine."""

from __future__ import annotations

import mlx.core as mx
import pytest

from serve_app.reasoning.budget import ThoughtGate
from serve_app.reasoning.markers import ThinkingMarkers, markers_of
from serve_app.reasoning.split import ThoughtSplitter, opens_in_thought

ONE = ThinkingMarkers((90,), (91,), "<think>", "</think>")
MULTI = ThinkingMarkers((80, 81), (82, 83, 84), "<|a|>b", "<|c|>de")
V = 100


def parts(splitter: ThoughtSplitter, tokens: list[int]) -> list[tuple[str, int]]:
    out = [(p.value, t) for tok in tokens for p, t in splitter.feed(tok)]
    return out + [(p.value, t) for p, t in splitter.flush()]


def test_a_thought_opened_by_the_output_ends_at_its_marker():
    s = ThoughtSplitter(ONE, in_thought=False)
    got = parts(s, [90, 1, 2, 91, 3, 90, 91, 4])
    assert got == [("marker", 90), ("thought", 1), ("thought", 2), ("marker", 91),
                   ("answer", 3), ("answer", 90), ("answer", 91), ("answer", 4)]
    assert (s.thought_tokens, s.content_tokens) == (4, 2)


def test_an_output_that_does_not_open_with_a_thought_is_all_answer():
    s = ThoughtSplitter(ONE, in_thought=False)
    assert parts(s, [5, 90, 6, 91]) == [("answer", t) for t in (5, 90, 6, 91)]
    assert s.thought_tokens == 0


def test_a_prompt_that_opened_the_thought_starts_inside_it():
    s = ThoughtSplitter(ONE, in_thought=True)
    assert parts(s, [1, 91, 2]) == [("thought", 1), ("marker", 91), ("answer", 2)]


@pytest.mark.parametrize("cut", range(1, 9))
def test_markers_of_several_tokens_split_the_same_however_the_tokens_arrive(cut):
    tokens = [80, 81, 1, 82, 83, 2, 82, 83, 84, 3, 82]
    whole = parts(ThoughtSplitter(MULTI, False), tokens)
    assert whole == [("marker", 80), ("marker", 81), ("thought", 1), ("thought", 82),
                     ("thought", 83), ("thought", 2), ("marker", 82), ("marker", 83),
                     ("marker", 84), ("answer", 3), ("answer", 82)]
    s = ThoughtSplitter(MULTI, False)
    first = [(p.value, t) for tok in tokens[:cut] for p, t in s.feed(tok)]
    rest = parts(s, tokens[cut:])
    assert first + rest == whole


def test_a_marker_left_open_at_the_end_is_flushed_as_what_it_was_inside():
    s = ThoughtSplitter(MULTI, True)
    assert parts(s, [1, 82, 83]) == [("thought", 1), ("thought", 82), ("thought", 83)]


def test_the_prompt_says_whether_the_thought_is_open():
    assert opens_in_thought([7, 8, 90, 10], ONE)
    assert not opens_in_thought([7, 90, 1, 91, 10], ONE)  # enable_thinking false: closed
    assert not opens_in_thought([7, 8, 10], ONE)
    assert opens_in_thought([90, 1, 91, 5, 90], ONE)  # an earlier turn's thought, then open


class Recorder:
    """A stand-in for an answer grammar: records the prompt length it first saw and
    allows only token 7."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.start is None:
            self.start = tokens.size
        self.calls += 1
        return mx.where(mx.arange(V) == 7, logits, mx.array(float("-inf")))


def drive(gate: ThoughtGate, prompt: list[int], choose) -> list[int]:
    """Generate with ``gate`` as the only processor: ``choose(allowed)`` picks the next
    token among those the gate leaves finite."""
    out: list[int] = []
    for _ in range(12):
        logits = gate(mx.array(prompt + out), mx.zeros((1, V)))
        allowed = [i for i, v in enumerate(logits[0].tolist()) if v != float("-inf")]
        out.append(choose(allowed, len(out)))
    return out


def test_the_budget_closes_the_thought_with_the_models_own_marker():
    gate = ThoughtGate(ONE, in_thought=True, budget=3)
    out = drive(gate, [1, 2, 90], lambda allowed, i: 5 if 5 in allowed else allowed[0])
    assert out[:4] == [5, 5, 5, 91] and gate.splitter.content_tokens == 3
    gate = ThoughtGate(MULTI, in_thought=True, budget=2)
    out = drive(gate, [1, 80, 81], lambda allowed, i: 5 if 5 in allowed else allowed[0])
    assert out[:5] == [5, 5, 82, 83, 84]


def test_a_budget_of_zero_closes_the_thought_at_once():
    gate = ThoughtGate(ONE, in_thought=True, budget=0)
    assert drive(gate, [90], lambda allowed, i: allowed[0])[0] == 91


def test_the_answers_grammar_starts_after_the_thought():
    rec: list[Recorder] = []

    def answer():
        rec.append(Recorder())
        return (rec[-1],)

    gate = ThoughtGate(ONE, in_thought=True, budget=2, answer=answer)
    prompt = [1, 2, 90]
    out = drive(gate, prompt, lambda allowed, i: 5 if 5 in allowed else allowed[0])
    assert out[:3] == [5, 5, 91] and out[3:] == [7] * 9  # free thought, then the grammar
    assert len(rec) == 1 and rec[0].start == len(prompt) + 3  # it saw the thought as prompt


def test_an_output_that_may_open_a_thought_keeps_the_opening_marker_open():
    rec: list[Recorder] = []

    def answer():
        rec.append(Recorder())
        return (rec[-1],)

    gate = ThoughtGate(ONE, in_thought=False, budget=1, answer=answer)
    first: list[list[int]] = []

    def choose(allowed: list[int], i: int) -> int:
        if i == 0:
            first.append(allowed)
            return 90
        return 5 if 5 in allowed else allowed[0]

    out = drive(gate, [1], choose)
    assert first == [[7, 90]]  # the grammar's token, and the opening marker
    assert out[:4] == [90, 5, 91, 7]  # opened, one token of thought, closed, grammar
    assert rec[-1].start == 1 + 3  # made again after the thought
    gate = ThoughtGate(ONE, in_thought=False, budget=1, answer=answer)
    out = drive(gate, [1], lambda allowed, i: allowed[0])
    assert out == [7] * 12 and rec[-1].start == 1  # no thought: the first grammar stays


def test_an_output_that_may_not_open_a_thought_is_under_the_grammar_at_once():
    rec: list[Recorder] = []

    def answer():
        rec.append(Recorder())
        return (rec[-1],)

    gate = ThoughtGate(ONE, in_thought=False, budget=None, answer=answer, may_open=False)
    first: list[list[int]] = []

    def choose(allowed: list[int], i: int) -> int:
        first.append(allowed)
        return allowed[0]

    assert drive(gate, [1], choose) == [7] * 12 and first[0] == [7]
    assert len(rec) == 1 and rec[0].start == 1


def test_a_rollback_is_followed():
    gate = ThoughtGate(ONE, in_thought=True, budget=2)
    gate(mx.array([90]), mx.zeros((1, V)))
    gate(mx.array([90, 5]), mx.zeros((1, V)))
    gate(mx.array([90, 5, 91]), mx.zeros((1, V)))
    assert gate.splitter.thought_done
    logits = gate(mx.array([90, 5, 6]), mx.zeros((1, V)))  # 91 taken back, 6 instead
    assert not gate.splitter.thought_done
    assert [i for i, v in enumerate(logits[0].tolist()) if v != float("-inf")] == [91]


def test_markers_come_from_the_tokenizer_or_the_named_parser(hybrid_tokenizer):
    auto = markers_of(hybrid_tokenizer)
    assert auto is not None and auto.start_text == "<think>" and len(auto.start) == 1
    assert markers_of(hybrid_tokenizer, "qwen3") == auto
    assert markers_of(hybrid_tokenizer, "none") is None


@pytest.fixture(scope="module")
def hybrid_tokenizer(model_home):
    from mlx_lm.utils import load_tokenizer

    from serve_app.models.embedded import materialize

    return load_tokenizer(materialize("tiny-hybrid", model_home))


def test_the_next_turn_prefix_is_what_two_next_messages_share():
    from serve_app.reasoning.ahead import History, covered, next_turn_prefix

    seen: list[list[dict]] = []

    def render(messages: list[dict]) -> list[int]:
        seen.append(messages)
        out: list[int] = []
        for m in messages:  # role id, content's characters, end of turn
            out += [{"system": 1, "user": 2, "assistant": 3}[m["role"]]]
            out += [ord(c) for c in m["content"]] + [0]
        return out

    history = History(({"role": "user", "content": "hi"},), None, {})
    prefix = next_turn_prefix(render, history, {"role": "assistant", "content": "yo"})
    assert prefix == [2, ord("h"), ord("i"), 0, 3, ord("y"), ord("o"), 0, 2]
    assert [m["content"] for m in seen[0]] == ["hi", "yo", "a"]
    generated = [2, ord("h"), ord("i"), 0, 3, 90, 5, 91, ord("y"), ord("o"), 0]
    assert not covered(prefix, generated)  # the thought (90 5 91) is not in the prefix
    assert covered(prefix, prefix[:-1])  # generated as rendered: nothing to prefill
    assert covered(prefix[:5], generated)


def test_a_plan_knows_whether_the_generation_prompt_holds_a_thought():
    from serve_app.reasoning.plan import plan_thinking

    assert plan_thinking(ONE, [7, 8, 90, 10], None).prompt_thought  # opened
    assert plan_thinking(ONE, [7, 90, 10, 10, 91, 10, 10], None).prompt_thought  # off
    plain = plan_thinking(ONE, [7, 8, 9, 10], 5)
    assert plain is not None and not plain.prompt_thought and plain.budget == 5
    assert plan_thinking(None, [7], None) is None


class HarmonyTokenizer:
    """gpt-oss's special tokens as single ids; every other character its code point."""

    SPECIAL = {"<|channel|>": 1000, "<|message|>": 1001, "<|end|>": 1002, "<|start|>": 1003,
               "<|return|>": 1004}

    has_thinking = False

    def get_vocab(self) -> dict[str, int]:
        return dict(self.SPECIAL)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        while text:
            special = next((s for s in self.SPECIAL if text.startswith(s)), None)
            if special:
                out.append(self.SPECIAL[special])
                text = text[len(special):]
            else:
                out.append(ord(text[0]))
                text = text[1:]
        return out


def test_gpt_oss_thinks_on_the_analysis_channel_and_answers_on_the_final_one():
    tok = HarmonyTokenizer()
    markers = markers_of(tok, "gpt_oss")
    assert markers is not None and markers_of(tok) == markers  # auto finds it too
    out = tok.encode("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant"
                     "<|channel|>final<|message|>Hi")
    got = parts(ThoughtSplitter(markers, in_thought=False), out)
    assert "".join(chr(t) for p, t in got if p == "thought") == "Hmm."
    assert "".join(chr(t) for p, t in got if p == "answer") == "Hi"
    assert {t for p, t in got if p == "marker"} >= set(tok.SPECIAL.values()) - {1004}
    with pytest.raises(ValueError, match="gpt_oss"):
        markers_of(Plain(), "gpt_oss")


class Plain(HarmonyTokenizer):
    SPECIAL = {"<|endoftext|>": 1}


def test_the_newlines_after_the_closing_marker_belong_to_it(hybrid_tokenizer):
    from serve_app.reasoning.plan import ThinkingPlan
    from serve_app.reasoning.text import ThoughtText

    markers = markers_of(hybrid_tokenizer)
    nl = hybrid_tokenizer.encode("\n", add_special_tokens=False)
    a = hybrid_tokenizer.encode("A\n", add_special_tokens=False)
    text = ThoughtText(hybrid_tokenizer, set(), ThinkingPlan(markers, True, None))
    hm = hybrid_tokenizer.encode("hm", add_special_tokens=False)
    got = [text.feed(t) for t in [*hm, *markers.end, *nl, *nl, *a]]
    assert "".join(t for t, _ in got) == "hm"
    assert [tok for _, answer in got for tok in answer] == a  # the answer's own newline kept
    assert text.splitter.thought_tokens == len(hm) + len(markers.end) + 2 * len(nl)


def test_an_output_without_a_thought_keeps_its_newlines(hybrid_tokenizer):
    """Only a closing marker's newlines are the template's: an answer that opens with no
    thought ('<tool_call>' then a newline) keeps every token."""
    from serve_app.reasoning.plan import ThinkingPlan
    from serve_app.reasoning.text import ThoughtText

    markers = markers_of(hybrid_tokenizer)
    tokens = hybrid_tokenizer.encode("A\n\nB\n", add_special_tokens=False)
    text = ThoughtText(hybrid_tokenizer, set(), ThinkingPlan(markers, False, None))
    got = [text.feed(t) for t in tokens]
    assert [tok for _, answer in got for tok in answer] == tokens
    assert "".join(t for t, _ in got) == "" and text.splitter.thought_tokens == 0


def test_a_prefill_ahead_waits_for_a_free_slot_and_never_piles_up():
    import asyncio

    from serve_app.reasoning.ahead import HistoryAhead, ThinkingStats

    rendered: list[int] = []

    async def go():
        ahead = HistoryAhead(ThinkingStats(), max_running=1)

        def prefix() -> list[int]:
            rendered.append(1)
            return [1, 2, 3]

        async def prefill(tokens: list[int]) -> int:
            await asyncio.sleep(0)
            return 1

        seen = [9, 9, 9, 9]  # what the turn prefilled and generated: not the prefix
        ahead.schedule(prefix, seen, prefill, free=lambda: False)  # no free slot
        ahead.schedule(prefix, seen, prefill)
        ahead.schedule(prefix, seen, prefill)  # one already under way
        await ahead.idle()
        return ahead.stats

    stats = asyncio.run(go())
    assert stats.ahead == {"done": 1, "not_needed": 0, "busy": 2, "failed": 0}
    assert rendered == [1] and stats.ahead_prefilled_tokens == 2


def test_after_tool_calls_the_next_message_probed_is_a_tool_result():
    from serve_app.reasoning.ahead import History, next_turn_prefix

    roles: list[str] = []

    def render(messages: list[dict]) -> list[int]:
        roles.append(messages[-1]["role"])
        return [len(m["content"]) for m in messages] + [ord(messages[-1]["content"])]

    history = History(({"role": "user", "content": "hi"},), None, {})
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    next_turn_prefix(render, history, call)
    next_turn_prefix(render, history, {"role": "assistant", "content": "yo"})
    assert roles == ["tool", "tool", "user", "user"]


@pytest.mark.parametrize("kwargs,param", [
    ({"padding": "max_length", "max_length": 10**9}, "chat_template_kwargs"),
    ({"enable_thinking": {"nested": True}}, "chat_template_kwargs.enable_thinking"),
    ({"x": "y" * 1001}, "chat_template_kwargs.x"),
    ({f"k{i}": i for i in range(17)}, "chat_template_kwargs"),
    ({"tokenize": False}, "chat_template_kwargs"),
])
def test_template_kwargs_are_a_few_plain_values_never_the_calls_own(kwargs, param):
    from serve_app.serving.request import ApiError, ChatCompletionRequest

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                chat_template_kwargs=kwargs)
    with pytest.raises(ApiError) as refused:
        req.check_supported()
    assert refused.value.status == 400 and refused.value.param == param
    ok = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                               chat_template_kwargs={"enable_thinking": False, "x": 1.5})
    ok.check_supported()
