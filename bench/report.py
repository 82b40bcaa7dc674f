"""The Markdown report of one benchmark run: every goal met or missed, with plots.

Reads a results directory as ``python -m bench`` leaves it: the benches' JSON
(``<bench>-<model>.json``), ``runs.json`` (each bench's exit status and log tail)
and ``machine.json``; writes ``REPORT.md`` and its PNG plots beside it, linked
relatively so that any Markdown viewer shows the report with its plots.
Missing keys and missing files leave a cell ``n/a`` or a plot out: a bench
that failed, or an older JSON schema, must not stop the report.

    python -m bench.report DIR
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

BENCHES = ("multiturn", "agents", "restart", "checkpoints", "serving", "cluster", "structured",
           "traces", "lookup", "speculative", "thinking", "vision")
REPORT = "REPORT.md"
RUNS = "runs.json"
MACHINE = "machine.json"
MIB = 1 << 20

# Issue 11's goals. They are the report's, not the JSON's: a bench may still record an
# older goal of its own, and the report must judge every run by the same bar.
GOALS = {
    "multiturn_ttft": ("<=", 0.8),
    "agents_ttft": ("<=", 0.6),
    "restart_vs_cold": ("<=", 0.1),
    "restart_vs_mlx_lm_server": ("<=", 0.2),
    "serving_single": (">=", 0.95),
    "serving_streams": (">=", 1.2),  # issue 21 raised it from 1.1
    "serving_cold_ttft": ("<=", 1.05),
    # issue 21: what every request costs where no cache helps (short prompts), and a replay
    # whose ~1K-token turns (after a ~4.6K-token system prompt) leave little for the cache
    "serving_short_request": ("<=", 1.1),  # non-streamed, max_tokens 1, median wall time
    "serving_short_ttft": ("<=", 1.0),  # streamed, first content chunk, median
    "serving_short_single": (">=", 0.95),  # 64-token answers, tok/s over the whole request
    # idle RSS of the lean one-machine start against the 2,480 MiB `serve run` held before
    "serving_idle_memory": ("<=", 0.7),
    "multiturn_1k_turns_ttft": ("<=", 0.95),
    "cluster_ttft": ("<=", 0.6),  # issue 12: prefix routing against Ray's default router
    "traces_ttft_p50": ("<=", 0.2),  # issue 18: trace replay, 8 concurrent sessions
    "traces_ttft_p99": ("<=", 0.4),
    # issue 20: a store lookup's cost flat in block size and in tails under one parent
    # (the slowest setting against the smallest; 2x leaves room for a noisy CPU)
    "lookup_flat": ("<=", 2.0),
    # issue 41: a thinking model's session, the next turn's prefix prefilled ahead against
    # the same session without it (bench.thinking)
    "thinking_ttft_vs_off": ("<=", 0.5),
    # issue 42: a 6-turn conversation about one image, 8 images at once, a restart
    # (bench.vision, against mlx_vlm.server on the same weights)
    "vision_ttft": ("<=", 0.2),
    "vision_throughput": (">=", 1.5),
    "vision_restart": ("<=", 0.1),
}
THINKING_CACHED_FRACTION = 0.9  # issue 41: every prompt of turns 2+
# The label suffix of multiturn's second configuration (``bench/__main__.py`` VARIANTS):
# multiturn-<model>-1k-turns.json, judged by its own goal.
MULTITURN_1K_TURNS = "1k-turns"
CLUSTER_CACHED_GAP = 0.02  # issue 12: cached fraction within this of one node
_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}
_SIGNS = {"<=": "≤", ">=": "≥"}

HOW_TO_READ = """\
Every ratio is **ours / baseline**, the baseline being mlx-lm (`mlx_lm.server`, or in-process
`stream_generate` where marked) or our own server with caching off (where marked), on the same
embedded model (same weights, tokenizer and chat template), measured side by side in one run
with each server alone on the machine.
For times (TTFT) lower is better, for throughput (tok/s) higher is better; the *goal*
column says which way each ratio must go, and *status* whether this run met it.
"Identical outputs" counts requests whose text (temperature 0) is the same on both servers:
a speedup only counts when it is the full count. Counts such as "recomputed ≤ new + one
block" are requests meeting the bound out of all requests. Numbers on a small shared CPU
vary by ±20% between runs, so judge a goal by repeated runs, not one. A bench that failed
shows as FAILED with the tail of its log below; `n/a` means the JSON lacked that number.
"""


@dataclass
class Row:
    """One line of the summary table."""

    bench: str
    model: str
    metric: str
    ours: str = ""
    baseline: str = ""
    ratio: float | None = None
    goal: str = ""
    status: str = "n/a"


# ---------------------------------------------------------------- reading the results


def load_results(directory: Path) -> dict[str, dict[str, dict]]:
    """``{bench: {label: data}}`` from ``<bench>-<label>.json``; an unreadable file maps
    to ``{"_error": why}`` so that the report shows it instead of crashing."""
    out: dict[str, dict[str, dict]] = {b: {} for b in BENCHES}
    for path in sorted(directory.glob("*.json"), key=lambda p: p.stem):
        bench, sep, label = path.stem.partition("-")
        if bench not in out or not sep:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            data = {"_error": f"unreadable JSON: {e}"}
        out[bench][label] = data if isinstance(data, dict) else {"_error": "not an object"}
    return out


def load_json(path: Path, default: dict) -> dict:
    """A side file (runs, machine) if present and readable, else ``default``."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def first(data: dict, *keys: str):
    """The value of the first of ``keys`` present in ``data`` (renamed fields)."""
    return next((data[k] for k in keys if isinstance(data, dict) and data.get(k) is not None),
                None)


