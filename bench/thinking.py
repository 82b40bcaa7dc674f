"""Thinking models across turns (issue 41): the next turn's prefix prefilled ahead.

A 10-turn agent session on a thinking model (``tiny-hybrid-mtp``: Qwen3.5's template, whose
generation prompt opens ``<think>`` and which renders earlier turns without their thought),
each turn thinking ``--budget`` tokens (our profile's ``reasoning.budget_tokens``), then
answering up to ``max_tokens = budget + --answer-tokens``; temperature 0, streamed. Each next
request sends the earlier answers back as a client does (content only). Three arms, each
alone on the machine, with the same pause between turns (a client reading the answer):

- ``on``: our server, ``reasoning.prefill_next_turn: true`` (the default): after each turn it
  prefills the next turn's prefix (the history without this turn's thought) from the cache;
- ``off``: the same with ``prefill_next_turn: false``: a turn restores only up to the
  previous answer's start;
- ``mlx_lm_server``: ``mlx_lm.server`` on the same weights directory. It has no thinking
  budget (random weights think until ``max_tokens``), so its outputs differ; it gets the
  ``on`` arm's answers as history, so that every turn's prompt is the ``on`` arm's.

Reports, over turns 2+: cached fraction (``usage.prompt_tokens_details.cached_tokens`` /
``prompt_tokens``, mean and min), TTFT (first streamed token, thought or answer) p50 and mean,
the ratios on / off and on / mlx_lm.server, and whether on and off gave identical outputs
(content and reasoning_content). Goals (issue 41): every later prompt >= 0.9 cached, TTFT
mean on / off <= 0.5, outputs identical.

Usage: python -m bench.thinking [--quick] [--out FILE] [--sessions N] [--turns N]
       [--budget N] [--answer-tokens N] [--pause S] [--block-size N]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.common import (
    add_cache_options,
    add_model_option,
    cache_profile,
    emit,
    model_stats,
    start_mlx_lm_server,
    start_ours,
    stream_chat,
    workdir,
)
from serve_app.models.embedded import materialize

ARMS = ("on", "off", "mlx_lm_server")
GOAL_CACHED_FRACTION = 0.9  # every prompt of turns 2+ (issue 41)
GOAL_TTFT_VS_OFF = 0.5  # mean TTFT of turns 2+, on / off

# An agent's system prompt (~700 tokens: the embedded tokenizer is byte-level).
SYSTEM = """\
You are a coding agent working in a Python repository (session {session}). Work in small
steps: think, call one tool, read its result, then decide the next step. Answer briefly.
Tools:
- read_file(path: str, start: int = 1, end: int | None = None): the file's lines.
- grep(pattern: str, path: str = ".", glob: str | None = None): matching lines, with paths.
- edit_file(path: str, old: str, new: str): replace one exact occurrence of old with new.
- run(command: str, timeout_s: int = 120): a shell command's exit status and output tail.
- run_tests(selector: str = "tests", markers: str | None = None): pytest's summary.
- git_commit(message: str, paths: list[str]): commit these paths only.
Never commit unrelated files; run the tests that cover a change before you commit.
"""

USERS = (
    "The CLI crashes on an empty config file. Find where the config is parsed.",
    "read_file(serve_app/config/loader.py) -> 120 lines; yaml.safe_load returns None.",
    "Yes, treat an empty file as an empty mapping. Make the change.",
    "edit_file applied: 1 replacement. What test should cover it?",
    "Write that test in tests/unit/test_loader.py.",
    "run_tests(tests/unit/test_loader.py) -> 1 failed: KeyError 'models'.",
    "The default should be an empty model list. Fix it and rerun.",
    "run_tests -> 14 passed in 0.41s. Anything else to check?",
    "git_diff shows loader.py and test_loader.py only. Commit them.",
    "Committed as 3f2a9c1. Summarize the change for the changelog.",
)


@dataclass
class TurnResult:
    """One streamed chat request of a session, as the client saw it."""

    session: int
    turn: int  # 1-based
    ttft: float  # first streamed token, thought or answer
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    content: str
    reasoning: str
    finish_reason: str | None
    # Our engine's requests in flight when this turn was sent (a prefill ahead still
    # running); None for mlx_lm.server.
    in_flight_at_send: int | None = None

    @property
    def cached_fraction(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


def stream_turn(base_url: str, body: dict) -> dict:
    """One streamed turn (``common.stream_chat``); a stream that ended in an error event
    raises."""
    r = stream_chat(base_url, body)
    if r["error"]:
        raise RuntimeError(f"stream ended with an error: {r['error']}")
    return {**r, "content": r["text"]}


def in_flight(base_url: str, model: str) -> int | None:
    try:
        stats = httpx.get(f"{base_url}/v1/stats", timeout=30).json()["models"][model]
        return (stats.get("engine") or {}).get("in_flight")
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def run_session(base_url: str, model: str, session: int, users: list[str], max_tokens: int,
                pause: float, stats_of: str | None = None,
                answers: list[str] | None = None) -> list[TurnResult]:
    """One session, turn after turn, ``pause`` seconds between turns; each next request
    sends the earlier answers back (the server's own, or ``answers``). ``stats_of``: our
    model's name, to read our engine's requests in flight before each turn is sent."""
    messages = [{"role": "system", "content": SYSTEM.format(session=session)}]
    out: list[TurnResult] = []
    for i, user in enumerate(users):
        if i:
            time.sleep(pause)
        busy = in_flight(base_url, stats_of) if stats_of else None
        messages.append({"role": "user", "content": user})
        r = stream_turn(base_url, {"model": model, "messages": messages,
                                   "max_tokens": max_tokens, "temperature": 0})
        usage = r["usage"]
        out.append(TurnResult(
            session=session, turn=i + 1, ttft=r["ttft"], total_s=r["total_s"],
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            reasoning_tokens=(usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens"),
            content=r["content"], reasoning=r["reasoning"], finish_reason=r["finish_reason"],
            in_flight_at_send=busy))
        messages.append({"role": "assistant",
                         "content": answers[i] if answers is not None else r["content"]})
    return out


# ---------------------------------------------------------------- the summary (pure)


def arm_summary(turns: list[TurnResult]) -> dict:
    """Turns 2+ of an arm's sessions: cached fraction mean and min, TTFT p50 and mean,
    and how many turns were sent while our engine still ran something (a prefill ahead)."""
    later = [t for t in turns if t.turn > 1]
    fractions = [f for f in (t.cached_fraction for t in later) if f is not None]
    ttfts = [t.ttft for t in later]
    return {
        "turns": len(later),
        "cached_fraction_mean": statistics.fmean(fractions) if fractions else None,
        "cached_fraction_min": min(fractions) if fractions else None,
        "prompt_tokens_mean": statistics.fmean(t.prompt_tokens or 0 for t in later)
        if later else None,
        "uncached_tokens_mean": statistics.fmean(
            (t.prompt_tokens or 0) - (t.cached_tokens or 0) for t in later) if later else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "turns_sent_while_busy": sum(1 for t in later if t.in_flight_at_send),
    }


def compare(a: list[TurnResult], b: list[TurnResult]) -> dict:
    """Turn-by-turn equality of thought and answer text (temperature 0)."""
    mismatches = [{"session": x.session, "turn": x.turn,
                   "content_equal": x.content == y.content,
                   "reasoning_equal": x.reasoning == y.reasoning}
                  for x, y in zip(a, b, strict=True)
                  if (x.content, x.reasoning) != (y.content, y.reasoning)]
    return {"requests": len(a), "identical": len(a) - len(mismatches),
            "all_identical": not mismatches, "mismatches": mismatches}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(arms: dict[str, list[TurnResult]]) -> dict:
    """Per-arm summaries of turns 2+, the ratios on / off and on / mlx_lm.server, the
    on-off output comparison, and each goal met or not."""
    per = {name: arm_summary(turns) for name, turns in arms.items()}
    on, off, mlx = (per.get(k, {}) for k in ARMS)
    outputs = compare(arms["on"], arms["off"]) if "off" in arms else None
    ratios = {f"on_vs_{base}": {stat: ratio(on.get(stat), ref.get(stat))
                                for stat in ("ttft_p50_s", "ttft_mean_s")}
              for base, ref in (("off", off), ("mlx_lm_server", mlx)) if ref}
    least = on.get("cached_fraction_min")
    ttft = ratios.get("on_vs_off", {}).get("ttft_mean_s")
    return {
        "arms": per,
        "ratios": ratios,
        "on_vs_off_outputs": outputs,
        "goals": {
            "cached_fraction_each_prompt": {"goal": f">= {GOAL_CACHED_FRACTION}",
                                            "value": least, "met": least is not None
                                            and least >= GOAL_CACHED_FRACTION},
            "ttft_mean_on_vs_off": {"goal": f"<= {GOAL_TTFT_VS_OFF}", "value": ttft,
                                    "met": ttft is not None and ttft <= GOAL_TTFT_VS_OFF},
            "outputs_identical_on_off": {
                "goal": "all", "met": bool(outputs and outputs["all_identical"]),
                "value": f"{outputs['identical']}/{outputs['requests']}" if outputs else None},
        },
    }


def metric_values(text: str, name: str, by: str | None = None) -> dict[str, float]:
    """A Prometheus text export's samples of ``name`` (Ray's ``ray_`` prefix and a
    counter's ``_total`` allowed), summed by the value of label ``by`` ("" without)."""
    out: dict[str, float] = {}
    pattern = rf"^(?:ray_)?{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+(\S+)$"
    for m in re.finditer(pattern, text, re.MULTILINE):
        found = re.search(rf'[{{,]{re.escape(by)}="([^"]*)"', m.group(1) or "") if by else None
        key = found.group(1) if found else ""
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


# ---------------------------------------------------------------- the arms


def counted_metrics(base_url: str, aheads: int, timeout: float = 30.0) -> str:
    """Our ``/metrics`` once it shows the thinking counters and counts ``aheads`` prefills
    ahead (any outcome; the replica pushes its counters every few seconds), or at
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        ahead = metric_values(text, "serve_app_history_ahead_requests")
        if (ahead and sum(ahead.values()) >= aheads) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def run_ours(args, tmp: Path, ahead: bool, users: list[str]) -> tuple[list[TurnResult], dict]:
    tag = "ours-on" if ahead else "ours-off"
    server = start_ours(tmp, tag, args.model, cache=cache_profile(args),
                        max_tokens=args.max_tokens,
                        reasoning={"budget_tokens": args.budget, "prefill_next_turn": ahead})
    try:
        turns = [t for s in range(args.sessions)
                 for t in run_session(server.base_url, args.model, s, users, args.max_tokens,
                                      args.pause, stats_of=args.model)]
        text = counted_metrics(server.base_url, len(turns) if ahead else 0)
        engine = model_stats(server, args.model).get("engine") or {}
        extra = {"history_ahead_requests": metric_values(
                     text, "serve_app_history_ahead_requests", by="outcome"),
                 "history_ahead_prefilled_tokens": metric_values(
                     text, "serve_app_history_ahead_prefilled_tokens").get(""),
                 "reasoning_tokens": metric_values(text, "serve_app_reasoning_tokens").get(""),
                 "reasoning_tokens_in_usage": sum(t.reasoning_tokens or 0 for t in turns),
                 "engine": {k: engine.get(k) for k in ("submitted", "finished",
                                                       "restored_tokens", "prompt_tokens")}}
    finally:
        server.stop()
    return turns, extra


def run_mlx_lm_server(args, tmp: Path, users: list[str],
                      on: list[TurnResult]) -> list[TurnResult]:
    server = start_mlx_lm_server(tmp, "mlx_lm_server", args.model_dir, args.max_tokens)
    try:
        model = str(args.model_dir)
        return [t for s in range(args.sessions)
                for t in run_session(server.base_url, model, s, users, args.max_tokens,
                                     args.pause, answers=[x.content for x in on
                                                          if x.session == s])]
    finally:
        server.stop()


def table(result: dict) -> str:
    s = result["summary"]
    lines = [f"model {result['model']}, thought budget {result['settings']['budget']}, "
             f"max_tokens {result['settings']['max_tokens']}, turns 2+ of "
             f"{result['settings']['sessions']} session(s)",
             "arm            cached mean  cached min  uncached  TTFT p50  TTFT mean"]
    for name, a in s["arms"].items():
        lines.append(f"{name:<14} {fmt(a['cached_fraction_mean']):>11} "
                     f"{fmt(a['cached_fraction_min']):>11} "
                     f"{fmt(a['uncached_tokens_mean'], 1):>9} "
                     f"{fmt(a['ttft_p50_s']):>9} {fmt(a['ttft_mean_s']):>10}")
    for base, r in s["ratios"].items():
        lines.append(f"TTFT {base}: p50 {fmt(r['ttft_p50_s'])}x, mean {fmt(r['ttft_mean_s'])}x")
    for goal, g in s["goals"].items():
        value = g["value"] if not isinstance(g["value"], float) else fmt(g["value"])
        lines.append(f"goal {goal} {g['goal']}: {value} -> {'met' if g['met'] else 'MISSED'}")
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, "tiny-hybrid-mtp")
    add_cache_options(parser)
    parser.add_argument("--sessions", type=int, default=2,
                        help="sessions per arm, one after the other (default 2)")
    parser.add_argument("--turns", type=int, default=len(USERS),
                        choices=range(2, len(USERS) + 1), metavar=f"2..{len(USERS)}",
                        help=f"turns per session (default {len(USERS)})")
    parser.add_argument("--budget", type=int, default=200, help="thought tokens (default 200)")
    parser.add_argument("--answer-tokens", type=int, default=40,
                        help="max_tokens is budget + this (default 40)")
    parser.add_argument("--pause", type=float, default=1.5,
                        help="seconds between turns, every arm (default 1.5)")
    parser.add_argument("--only", default=",".join(ARMS), help=f"arms (default {','.join(ARMS)})")
    parser.add_argument("--quick", action="store_true",
                        help="1 session of 3 turns, budget 40, answers 16: the plumbing only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.budget, args.answer_tokens = 1, 3, 40, 16
    arms = [a for a in args.only.split(",") if a]
    if "on" not in arms or not set(arms) <= set(ARMS):
        parser.error(f"--only: arms of {ARMS}, 'on' among them")
    args.max_tokens = args.budget + args.answer_tokens
    args.model_dir = materialize(args.model)
    users = list(USERS[:args.turns])

    results: dict[str, list[TurnResult]] = {}
    server_info: dict[str, dict] = {}
    tic = time.monotonic()
    with workdir() as tmp:
        for arm in ("on", "off"):
            if arm in arms:
                results[arm], server_info[arm] = run_ours(args, tmp, arm == "on", users)
        if "mlx_lm_server" in arms:
            results["mlx_lm_server"] = run_mlx_lm_server(args, tmp, users, results["on"])
    result = {
        "model": args.model,
        "settings": {"sessions": args.sessions, "turns": args.turns, "budget": args.budget,
                     "answer_tokens": args.answer_tokens, "max_tokens": args.max_tokens,
                     "pause_s": args.pause, "cache": cache_profile(args),
                     "quick": args.quick, "arms": arms,
                     "mlx_lm_server_history": "the on arm's answers (content only)"},
        "summary": summarize(results),
        "servers": server_info,
        "seconds": time.monotonic() - tic,
        "turns": {arm: [{**asdict(t), "cached_fraction": t.cached_fraction} for t in turns]
                  for arm, turns in results.items()},
    }
    emit(result, args.out)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
