"""The trace replay's loader and scaler (``bench.traces``), without a server.

Same hash id -> same text, the system prompt shared by every session, each turn the
whole conversation so far with the server's own answers in it, sessions ending before
they pass the context, and the report's rows and plot from a synthetic result.
"""

from __future__ import annotations

import json
import re

import pytest

from bench import report, traces
from bench.traces import (
    Arm,
    Scale,
    Trace,
    TraceRequest,
    anthropic_body,
    block_text,
    expand_runs,
    load_traces,
    openai_messages,
    plan_session,
    plan_sessions,
    run_arm,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def request(ids, think: float = 10.0, t: float = 0.0) -> TraceRequest:
    return TraceRequest(t, 64 * len(ids), 100, tuple(ids), think, "n", ("tool_result",))


def trace(*requests: TraceRequest, system_tokens: int = 3 * 64, tid: str = "t1") -> Trace:
    return Trace(tid, 64, system_tokens, 64, tuple(requests))  # 3 + 1 system blocks


def test_the_committed_selection_loads_with_its_runs_expanded():
    loaded = load_traces()
    assert len(loaded) >= 8  # enough for the default 8 sessions, one trace each
    assert len({t.id for t in loaded}) == len(loaded)
    for t in loaded:
        assert t.block_size == 64 and 200 <= t.system_blocks <= 260
        assert 1 <= len(t.requests) <= 16
        first = t.requests[0].hash_ids
        assert abs(len(first) - t.requests[0].input_tokens / 64) <= 1  # an id per 64 tokens
        for a, b in zip(t.requests, t.requests[1:], strict=False):
            assert b.hash_ids[:len(a.hash_ids) - 1] == a.hash_ids[:-1]  # each extends
    assert expand_runs([[1, 3], [9, 2]]) == (1, 2, 3, 9, 10)


def test_upstream_format_with_plain_hash_ids_loads(tmp_path):
    path = tmp_path / "trace_0001.json"
    path.write_text(json.dumps({"id": "x", "block_size": 64, "system_tokens": 10,
                                "tool_tokens": 20, "requests": [
                                    {"t": 0, "type": "n", "in": 100, "out": 5,
                                     "hash_ids": [1, 2], "think_time": 0.0}]}))
    (t,) = load_traces(path)
    assert t.requests[0].hash_ids == (1, 2) and t.requests[0].output_tokens == 5


def test_same_hash_id_same_text_and_other_ids_other_text():
    assert block_text("t1:7", 6) == block_text("t1:7", 6)
    assert len(block_text("t1:7", 6)) == 6 and block_text("t1:7", 6).endswith(" ")
    texts = {block_text(f"t1:{i}", 8) for i in range(200)}
    assert len(texts) == 200
    # A trace that comes back to block 5 after other content renders it the same way.
    t = trace(request(range(1, 7)), request([*range(1, 7), 5, 9]))
    plan = plan_session(t, 0, 4, Scale(tokens_per_block=5))
    assert plan.turns[1].user == block_text("t1:5", 5) + block_text("t1:9", 5)
    assert block_text("t1:5", 5) in plan.turns[0].user


def test_sessions_share_the_system_prompt_and_nothing_else():
    loaded = load_traces()
    scale = Scale(tokens_per_block=4, max_turns=3)
    system, plans = plan_sessions(loaded, 8, scale)
    assert len(system) == traces.shared_system_blocks(loaded) * 4
    firsts = [openai_messages(system, [], p.turns[0].user) for p in plans]
    assert all(m[0] == {"role": "system", "content": system} for m in firsts)
    # Past the system prompt the sessions differ: their traces' own content.
    assert len({m[1]["content"][:40] for m in firsts}) == len(plans)
    # More sessions than traces: a trace is reused under another namespace, not resent.
    _, many = plan_sessions(loaded[:2], 3, scale)
    assert many[2].trace == many[0].trace and many[2].turns[0].user != many[0].turns[0].user


def test_system_blocks_of_a_trace_render_as_the_shared_prompt():
    # This trace's first 4 blocks (1..4) are its system prompt; ids 1..4 reappearing later
    # render as the shared prompt's blocks, whatever the trace calls them.
    t = trace(request(range(1, 9)), request([*range(1, 9), 2]))
    plan = plan_session(t, 0, 4, Scale(tokens_per_block=4))
    assert plan.turns[0].user == "".join(block_text(f"t1:{i}", 4) for i in range(5, 9))
    assert plan.turns[1].user == block_text("system:1", 4)
    # A shared prompt shorter than the trace's: its extra system blocks are user content.
    plan = plan_session(t, 0, 2, Scale(tokens_per_block=4))
    assert plan.turns[0].user.startswith(block_text("t1:3", 4))


def test_each_turn_sends_the_new_blocks_only_and_scales_think_time():
    t = trace(request(range(1, 7)), request(range(1, 10), think=30.0),
              request(range(1, 11), think=400.0))
    plan = plan_session(t, 0, 4, Scale(tokens_per_block=4, think_scale=0.1, max_think=2.0))
    assert [turn.blocks for turn in plan.turns] == [2, 3, 1]
    assert plan.turns[1].user == "".join(block_text(f"t1:{i}", 4) for i in (7, 8, 9))
    assert [turn.think_s for turn in plan.turns] == [0.0, 2.0, 2.0]  # 3.0 and 40.0, capped
    plan = plan_session(t, 0, 4, Scale(tokens_per_block=4, think_scale=0.01, max_think=2.0))
    assert [turn.think_s for turn in plan.turns] == pytest.approx([0.0, 0.3, 2.0])
    assert plan.ended == "trace"


def test_a_request_that_does_not_extend_the_previous_one_ends_the_session():
    t = trace(request(range(1, 7)), request(range(1, 9)), request([1, 2, 3, 4, 50, 51]))
    plan = plan_session(t, 0, 4, Scale())
    assert len(plan.turns) == 2 and plan.ended == "diverges"
    # The last block changing (a partial block completed) is still the same conversation.
    t = trace(request(range(1, 7)), request([1, 2, 3, 4, 5, 60, 61]))
    plan = plan_session(t, 0, 4, Scale())
    assert plan.ended == "trace" and plan.turns[1].blocks == 2


def test_sessions_end_before_they_could_pass_the_context():
    growing = [request(range(1, 8 + 40 * i)) for i in range(10)]
    t = trace(*growing)
    scale = Scale(tokens_per_block=8, max_output=16, context=1200)
    plan = plan_session(t, 0, 4, scale)
    assert plan.ended == "context" and 1 <= len(plan.turns) < 10
    assert all(turn.estimated_tokens + scale.max_output <= scale.context for turn in plan.turns)
    # The estimate is an upper bound of what is sent: every text plus answers at 3 tokens
    # per generated token (a byte that is not UTF-8 comes back as U+FFFD, 3 bytes).
    system = traces.system_text(4, 8)
    users = [turn.user for turn in plan.turns]
    answers = ["\ufffd" * scale.max_output] * (len(users) - 1)
    sent = len(system) + len(traces.BILLING_EXAMPLE) + sum(map(len, users)) + \
        sum(len(a.encode()) for a in answers)
    assert sent <= plan.turns[-1].estimated_tokens
    # A larger context keeps more turns; a tiny one keeps none.
    assert len(plan_session(t, 0, 4, Scale(tokens_per_block=8, context=100_000)).turns) == 10
    assert plan_session(t, 0, 4, Scale(tokens_per_block=8, context=64)).turns == []
    assert len(plan_session(t, 0, 4, Scale(max_turns=3)).turns) == 3


def test_conversation_so_far_holds_every_earlier_turn_and_answer():
    messages = openai_messages("SYS", [("u1", "a1"), ("u2", "a2")], "u3")
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "SYS"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"),
        ("assistant", "a2"), ("user", "u3")]
    body = anthropic_body("m", "SYS", [("u1", "a1")], "u2", "BILL", 16)
    assert body["system"][0] == {"type": "text", "text": "BILL"}
    assert body["system"][1]["text"] == "SYS"
    assert body["system"][1]["cache_control"] == {"type": "ephemeral"}
    assert [(m["role"], m["content"][0]["text"]) for m in body["messages"]] == [
        ("user", "u1"), ("assistant", "a1"), ("user", "u2")]
    assert body["stream"] is True and body["max_tokens"] == 16