# ---------------------------------------------------------------- summary rows


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "tok/s":  # a real model on a CPU decodes at ~10 tok/s: keep its decimals
        return f"{value:,.0f} tok/s" if value >= 100 else f"{value:.2f} tok/s"
    if unit == " MiB":
        return f"{value:,.0f} MiB"
    return f"{value:g}{unit}"


def ratio_row(bench: str, model: str, metric: str, ours: float | None, base: float | None,
              unit: str, goal: str, ratio: float | None = None, base_label: str = "") -> Row:
    """A speed ratio against its goal; the ratio is computed when the JSON lacks it."""
    op, bound = GOALS[goal]
    if ratio is None and ours is not None and base:
        ratio = ours / base
    status = "n/a" if ratio is None else ("met" if _OPS[op](ratio, bound) else "**missed**")
    baseline = fmt(base, unit) + (f" ({base_label})" if base_label and base is not None else "")
    return Row(bench, model, metric, fmt(ours, unit), baseline, ratio,
               f"{_SIGNS[op]} {bound}×", status)


def count_row(bench: str, model: str, metric: str, met: int | None, total: int | None,
              baseline: str = "") -> Row:
    """A count that must be the full count (identical outputs, requests within a bound)."""
    if met is None or not total:
        return Row(bench, model, metric, "n/a", baseline, goal="all")
    return Row(bench, model, metric, f"{met}/{total}", baseline, goal="all",
               status="met" if met == total else "**missed**")


def outputs_summary(data: dict) -> tuple[int | None, int | None]:
    """(identical, requests) over the output comparisons a bench recorded: benches name
    it ``vs_mlx_lm_server_outputs`` or ``outputs`` (one comparison, or several by name,
    of which those of ours against mlx_lm.server count when there are any)."""
    found = first(data, "vs_mlx_lm_server_outputs", "outputs")
    if not isinstance(found, dict):
        return None, None
    named = {k: v for k, v in found.items() if isinstance(v, dict) and "requests" in v}
    ours = [v for k, v in named.items() if k.endswith("vs_mlx_lm_server")
            and not k.startswith("mlx_lm")]  # not mlx-lm against itself
    parts = [found] if "requests" in found else ours or list(named.values())
    if not parts:
        return None, None
    return sum(p.get("identical", 0) for p in parts), sum(p["requests"] for p in parts)


def identical_row(bench: str, model: str, data: dict) -> Row:
    return count_row(bench, model, "identical outputs", *outputs_summary(data))


def multiturn_rows(model: str, d: dict) -> list[Row]:
    t = d.get("ttft_sum_turns_2_on") or {}
    turns = len(d.get("turns") or [])
    metric, goal = f"TTFT sum, turns 2–{turns or 6}", "multiturn_ttft"
    if model.endswith(f"-{MULTITURN_1K_TURNS}"):
        s = d.get("settings") or {}
        metric += (f", {s.get('user_tokens', '?')}-token turns after a "
                   f"{s.get('system_tokens', '?')}-token system prompt")
        goal = "multiturn_1k_turns_ttft"
    return [ratio_row("multiturn", model, metric, t.get("ours"), t.get("mlx_lm_server"), "s",
                      goal, d.get("ratio_vs_mlx_lm_server")),
            identical_row("multiturn", model, d)]


def agents_rows(model: str, d: dict) -> list[Row]:
    t = d.get("ttft_total") or {}
    bound = d.get("recomputed_within_new_plus_one_block") or {}
    theirs = bound.get("mlx_lm_server")
    return [ratio_row("agents", model, "total TTFT", t.get("ours"), t.get("mlx_lm_server"),
                      "s", "agents_ttft", d.get("ratio_vs_mlx_lm_server")),
            count_row("agents", model, "requests with recomputed ≤ new + one block",
                      bound.get("ours"), bound.get("requests"),
                      f"{theirs}/{bound.get('requests')}" if theirs is not None else ""),
            identical_row("agents", model, d)]


def restart_rows(model: str, d: dict) -> list[Row]:
    t = d.get("last_turn_ttft") or {}
    ours = t.get("ours_after_restart")
    return [ratio_row("restart", model, "last-turn TTFT after restart vs our cold", ours,
                      t.get("ours_cold"), "s", "restart_vs_cold", d.get("ratio_vs_cold"),
                      "ours, cache off"),
            ratio_row("restart", model, "last-turn TTFT after restart", ours,
                      t.get("mlx_lm_server_after_restart"), "s", "restart_vs_mlx_lm_server",
                      d.get("ratio_vs_mlx_lm_server")),
            identical_row("restart", model, d)]


def streams_entry(d: dict, streams: int = 8) -> tuple[int | None, dict]:
    """The ``streams``-stream throughput: from ``concurrency`` when the bench swept it,
    else ``aggregate`` (then at however many streams it ran)."""
    for entry in d.get("concurrency") or []:
        if entry.get("streams") == streams:
            return streams, entry
    agg = d.get("aggregate") or {}
    return first(agg, "streams") or d.get("streams"), agg


def serving_rows(model: str, d: dict) -> list[Row]:
    if d.get("mode") == "interleaved":
        return real_serving_rows(model, d)
    single = d.get("single_stream") or {}
    server = first(single, "mlx_lm_server_tps", "mlx_lm_server_http_tps")
    in_process = server is None and single.get("mlx_lm_generate_tps") is not None
    n, agg = streams_entry(d)
    cold = d.get("cold_ttft") or {}
    tokens = first(cold, "prompt_tokens", "tokens")
    return [ratio_row("serving", model, "single-stream decode",
                      first(single, "ours_tps", "ours_http_tps"),
                      single.get("mlx_lm_generate_tps") if in_process else server, "tok/s",
                      "serving_single", single.get("ratio"),
                      "in-process stream_generate" if in_process else ""),
            ratio_row("serving", model, f"{n or '?'} streams, aggregate",
                      agg.get("ours_tps"), agg.get("mlx_lm_server_tps"), "tok/s",
                      "serving_streams", agg.get("ratio")),
            ratio_row("serving", model, f"cold {tokens or '4K'}-token prompt TTFT",
                      first(cold, "ours", "ours_s", "ttft_ours"),
                      first(cold, "mlx_lm_server", "mlx_lm_server_s", "ttft_mlx_lm_server"),
                      "s", "serving_cold_ttft", cold.get("ratio")),
            *short_rows(model, d),
            *memory_goal_rows(model, d),
            *control_rows(model, d),
            identical_row("serving", model, d)]


