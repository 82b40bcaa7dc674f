"""The bench runner (``python -m bench``): its plan and flags, a failing bench run as a
process and recorded, ``--report-only`` on a results directory, and a real model's
interleaved rows through the report (the report's own tests: tests/unit/test_bench_report.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.__main__ import main as bench_main
from bench.__main__ import merge_flags, parse_args, plan, quick_flags, run_bench, variant_flags
from tests.support.bench_results import multiturn, table, write


def test_runner_plans_quick_flags_and_records_a_failing_bench(tmp_path):
    args = parse_args(["--only", "agents,serving", "--serving-models", "tiny-hybrid,tiny-dense",
                       "--out", str(tmp_path)])
    assert plan(args) == [("agents", "tiny-hybrid", ""), ("agents", "tiny-hybrid-bf16", ""),
                          ("serving", "tiny-hybrid", ""), ("serving", "tiny-dense", "")]
    assert quick_flags("serving", "  --tokens TOKENS\n  --quick  smaller") == ["--quick"]
    assert quick_flags("restart", "[--turns TURNS] [--long-turns N]") == [
        "--turns", "3", "--long-turns", "0"]
    # multiturn's 1K-token-turn replay runs after the plain ones, on the first model
    args = parse_args(["--only", "multiturn", "--out", str(tmp_path)])
    assert plan(args) == [("multiturn", "tiny-hybrid", ""), ("multiturn", "tiny-hybrid-bf16", ""),
                          ("multiturn", "tiny-hybrid", "1k-turns")]
    help_text = "[--turns TURNS] [--system-tokens N] [--user-tokens N] [--gen GEN] [--goal G]"
    assert variant_flags("multiturn", "1k-turns", help_text, quick=False) == [
        "--turns", "6", "--system-tokens", "4600", "--user-tokens", "1000", "--goal", "0.95"]
    quick = merge_flags(quick_flags("multiturn", help_text),
                        variant_flags("multiturn", "1k-turns", help_text, quick=True))
    assert quick == ["--turns", "3", "--system-tokens", "1200", "--user-tokens", "250",
                     "--gen", "8", "--goal", "0.95"]  # the variant's values win

    record = run_bench("no_such_bench", "tiny-hybrid", tmp_path, [], timeout=120)
    assert record["status"] == "failed" and record["returncode"] != 0
    assert "no_such_bench" in record["log_tail"]
    assert record["log"] == "logs/no_such_bench-tiny-hybrid.log"
    record = run_bench("no_such_bench", "tiny-hybrid", tmp_path, [], timeout=120,
                       variant="1k-turns")
    assert record["model"] == "tiny-hybrid-1k-turns" and record["variant"] == "1k-turns"
    assert record["out"] == "no_such_bench-tiny-hybrid-1k-turns.json"


def test_report_only_renders_an_existing_directory(tmp_path):
    write(tmp_path, "multiturn-tiny-hybrid.json", multiturn())
    assert bench_main(["--report-only", "--out", str(tmp_path)]) == 0
    machine = json.loads((tmp_path / "machine.json").read_text())
    assert machine["cores"] and machine["python"] and "git_commit" in machine
    assert "ttft-per-turn-tiny-hybrid.png" in (tmp_path / "REPORT.md").read_text()


def real_records() -> list[dict]:
    """bench/serving_real.py's per-request records for two rounds: ours slightly slower on
    the 1-token request, as fast on answers, every forced call JSON; mlx_lm.server none."""
    out = []
    for rnd in range(2):
        for arm, wall, tps in (("ours", 1.05, 9.5), ("mlx_lm_server", 1.0, 10.0)):
            for i in (2 * rnd, 2 * rnd + 1):
                out.append({"row": "nonstreamed", "i": i, "round": rnd, "arm": arm,
                            "total_s": wall + i / 100, "text": "Hello", "tokens": 1,
                            "prompt_tokens": 49, "cached_tokens": 24, "finish_reason": "length"})
            out.append({"row": "answers", "i": rnd, "round": rnd, "arm": arm, "total_s": 7.5,
                        "text": "Once upon a time", "tokens": 64, "prompt_tokens": 42,
                        "cached_tokens": 29, "finish_reason": "length", "ttft": 1.0,
                        "decode_s": 63 / tps, "decode_tps": tps, "e2e_tps": 64 / 7.5})
        for arm in ("ours", "mlx_lm_server", "mlx_lm_server_tools_template"):
            made = arm == "ours"
            out.append({"row": "tool_call", "i": rnd, "round": rnd, "arm": arm, "total_s": 4.0,
                        "status": 200, "error": None,
                        "finish_reason": "tool_calls" if made else "stop",
                        "tool_calls": int(made), "name": "get_weather" if made else None,
                        "arguments": '{"city": "Paris"}' if made else None,
                        "json_arguments": made, "arguments_object": made,
                        "content": "" if made else "The weather in | Paris\nis sunny",
                        "tokens": 31, "prompt_tokens": 231, "cached_tokens": 222})
    return out


def test_a_real_models_interleaved_rows(tmp_path):
    """Issue 28: bench/serving_real.py's result, judged by the short-request goals, with the
    forced tool call a count (every request) and no point on the throughput plot."""
    from bench import serving_real

    plan = serving_real.RealPlan(rounds=2, nonstreamed=2, answers=1, tool_calls=1)
    arms = ["ours", "mlx_lm_server", "mlx_lm_server_tools_template"]
    result = serving_real.build_result("smollm2-135m", Path("/m"), {}, plan, real_records(),
                                       arms)
    assert result["short_requests"]["nonstreamed"]["ratio_per_round"] == pytest.approx(
        [1.055 / 1.005, 1.075 / 1.025])  # each round's medians
    assert result["tool_call"]["ours"]["fraction"] == 1.0 and result["tool_call"]["met"]
    assert result["tool_call"]["mlx_lm_server"]["finish_reasons"] == {"stop": 2}
    write(tmp_path, "serving-smollm2-135m.json", result)
    text = report.write_report(tmp_path).read_text()
    rows = {metric: cells for (bench, model, metric), cells in table(text).items()
            if (bench, model) == ("serving", "smollm2-135m")}
    plain = rows["non-streamed, max_tokens 1 (49-token prompts), median"]
    assert plain[:2] == ["1.065 s", "1.015 s"] and plain[-2:] == ["≤ 1.1×", "met"]
    assert rows["64-token answers, decode tok/s (usage's completion tokens)"] == [
        "9.50 tok/s", "10.00 tok/s", "0.950×", "≥ 0.95×", "met"]
    assert rows["64-token answers, tok/s over the whole request"][-1] == "info"
    assert rows["forced tool call, arguments parse as JSON"] == [
        "2/2", "mlx_lm.server 0/2; mlx_lm.server with our template 0/2", "", "all", "met"]
    assert rows["identical outputs"][0] == "6/6"
    assert not any(m.startswith(("single-stream", "8 streams", "cold")) for m in rows)
    section = text.split("## Serving, real model", 1)[1].split("\n## ", 1)[0]
    assert "by round: 1.050×, 1.049×" in section
    assert '| ours | 2 | 2 | 2 | {\'tool_calls\': 2} | 4.000 s | `{"city": "Paris"}` |' in section
    assert "The weather in \\| Paris is sunny" in section  # a table cell stays one cell
    assert "throughput-vs-concurrency.png" not in text


def test_the_runner_takes_the_trace_replays_model():
    args = parse_args(["--only", "serving,traces", "--serving-models", "smollm2-135m",
                       "--traces-models", "smollm2-135m"])
    assert plan(args) == [("serving", "smollm2-135m", ""), ("traces", "smollm2-135m", "")]
    assert plan(parse_args(["--only", "traces"])) == [("traces", "tiny-hybrid", "")]