def test_billing_block_rotates_on_every_request():
    rng = traces.random.Random(0)
    blocks = [traces.billing_block(rng) for _ in range(20)]
    pattern = re.compile(r"x-anthropic-billing-header: cc_version=2\.1\.37\.[0-9a-f]{3}; "
                         r"cc_entrypoint=cli; cch=[0-9a-f]{5};")
    assert all(pattern.fullmatch(b) for b in blocks)
    assert len(set(blocks)) == 20


def test_the_runner_threads_the_servers_own_answers_into_the_next_turn(monkeypatch):
    seen: list[tuple[int, list[tuple[str, str]], str]] = []

    def fake_send(arm, system, history, user, rng, max_tokens):
        seen.append((len(history), list(history), user))
        if user == "boom":
            raise RuntimeError("server said no")
        return {"ttft": 0.01, "total_s": 0.02, "text": f"answer to {user}",
                "prompt_tokens": 10, "cached_tokens": 5 if history else 0, "tokens": 3,
                "finish_reason": "length"}

    monkeypatch.setattr(traces, "send", fake_send)
    turns = [traces.Turn(i, f"u{i}", 1, "text", 0.0, 10) for i in range(3)]
    plans = [traces.SessionPlan(0, "t1", turns, 3, "trace"),
             traces.SessionPlan(1, "t2", [traces.Turn(0, "boom", 1, "text", 0.0, 10),
                                          *turns[1:]], 3, "trace")]
    run = run_arm(Arm("ours", "openai", "http://x", "m"), "SYS", plans, 8)
    third = next(h for n, h, u in seen if u == "u2" and n == 2)
    assert third == [("u0", "answer to u0"), ("u1", "answer to u1")]
    assert [r["request"] for r in run.records] == ["s0t1", "s0t2", "s0t3", "s1t1"]
    summary = traces.summarize(run, planned=6)
    assert summary["errors"] == 1 and summary["not_sent"] == 2
    assert summary["cached_fraction"] == pytest.approx(10 / 30)
    assert traces.goals_met({"ttft_p50": 0.1, "ttft_p99": 0.5}, 1) == {
        "ttft_p50": True, "ttft_p99": False, "zero_errors": False}