TOOL_ARMS = {"mlx_lm_server": "mlx_lm.server",
             "mlx_lm_server_tools_template": "mlx_lm.server with our template"}


def real_serving_rows(model: str, d: dict) -> list[Row]:
    """Issue 28: a real model's interleaved rows (bench/serving_real.py): a non-streamed
    1-token request, 64-token answers' decode rate, a forced tool call's JSON arguments."""
    short = d.get("short_requests") or {}
    plain = short.get("nonstreamed") or {}
    answers = short.get("single_stream") or {}
    tokens = (short.get("prompt_tokens") or {}).get("ours")
    prompt = f"{tokens}-token prompts" if tokens else "short prompts"
    p90 = [plain.get("ours_p90_s"), plain.get("mlx_lm_server_p90_s")]
    e2e = [answers.get("ours_e2e_tps"), answers.get("mlx_lm_server_e2e_tps")]
    tool = d.get("tool_call") or {}
    ours = tool.get("ours") or {}
    theirs = "; ".join(f"{label} {(tool.get(arm) or {}).get('json_arguments')}/"
                       f"{(tool.get(arm) or {}).get('requests')}"
                       for arm, label in TOOL_ARMS.items() if tool.get(arm))
    return [ratio_row("serving", model, f"non-streamed, max_tokens 1 ({prompt}), median",
                      plain.get("ours_median_s"), plain.get("mlx_lm_server_median_s"), "s",
                      "serving_short_request", plain.get("ratio")),
            Row("serving", model, "non-streamed, max_tokens 1, p90", fmt(p90[0], "s"),
                fmt(p90[1], "s"), plain.get("p90_ratio"), status="info"),
            ratio_row("serving", model, f"{answers.get('max_tokens', 64)}-token answers, "
                      "decode tok/s (usage's completion tokens)", answers.get("ours_tps"),
                      answers.get("mlx_lm_server_tps"), "tok/s", "serving_short_single",
                      answers.get("ratio")),
            Row("serving", model, f"{answers.get('max_tokens', 64)}-token answers, tok/s over "
                "the whole request", fmt(e2e[0], "tok/s"), fmt(e2e[1], "tok/s"),
                answers.get("e2e_ratio"), status="info"),
            count_row("serving", model, "forced tool call, arguments parse as JSON",
                      ours.get("json_arguments"), ours.get("requests"), theirs),
            identical_row("serving", model, d)]


def real_serving_lines(results: dict[str, dict[str, dict]]) -> list[str]:
    """A real model's rounds: each round's ratio (how much it moves), and what each server
    answered to the forced tool call."""
    lines = []
    for label, d in valid(results["serving"]).items():
        if d.get("mode") != "interleaved":
            continue
        s = d.get("settings") or {}
        short = d.get("short_requests") or {}
        lines += [f"**{label}**: {s.get('rounds')} rounds ({s.get('order', 'interleaved')}); "
                  f"per server and round {s.get('nonstreamed')} non-streamed requests, "
                  f"{s.get('answers')} answers of {s.get('answer_tokens')} tokens, "
                  f"{s.get('tool_calls')} forced tool calls.", ""]
        for key, name in (("nonstreamed", "non-streamed, max_tokens 1"),
                          ("single_stream", "answers, decode tok/s")):
            per = (short.get(key) or {}).get("ratio_per_round") or []
            lines.append(f"- {name}, ours / mlx_lm.server by round: "
                         + (", ".join(times(r) or "n/a" for r in per) or "n/a"))
        tool = d.get("tool_call") or {}
        lines += ["", "| server | requests | JSON arguments | with tool_calls | finish reasons "
                  "| median wall | first answer |", "|---|---|---|---|---|---|---|"]
        for arm in s.get("arms") or []:
            t = tool.get(arm) or {}
            sample = (t.get("samples") or [{}])[0]
            shown = sample.get("arguments") or sample.get("content") or ""
            shown = shown.replace("|", "\\|").replace("\n", " ")[:80]
            lines.append(f"| {arm} | {t.get('requests')} | {t.get('json_arguments')} | "
                         f"{t.get('with_tool_calls')} | {t.get('finish_reasons')} | "
                         f"{fmt(t.get('median_s'), 's')} | `{shown}` |")
        lines.append("")
    return lines


# What an idle `serve run configs/qwen.yaml` held when issue 21 was filed (every process).
IDLE_RSS_BEFORE_ISSUE_21_MIB = 2480.0


def memory_goal_rows(model: str, d: dict) -> list[Row]:
    """Issue 21: the lean start's idle RSS against what ``serve run`` held before (and
    today's ``serve run`` beside it, for information)."""
    rss = d.get("rss") or {}
    lean, ours = rss.get("lean") or {}, rss.get("ours") or {}
    if lean.get("idle_mib") is None:
        return []
    return [ratio_row("serving", model, "idle RSS, lean start (`python -m serve_app serve`), "
                      "all processes", lean["idle_mib"], IDLE_RSS_BEFORE_ISSUE_21_MIB, " MiB",
                      "serving_idle_memory", base_label="serve run, before issue 21"),
            Row("serving", model, "idle RSS, `serve run` (Ray with its dashboard) / "
                "mlx_lm.server", fmt(ours.get("idle_mib"), " MiB"),
                fmt((rss.get("mlx_lm_server") or {}).get("idle_mib"), " MiB"), status="info")]


