"""bench.thinking's summary from synthetic turns: no server is run."""

from __future__ import annotations

import pytest

from bench import report
from bench.thinking import TurnResult, metric_values, summarize


def turn(n: int, ttft: float, prompt: int, cached: int, content: str = "a",
         reasoning: str = "t", busy: int | None = 0) -> TurnResult:
    return TurnResult(session=0, turn=n, ttft=ttft, total_s=1.0, prompt_tokens=prompt,
                      cached_tokens=cached, completion_tokens=10, reasoning_tokens=5,
                      content=content, reasoning=reasoning, finish_reason="length",
                      in_flight_at_send=busy)


def arms(on_cached: int = 95, off_reasoning: str = "t") -> dict[str, list[TurnResult]]:
    return {
        # turn 1 is cold in every arm and left out of every figure
        "on": [turn(1, 9.0, 80, 0), turn(2, 0.1, 100, on_cached),
               turn(3, 0.3, 200, 190, busy=1)],
        "off": [turn(1, 9.0, 80, 0), turn(2, 0.4, 100, 60),
                turn(3, 0.4, 200, 120, reasoning=off_reasoning)],
        "mlx_lm_server": [turn(1, 9.0, 80, 0), turn(2, 0.2, 100, 60, busy=None),
                          turn(3, 0.2, 200, 120, busy=None)],
    }


def test_the_summary_reads_turns_two_on_and_judges_the_goals():
    s = summarize(arms())
    on = s["arms"]["on"]
    assert on["turns"] == 2
    assert on["cached_fraction_mean"] == pytest.approx((0.95 + 0.95) / 2)
    assert on["cached_fraction_min"] == pytest.approx(0.95)
    assert on["uncached_tokens_mean"] == pytest.approx(7.5)
    assert on["ttft_mean_s"] == pytest.approx(0.2)
    assert on["turns_sent_while_busy"] == 1
    assert s["ratios"]["on_vs_off"]["ttft_mean_s"] == pytest.approx(0.5)
    assert s["ratios"]["on_vs_mlx_lm_server"]["ttft_p50_s"] == pytest.approx(1.0)
    assert all(g["met"] for g in s["goals"].values()), s["goals"]
    assert s["on_vs_off_outputs"]["identical"] == 3 == s["on_vs_off_outputs"]["requests"]


def test_one_short_prompt_or_one_different_thought_misses_its_goal():
    s = summarize(arms(on_cached=85, off_reasoning="other"))
    goals = s["goals"]
    assert goals["cached_fraction_each_prompt"]["value"] == pytest.approx(0.85)
    assert not goals["cached_fraction_each_prompt"]["met"]
    assert goals["ttft_mean_on_vs_off"]["met"]
    assert not goals["outputs_identical_on_off"]["met"]
    assert s["on_vs_off_outputs"]["mismatches"] == [
        {"session": 0, "turn": 3, "content_equal": True, "reasoning_equal": False}]


def test_metric_values_sum_ray_prefixed_counters_by_label():
    text = "\n".join([
        "# TYPE ray_serve_app_history_ahead_requests_total counter",
        'ray_serve_app_history_ahead_requests_total{model="m",outcome="done",replica="a"} 3.0',
        'ray_serve_app_history_ahead_requests_total{model="m",outcome="done",replica="b"} 2.0',
        'ray_serve_app_history_ahead_requests_total{model="m",outcome="busy",replica="a"} 1.0',
        'ray_serve_app_history_ahead_prefilled_tokens_total{model="m"} 353.0',
    ])
    assert metric_values(text, "serve_app_history_ahead_requests", by="outcome") == {
        "done": 5.0, "busy": 1.0}
    assert metric_values(text, "serve_app_history_ahead_prefilled_tokens") == {"": 353.0}
    assert metric_values(text, "serve_app_reasoning_tokens") == {}


def test_the_report_judges_the_thinking_rows():
    rows = report.thinking_rows("tiny-hybrid-mtp", {"summary": summarize(arms(on_cached=85))})
    by_metric = {r.metric: r for r in rows}
    assert by_metric["least cached fraction of a prompt, turns 2+"].status == "**missed**"
    ttft = by_metric["mean TTFT turns 2+, vs the prefill ahead off"]
    assert ttft.ratio == pytest.approx(0.5) and ttft.status == "met"
    assert by_metric["identical outputs, prefill ahead on vs off"].status == "met"
    assert "thinking" in report.BENCHES