def test_percentiles():
    assert traces.percentile([], 50) is None
    assert traces.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert traces.percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert traces.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def synthetic_result() -> dict:
    def server(p50: float, p99: float, errors: int = 0) -> dict:
        return {"requests_ok": 10 - errors, "requests_sent": 10, "errors": errors,
                "ttft_p50_s": p50, "ttft_p90_s": p99 * 0.8, "ttft_p99_s": p99,
                "wall_s": 30.0, "cached_fraction": 0.9}
    rows = [{"request": f"s0t{i}", "start_s": float(i), "ttft": 0.1 * i, "error": None}
            for i in range(1, 6)]
    servers = {"mlx_lm_server": server(1.0, 4.0), "ours": server(0.1, 1.0),
               "ours_anthropic": server(0.5, 2.0, errors=1)}
    return {"model": "tiny-hybrid", "settings": {"sessions": 8, "tokens_per_block": 4},
            "servers": servers,
            "ratios_vs_mlx_lm_server": {"ours": {"ttft_p50": 0.1, "ttft_p99": 0.25},
                                        "ours_anthropic": {"ttft_p50": 0.5,
                                                           "ttft_p99": 0.5}},
            "errors": 1,
            "requests": {"mlx_lm_server": rows, "ours": rows,
                         "ours_anthropic": [*rows, {"request": "s1t1", "start_s": 2.0,
                                                    "error": "boom"}]}}


def test_report_judges_the_trace_replay_and_plots_it(tmp_path):
    (tmp_path / "traces-tiny-hybrid.json").write_text(json.dumps(synthetic_result()))
    text = report.write_report(tmp_path).read_text()
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]):
            [c.strip() for c in line.strip("|").split("|")[3:]]
            for line in text.split("## Summary", 1)[1].split("\n## ", 1)[0].splitlines()
            if line.startswith("| traces")}
    assert rows[("traces", "tiny-hybrid", "trace replay TTFT p50, ours (OpenAI chat)")][-1] \
        == "met"
    assert rows[("traces", "tiny-hybrid", "trace replay TTFT p99, ours (OpenAI chat)")][-1] \
        == "met"
    anthropic = "ours (Anthropic Messages, billing block)"
    assert rows[("traces", "tiny-hybrid", f"trace replay TTFT p50, {anthropic}")][-1] \
        == "**missed**"
    errors = rows[("traces", "tiny-hybrid", "requests without error, every server")]
    assert errors[0] == "29/30" and errors[-1] == "**missed**"
    assert "## Trace replay" in text and "| ours | 10 | 0 | 0.100 s |" in text
    assert "![Trace replay TTFT (tiny-hybrid)](traces-ttft-tiny-hybrid.png)" in text
    assert (tmp_path / "traces-ttft-tiny-hybrid.png").read_bytes().startswith(PNG_MAGIC)