def short_rows(model: str, d: dict) -> list[Row]:
    """Issue 21's short requests (short prompts, nothing cached): a request's fixed cost."""
    short = d.get("short_requests")
    if not isinstance(short, dict):
        return []  # a serving JSON from before issue 21
    plain = short.get("nonstreamed") or {}
    stream = short.get("streamed_ttft") or {}
    answers = short.get("single_stream") or {}
    tokens = (short.get("prompt_tokens") or {}).get("ours")
    prompt = f"{tokens}-token prompts" if tokens else "short prompts"
    p90 = [plain.get("ours_p90_s"), plain.get("mlx_lm_server_p90_s")]
    return [ratio_row("serving", model, f"short request, non-streamed, max_tokens 1 ({prompt}),"
                      " median", plain.get("ours_median_s"),
                      plain.get("mlx_lm_server_median_s"), "s", "serving_short_request",
                      plain.get("ratio")),
            Row("serving", model, "short request, non-streamed, max_tokens 1, p90",
                fmt(p90[0], "s"), fmt(p90[1], "s"),
                plain.get("p90_ratio") or (p90[0] / p90[1] if all(p90) else None),
                status="info"),
            ratio_row("serving", model, f"short request, streamed, first content chunk "
                      f"({prompt}), median", stream.get("ours_median_s"),
                      stream.get("mlx_lm_server_median_s"), "s", "serving_short_ttft",
                      stream.get("ratio")),
            ratio_row("serving", model, f"single stream, {answers.get('max_tokens', 64)}-token "
                      "answers, tok/s over the whole request", answers.get("ours_tps"),
                      answers.get("mlx_lm_server_tps"), "tok/s", "serving_short_single",
                      answers.get("ratio"))]


def control_rows(model: str, d: dict) -> list[Row]:
    """The single stream's controls: where the gap to mlx_lm.server comes from."""
    single = d.get("single_stream") or {}
    lean = (d.get("rss") or {}).get("lean") or {}
    values = [single.get("ours_in_process_engine_tps"),
              single.get("ours_in_process_engine_beside_idle_server_tps"),
              lean.get("single_stream_tps")]
    if all(v is None for v in values):
        return []
    text = " / ".join("n/a" if v is None else f"{v:.0f}" for v in values)
    return [Row("serving", model, "single stream controls (tok/s): in-process engine alone / "
                "beside our idle server / lean server over HTTP", ours=text, status="info")]


def cluster_rows(model: str, d: dict) -> list[Row]:
    arms = d.get("arms") or {}
    ttft = {name: (arms.get(name) or {}).get("ttft_total_s") for name in arms}
    cached = {name: (arms.get(name) or {}).get("cached_fraction") for name in arms}
    rows = [ratio_row("cluster", model, "total TTFT, prefix routing vs Ray's default router "
                      "(2 nodes)", ttft.get("prefix"), ttft.get("default"), "s",
                      "cluster_ttft", d.get("ttft_ratio_prefix_vs_default"))]
    gap = d.get("cached_fraction_gap_vs_one_node")
    if gap is None:
        rows.append(Row("cluster", model, "cached fraction vs one node", "n/a", goal="≤ 0.02"))
    else:
        rows.append(Row("cluster", model, "cached fraction, prefix routing vs one node",
                        f"{cached.get('prefix'):.3f}", f"{cached.get('one_node'):.3f}",
                        goal=f"gap ≤ {CLUSTER_CACHED_GAP}",
                        status="met" if gap <= CLUSTER_CACHED_GAP else "**missed**"))
    fetch = d.get("cross_node_fetch") or {}
    if "seconds" in fetch:
        rows.append(Row("cluster", model, f"{fetch.get('fetched_tokens')}-token prefix fetched "
                        "from another node vs prefilled cold", fmt(fetch["seconds"], "s"),
                        fmt(fetch.get("cold_ttft_s"), "s"), fetch.get("fetch_over_cold_ttft"),
                        status="info"))
    same, total = d.get("identical_outputs") or {}, d.get("requests")
    rows.append(count_row("cluster", model, "identical outputs, every arm",
                          min(same.values()) if same else None, total))
    return rows


def structured_rows(model: str, d: dict) -> list[Row]:
    decode = d.get("decode") or {}
    return [Row("structured", model, "decode ms/token, json_schema constrained vs free",
                fmt(decode.get("constrained_ms_per_token"), "ms"),
                fmt(decode.get("free_ms_per_token"), "ms"), decode.get("ratio"),
                status="info")]


SPECULATIVE_WITHIN = 0.20  # issue 29: controlled draft within 20% of the expected speedup


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def speculative_rows(model: str, d: dict) -> list[Row]:
    """Issue 29's controlled draft: measured speedup at alpha 0.8 against the expected one
    (``bench.speculative``'s controlled part, on each tiny model and rollback)."""
    rows = []
    for part in d.get("controlled") or []:
        at = next((r for r in part.get("rows", []) if r.get("alpha") == 0.8), None)
        if at is None:
            continue
        off = at.get("off_expected")
        status = "n/a" if off is None else (
            "met" if abs(off) <= SPECULATIVE_WITHIN else "**missed**")
        rows.append(Row("speculative", part.get("model", model),
                        f"controlled draft alpha 0.8, k {part.get('k')}, rollback "
                        f"{part.get('rollback')}: speedup vs expected",
                        fmt(_round(at.get("speedup")), "×"),
                        fmt(_round(at.get("expected_speedup")), "×"),
                        (1 + off) if off is not None else None,
                        goal=f"within {SPECULATIVE_WITHIN:.0%}", status=status))
        rows.append(count_row("speculative", part.get("model", model),
                              f"identical to plain decoding (rollback {part.get('rollback')})",
                              int(bool(part.get("identical"))), 1))
    return rows


TRACE_SERVERS = {"ours": "ours (OpenAI chat)",
                 "ours_anthropic": "ours (Anthropic Messages, billing block)"}


def traces_rows(model: str, d: dict) -> list[Row]:
    """TTFT p50/p99 of each of our APIs against mlx_lm.server, and zero errors."""
    servers = d.get("servers") or {}
    base = servers.get("mlx_lm_server") or {}
    vs = d.get("ratios_vs_mlx_lm_server") or {}
    rows = []
    for name, label in TRACE_SERVERS.items():
        ours = servers.get(name)
        if not ours:
            continue
        r = vs.get(name) or {}
        for q in ("p50", "p99"):
            rows.append(ratio_row("traces", model, f"trace replay TTFT {q}, {label}",
                                  ours.get(f"ttft_{q}_s"), base.get(f"ttft_{q}_s"), "s",
                                  f"traces_ttft_{q}", r.get(f"ttft_{q}")))
        cached = ours.get("cached_fraction")
        theirs = base.get("cached_fraction")
        rows.append(Row("traces", model, f"cached fraction, {label}",
                        "n/a" if cached is None else f"{cached:.3f}",
                        "" if theirs is None else f"{theirs:.3f}", status="info"))
    sent = sum(s.get("requests_sent", 0) for s in servers.values())
    errors = d.get("errors")
    rows.append(count_row("traces", model, "requests without error, every server",
                          None if errors is None else sent - errors, sent))
    if d.get("vs_mlx_lm_server_outputs"):
        rows.append(identical_row("traces", model, d))
    return rows


def lookup_rows(model: str, d: dict) -> list[Row]:
    """The slowest store lookup against the smallest setting, and the old tail search."""
    rows = d.get("rows") or []
    if not rows:
        return []
    small = rows[0]
    largest = d.get("largest") or {}
    big = next((r for r in rows if r.get("block_size") == largest.get("block_size")
                and r.get("tails") == largest.get("tails")), rows[-1])
    setting = f"block size {big.get('block_size')}, {big.get('tails')} tails"
    out = [ratio_row("lookup", model, f"store match µs, {setting} vs block size "
                     f"{small.get('block_size')}, no tails", big.get("dense_match_us"),
                     small.get("dense_match_us"), " µs", "lookup_flat",
                     d.get("dense_match_us_max_over_min"))]
    top = max(rows, key=lambda r: (r.get("block_size", 0), r.get("tails", 0)))
    out.append(Row("lookup", model, f"tail search by per-length hashing (before), block size "
                   f"{top.get('block_size')}, {top.get('tails')} tails",
                   fmt(top.get("dense_match_us"), " µs"),
                   fmt(top.get("per_length_hashing_us"), " µs"), status="info"))
    return out


def thinking_rows(model: str, d: dict) -> list[Row]:
    """Issue 41: turns 2+ of a thinking model's session with the next turn's prefix
    prefilled ahead (``on``) against without (``off``): the least cached fraction of a
    prompt, mean TTFT, and identical outputs."""
    s = d.get("summary") or {}
    arms = s.get("arms") or {}
    on, off, mlx = (arms.get(k) or {} for k in ("on", "off", "mlx_lm_server"))
    least = on.get("cached_fraction_min")
    status = "n/a" if least is None else (
        "met" if least >= THINKING_CACHED_FRACTION else "**missed**")
    theirs = mlx.get("cached_fraction_min")
    outputs = s.get("on_vs_off_outputs") or {}
    return [Row("thinking", model, "least cached fraction of a prompt, turns 2+",
                fmt(_round(least), ""), "" if theirs is None else
                f"{theirs:.2f} (mlx_lm.server)", goal=f"≥ {THINKING_CACHED_FRACTION}",
                status=status),
            ratio_row("thinking", model, "mean TTFT turns 2+, vs the prefill ahead off",
                      on.get("ttft_mean_s"), off.get("ttft_mean_s"), "s",
                      "thinking_ttft_vs_off"),
            Row("thinking", model, "mean TTFT turns 2+, vs mlx_lm.server",
                fmt(on.get("ttft_mean_s"), "s"), fmt(mlx.get("ttft_mean_s"), "s"),
                (on["ttft_mean_s"] / mlx["ttft_mean_s"]) if on.get("ttft_mean_s")
                and mlx.get("ttft_mean_s") else None, status="info"),
            count_row("thinking", model, "identical outputs, prefill ahead on vs off",
                      outputs.get("identical"), outputs.get("requests"))]


def vision_rows(model: str, d: dict) -> list[Row]:
    """Issue 42: turns 2-6 of a conversation about one image against mlx_vlm.server, 8
    images at once, a restart from SSD against a cold start; our answers against
    mlx-vlm's own model and mlx_vlm.server's."""
    c, p, r = (d.get(k) or {} for k in ("conversation", "parallel", "restart"))
    ours, theirs = c.get("ours") or {}, c.get("mlx_vlm_server") or {}
    same = c.get("ours_equal_mlx_vlm_model") or []
    encoded = c.get("images_encoded")
    return [ratio_row("vision", model, "mean TTFT turns 2-6, vs mlx_vlm.server",
                      ours.get("ttft_mean_s"), theirs.get("ttft_mean_s"), "s", "vision_ttft"),
            Row("vision", model, "images encoded in the 6 turns",
                fmt(encoded, ""), goal="1", status="n/a" if encoded is None else
                ("met" if encoded == 1 else "**missed**")),
            count_row("vision", model, "answers equal to mlx-vlm's own model",
                      sum(same), len(same)),
            count_row("vision", model, "answers equal to mlx_vlm.server's",
                      c.get("identical_turns"), len(same)),
            ratio_row("vision", model, "aggregate tok/s, 8 requests with 8 images",
                      p.get("ours_tok_per_s"), p.get("mlx_vlm_server_tok_per_s"), " tok/s",
                      "vision_throughput"),
            ratio_row("vision", model, "TTFT after a restart (from SSD), vs cold",
                      r.get("ttft_restarted_s"), r.get("ttft_cold_s"), "s", "vision_restart",
                      base_label="cold")]


ROWS: dict[str, Callable[[str, dict], list[Row]]] = {
    "multiturn": multiturn_rows, "agents": agents_rows, "restart": restart_rows,
    "serving": serving_rows, "cluster": cluster_rows, "structured": structured_rows,
    "traces": traces_rows, "lookup": lookup_rows, "speculative": speculative_rows,
    "thinking": thinking_rows, "vision": vision_rows}


def summary_rows(results: dict[str, dict[str, dict]], runs: dict[str, dict]) -> list[Row]:
    """Every goal of every result, then a FAILED row for each run without a result."""
    rows: list[Row] = []
    for bench, by_label in results.items():
        for label, data in by_label.items():
            if "_error" in data:
                rows.append(Row(bench, label, data["_error"], status="**FAILED**"))
            elif bench in ROWS:
                rows += ROWS[bench](label, data)
    for run in runs.values():
        if run.get("status") != "ok":
            rows.append(Row(run["bench"], run["model"],
                            f"bench {run.get('status', 'failed')} "
                            f"(exit {run.get('returncode')}), see [failures](#failures)",
                            status="**FAILED**"))
    order = {b: i for i, b in enumerate(BENCHES)}
    return sorted(rows, key=lambda r: (order.get(r.bench, len(order)), r.model))


def summary_table(rows: list[Row]) -> list[str]:
    lines = ["| bench | model | metric | ours | baseline | ratio | goal | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.3f}×"
        lines.append(f"| {r.bench} | {r.model} | {r.metric} | {r.ours} | {r.baseline} | "
                     f"{ratio} | {r.goal} | {r.status} |")
    return lines


# ---------------------------------------------------------------- plots


def pyplot():
    """matplotlib on the Agg backend (no display), imported only when a plot is drawn:
    the benches themselves must run without the ``bench`` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def plot_ttft_per_turn(label: str, d: dict, directory: Path) -> Path | None:
    turns = d.get("turns") or []
    series = {"ours (cache)": "ttft_ours", "ours (cache off)": "ttft_ours_cold",
              "mlx_lm.server": "ttft_mlx_lm_server"}
    if not turns:
        return None
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for name, key in series.items():
        points = [(t.get("turn", i + 1), t[key]) for i, t in enumerate(turns)
                  if t.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.set(title=f"TTFT per turn: {label}", xlabel="turn", ylabel="TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    return save(fig, directory / f"ttft-per-turn-{label}.png")


def throughput_points(d: dict) -> dict[str, list[tuple[int, float]]]:
    """Tok/s by stream count for each server: the ``concurrency`` sweep, or the
    aggregate run (and our single stream) of an older serving JSON."""
    if d.get("mode") == "interleaved":  # a real model: one stream at a time, no sweep
        return {}
    sweep = d.get("concurrency") or []
    if not sweep:
        n, agg = streams_entry(d)
        sweep = [{"streams": n, **agg}] if n else []
        single = first(d.get("single_stream") or {}, "ours_tps", "ours_http_tps")
        if single is not None:
            sweep.insert(0, {"streams": 1, "ours_tps": single})
    out: dict[str, list[tuple[int, float]]] = {"ours": [], "mlx_lm.server": []}
    for e in sweep:
        for name, key in (("ours", "ours_tps"), ("mlx_lm.server", "mlx_lm_server_tps")):
            if e.get("streams") is not None and e.get(key) is not None:
                out[name].append((e["streams"], e[key]))
    return out


def plot_throughput(serving: dict[str, dict], directory: Path) -> Path | None:
    curves = {label: throughput_points(d) for label, d in serving.items() if "_error" not in d}
    if not any(p for c in curves.values() for p in c.values()):
        return None
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for i, (label, by_server) in enumerate(curves.items()):
        for server, points in by_server.items():
            if points:
                ax.plot(*zip(*sorted(points), strict=True), marker="o", color=f"C{i}",
                        linestyle="-" if server == "ours" else "--", label=f"{server}, {label}")
    streams = sorted({n for c in curves.values() for p in c.values() for n, _ in p})
    ax.set_xticks(streams)
    ax.set(title="Aggregate throughput against concurrency", xlabel="concurrent streams",
           ylabel="tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return save(fig, directory / "throughput-vs-concurrency.png")


def plot_restart(restart: dict[str, dict], directory: Path) -> Path | None:
    bars = {"ours, restored from SSD": "ours_after_restart", "ours, cache off": "ours_cold",
            "mlx_lm.server after restart": "mlx_lm_server_after_restart"}
    labels = [lb for lb, d in restart.items() if d.get("last_turn_ttft")]
    if not labels:
        return None
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    width = 0.8 / len(bars)
    for i, (name, key) in enumerate(bars.items()):
        values = [restart[lb]["last_turn_ttft"].get(key) or 0 for lb in labels]
        bars_drawn = ax.bar([x + i * width for x in range(len(labels))], values, width,
                            label=name)
        ax.bar_label(bars_drawn, fmt="%.2f", fontsize="small")
    ax.set_xticks([x + width * (len(bars) - 1) / 2 for x in range(len(labels))], labels)
    ax.set(title="Last-turn TTFT after a restart", ylabel="TTFT (s)")
    ax.margins(y=0.4)  # headroom for the legend above the bars
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", loc="upper left")
    return save(fig, directory / "restart-ttft.png")


def plot_cache_bytes(label: str, d: dict, directory: Path) -> Path | None:
    timeline = d.get("cache_bytes_timeline") or []
    if not timeline:
        return None
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    t = [p.get("t", 0) for p in timeline]
    for name, key in (("hot (RAM)", "hot_bytes"), ("SSD", "ssd_bytes"),
                      ("write staging", "staging_bytes")):
        ax.plot(t, [(p.get(key) or 0) / MIB for p in timeline], label=name)
    ax.set(title=f"Cache bytes by tier during the agents run: {label}",
           xlabel="seconds since our run started", ylabel="MiB")
    ax.set_ylim(bottom=0)
    ax.legend()
    return save(fig, directory / f"cache-bytes-{label}.png")


TRACE_COLORS = {"mlx_lm_server": "C1", "ours": "C0", "ours_anthropic": "C2"}


def plot_traces(label: str, d: dict, directory: Path) -> Path | None:
    """TTFT of every request of the trace replay against when it was sent, per server
    (each server's run starts at 0): where the cache helps, and how the tail looks."""
    requests = d.get("requests") or {}
    if not any(requests.values()):
        return None
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for name, rows in requests.items():
        points = sorted((r["start_s"], r["ttft"]) for r in rows
                        if r.get("ttft") is not None and r.get("start_s") is not None)
        failed = [r["start_s"] for r in rows if r.get("error")]
        if points:
            p50 = ((d.get("servers") or {}).get(name) or {}).get("ttft_p50_s")
            extra = f", p50 {p50:.3f} s" if p50 is not None else ""
            ax.plot(*zip(*points, strict=True), marker="o", markersize=3, linestyle="none",
                    color=TRACE_COLORS.get(name), label=f"{name}{extra}")
        if failed:
            ax.plot(failed, [0] * len(failed), marker="x", linestyle="none", color="red",
                    label=f"{name}: errors")
    s = d.get("settings") or {}
    ax.set(title=f"Trace replay, {s.get('sessions', '?')} sessions: {label}",
           xlabel="seconds since the server's run started", ylabel="TTFT (s)")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    return save(fig, directory / f"traces-ttft-{label}.png")


def times(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.3f}×"


def traces_lines(results: dict[str, dict[str, dict]]) -> list[str]:
    """The trace replay per server: TTFT percentiles, wall time, cached fraction, errors."""
    lines = []
    for label, d in valid(results["traces"]).items():
        s = d.get("settings") or {}
        vs = d.get("ratios_vs_mlx_lm_server") or {}
        lines += [f"**{label}**: {s.get('sessions')} concurrent sessions of kv-cache-tester's "
                  f"agentic-coding traces, {s.get('tokens_per_block')} tokens per 64-token trace "
                  f"block, system prompt {s.get('system_prompt_tokens')} tokens shared by every "
                  f"session, outputs ≤ {s.get('max_output')} tokens.", "",
                  "| server | requests | errors | TTFT p50 | p90 | p99 | wall | cached "
                  "fraction | p50 ratio | p99 ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, m in (d.get("servers") or {}).items():
            r = vs.get(name) or {}
            cached = m.get("cached_fraction")
            lines.append(f"| {name} | {m.get('requests_ok')} | {m.get('errors')} | "
                         f"{fmt(m.get('ttft_p50_s'), 's')} | {fmt(m.get('ttft_p90_s'), 's')} | "
                         f"{fmt(m.get('ttft_p99_s'), 's')} | {fmt(m.get('wall_s'), 's')} | "
                         f"{'n/a' if cached is None else f'{cached:.3f}'} | "
                         f"{times(r.get('ttft_p50'))} | {times(r.get('ttft_p99'))} |")
        lines.append("")
    return lines


def valid(by_label: dict[str, dict]) -> dict[str, dict]:
    return {label: d for label, d in by_label.items() if "_error" not in d}


def plots(results: dict[str, dict[str, dict]], directory: Path) -> list[tuple[str, Path]]:
    """Every plot the results allow, as (section title, PNG path)."""
    drawn: list[tuple[str, Path | None]] = []
    for label, d in valid(results["multiturn"]).items():
        drawn.append((f"TTFT per turn ({label})", plot_ttft_per_turn(label, d, directory)))
    drawn.append(("Throughput against concurrency",
                  plot_throughput(valid(results["serving"]), directory)))
    drawn.append(("Restart TTFT", plot_restart(valid(results["restart"]), directory)))
    for label, d in valid(results["agents"]).items():
        drawn.append((f"Cache bytes by tier ({label})", plot_cache_bytes(label, d, directory)))
    for label, d in valid(results["traces"]).items():
        drawn.append((f"Trace replay TTFT ({label})", plot_traces(label, d, directory)))
    return [(title, path) for title, path in drawn if path is not None]


# ---------------------------------------------------------------- other sections


MEMORY_COLUMNS = (("idle_mib", None), ("peak_mib", "peak_phase"), ("pss_idle_mib", None),
                  ("pss_peak_mib", "peak_phase"))


def mib(value: object, phase: object = None) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return ""
    return f"{value:,.0f} MiB" + (f" ({phase})" if phase else "")


def serving_memory(label: str, rss: dict) -> list[str]:
    """One row per server measured (``ours``, ``mlx_lm_server``, ``lean``, ...): each a
    dict of MiB figures as bench/serving.py writes them; other shapes are left out."""
    rows = []
    for server, m in rss.items():
        if isinstance(m, dict) and any(k in m for k, _ in MEMORY_COLUMNS):
            cells = " | ".join(mib(m.get(k), m.get(ph) if ph else None)
                               for k, ph in MEMORY_COLUMNS)
            cpu = (m.get("idle_cpu") or {}).get("total_pct")
            cpu_cell = f"{cpu:.1f}%" if isinstance(cpu, int | float) else ""
            rows.append(f"| serving | {label} | {server} | {cells} | {cpu_cell} |")
    return rows


def restart_memory(label: str, peaks: dict) -> list[str]:
    return [f"| restart | {label} | replica + cache store, long session, snapshots "
            f"{storage} |  | {mib(value / MIB)} |  |  |  |"
            for storage, value in peaks.items() if isinstance(value, int | float)]


def memory_rows(results: dict[str, dict[str, dict]]) -> list[str]:
    """Resident memory: serving's ``rss`` (idle and under load, RSS and PSS) and restart's
    peak RSS over a long session."""
    rows = [row for label, d in valid(results["serving"]).items()
            for row in serving_memory(label, d.get("rss") or {})]
    rows += [row for label, d in valid(results["restart"]).items()
             for row in restart_memory(label, d.get("peak_rss_bytes_long_session") or {})]
    if not rows:
        return []
    return ["| bench | model | server / setting | idle RSS | peak RSS | idle PSS | peak PSS "
            "| idle CPU |",
            "|---|---|---|---|---|---|---|---|", *rows, "",
            "RSS counts shared pages in every process that maps them; PSS splits them among "
            "the processes. Idle CPU: percent of one core, all processes, over 10 s after "
            "warm-up. Per-process figures are in the JSON."]


def checkpoint_rows(results: dict[str, dict[str, dict]]) -> list[str]:
    rows = []
    for label, d in valid(results["checkpoints"]).items():
        for interval, r in (d.get("intervals") or {}).items():
            ttfts = sorted(r.get("ttft_seconds") or [])
            median = f"{ttfts[len(ttfts) // 2]:.3f} s" if ttfts else "n/a"
            rows.append(f"| {label} | {interval} | {r.get('checkpoints')} | "
                        f"{r.get('checkpoint_bytes_per_1k_tokens')} | {median} |")
    if not rows:
        return []
    return ["| model | interval | checkpoints | bytes per 1K tokens | cold TTFT (median) |",
            "|---|---|---|---|---|", *rows]


def machine_lines(machine: dict) -> list[str]:
    if not machine:
        return ["Not recorded (no `machine.json`)."]
    lines = ["| | |", "|---|---|"]
    for key, value in machine.items():
        if key == "memory_bytes" and isinstance(value, int):
            key, value = "memory", f"{value / (1 << 30):.1f} GiB"
        lines.append(f"| {key} | {value} |")
    return lines


def runs_lines(runs: dict[str, dict]) -> list[str]:
    if not runs:
        return []
    lines = ["| bench | model | status | seconds | command | log |", "|---|---|---|---|---|---|"]
    for run in runs.values():
        log = f"[log]({run['log']})" if run.get("log") else ""
        seconds = run.get("seconds")
        status = f"{run.get('status')}{' (quick)' if run.get('quick') else ''}"
        lines.append(f"| {run['bench']} | {run['model']} | {status} | "
                     f"{'' if seconds is None else f'{seconds:.0f}'} | "
                     f"`{run.get('command', '')}` | {log} |")
    return lines


def failure_lines(runs: dict[str, dict]) -> list[str]:
    lines = []
    for run in runs.values():
        if run.get("status") != "ok":
            lines += [f"### {run['bench']} on {run['model']}: {run.get('status')} "
                      f"(exit {run.get('returncode')})", "", "```",
                      (run.get("log_tail") or "(no log)").rstrip("\n"), "```", ""]
    return lines


# ---------------------------------------------------------------- the report


def header_lines(runs: dict[str, dict], machine: dict) -> list[str]:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = ["# Benchmark report", "",
           f"Rendered {now} from the JSON in this directory (`python -m bench.report`).", ""]
    quick = [f"{r['bench']} on {r['model']}" for r in runs.values() if r.get("quick")]
    if quick:
        out += [f"**Quick run** ({', '.join(quick)}): smaller settings that check the "
                "plumbing; their ratios say nothing about the goals.", ""]
    return out + ["## How to read this", "", HOW_TO_READ, "## Machine", "",
                  *machine_lines(machine), ""]


def plot_lines(drawn: list[tuple[str, Path]]) -> list[str]:
    """Relative image links: the report stays valid wherever its directory is embedded."""
    out = []
    for title, path in drawn:
        out += [f"### {title}", "", f"![{title}]({path.name})", ""]
    return out


def render(directory: Path) -> str:
    """The whole report as Markdown; draws the plots into ``directory`` on the way."""
    results = load_results(directory)
    runs = load_json(directory / RUNS, {}).get("runs", {})
    sections = (("Summary", summary_table(summary_rows(results, runs))),
                ("Runs", runs_lines(runs)),
                ("Serving, real model", real_serving_lines(results)),
                ("Trace replay", traces_lines(results)),
                ("Plots", plot_lines(plots(results, directory))),
                ("Resident memory", memory_rows(results)),
                ("Checkpoint interval (in-process, cold prefill)", checkpoint_rows(results)),
                ("Failures", failure_lines(runs)))
    out = header_lines(runs, load_json(directory / MACHINE, {}))
    for title, lines in sections:
        if lines:
            out += [f"## {title}", "", *lines]
            out += [] if lines[-1] == "" else [""]
    return "\n".join(out).rstrip("\n") + "\n"


def write_report(directory: Path) -> Path:
    """Render ``directory``'s results to ``directory/REPORT.md``; returns its path."""
    path = directory / REPORT
    path.write_text(render(directory))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="results directory of one run")
    args = parser.parse_args(argv)
    print(write_report(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
