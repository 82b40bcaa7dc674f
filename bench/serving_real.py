"""``bench.serving`` for a real model (issue 28): the rows users see, interleaved A/B.

A real model (``embedded:smollm2-135m``: SmolLM2-135M-Instruct) decodes at ~10 tok/s and
prefills at ~14 tok/s on a 2-core CPU, so the full serving bench (256-token streams, an
8-stream sweep, a 4K cold prompt) would take hours. This mode measures only what a user
of such a model feels, in a few short rounds:

- **non-streamed, max_tokens 1**: wall time per request measured here over HTTP, median
  and p90 (goal <= 1.1x); each request has a prompt of its own (``Note a-<i>: ...``) after
  the model's default system prompt, which both servers may cache (they report it in
  ``usage.prompt_tokens_details.cached_tokens``, recorded);
- **64-token answers**: streamed, a prompt that makes the model write long (``Write a long
  story about <topic>.``); decode tok/s = (completion tokens from ``usage`` - 1) / (last
  content chunk - first), median (goal >= 0.95x), and tok/s over the whole request beside it;
- **forced tool call**: OpenAI ``tools`` (one function), ``tool_choice`` naming it,
  ``parallel_tool_calls: false``, ``max_tokens`` 48: the fraction of requests whose
  ``tool_calls[0].function.arguments`` parse as JSON (goal: every request).
  ``mlx_lm.server`` gets the very same request; it is recorded as it answers. Its own
  template (the model directory's, SmolLM2's) renders no tools, so a second
  ``mlx_lm.server`` started with ``--chat-template`` set to ours (``smollm2-tools``, which
  it reads for its tool parser too) gets the tool requests as well: what ``mlx_lm.server``
  does with the same prompt as ours (it has no ``tool_choice``: nothing forces a call).

Every server is started once and stays up; while one is measured, every process of the
others is stopped (SIGSTOP, then SIGCONT: Ray's idle processes use 15-25% of a core, which
would otherwise slow ``mlx_lm.server`` down). The rounds alternate which server goes first
(ABBA), so that the machine's drift hits both alike; each round sends each server the same
new prompts (temperature 0), so outputs compare request by request. Ratios are ours /
mlx_lm.server, medians over every round.

    python -m bench.serving --model smollm2-135m [--rounds 4] [--quick] [--out PATH]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.common import (
    ServerProcess,
    compare_outputs,
    descendants,
    emit,
    post_chat,
    start_mlx_lm_server,
    start_ours,
    stream_chat,
    workdir,
)

GOALS = {"nonstreamed": 1.1, "answers": 0.95, "tool_json": 1.0}
THAW_SETTLE_S = 1.0  # after SIGCONT, before the first measured request (either side)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TOPICS = ("a lighthouse keeper and a storm", "a robot who learns to paint",
          "two friends crossing a desert", "a dragon who is afraid of heights",
          "a village that forgets its name", "a clockmaker's last clock",
          "a cat who becomes mayor", "a ship lost in the ice", "a girl who talks to trees",
          "a baker's secret recipe", "a detective on a night train",
          "an astronaut who hears music", "a library that opens at midnight",
          "a fisherman and a golden fish", "a king without a crown", "a garden on the moon")
CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Madrid",
          "Nairobi", "Seoul", "Dublin", "Mumbai", "Santiago", "Vienna", "Hanoi", "Denver")
PROMPT = "Once upon a time, in a land far away, there lived a"
OURS, MLX, MLX_TEMPLATE = "ours", "mlx_lm_server", "mlx_lm_server_tools_template"


@dataclass(frozen=True)
class RealPlan:
    """Requests per server and round (each row its own prompts), and the rounds."""

    rounds: int = 4
    nonstreamed: int = 3
    answers: int = 2
    answer_tokens: int = 64
    tool_calls: int = 2
    tool_max_tokens: int = 48

    @property
    def max_tokens(self) -> int:
        return max(self.answer_tokens, self.tool_max_tokens)


def make_plan(quick: bool, rounds: int | None) -> RealPlan:
    if quick:
        return RealPlan(rounds=rounds or 1, nonstreamed=2, answers=1, tool_calls=1)
    return RealPlan(rounds=rounds or RealPlan.rounds)


# ---- the requests: the same bodies for every server, but for ``model``

def nonstreamed_body(model: str, i: int) -> dict:
    return {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": f"Note a-{i}: {PROMPT}"}]}


def answer_body(model: str, i: int, tokens: int) -> dict:
    topic = TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" (part {i})")
    return {"model": model, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write a long story about {topic}."}]}


def tool_body(model: str, i: int, max_tokens: int) -> dict:
    city = CITIES[i % len(CITIES)] + ("" if i < len(CITIES) else f" (district {i})")
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "messages": [{"role": "user", "content": f"What is the weather in {city} today?"}]}


def tool_call(base_url: str, body: dict) -> dict:
    """One non-streamed tool request: whether ``tool_calls[0].function.arguments`` parses as
    JSON, with what came back instead when it does not."""
    start = time.perf_counter()
    try:
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
        obj = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return {"total_s": time.perf_counter() - start, "status": None,
                "error": f"{type(e).__name__}: {e}"[:300], "json_arguments": False}
    total = time.perf_counter() - start
    choice = (obj.get("choices") or [{}])[0] if isinstance(obj, dict) else {}
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    function = (calls[0].get("function") or {}) if calls else {}
    arguments = function.get("arguments")
    parsed, is_json = None, False
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            parsed, is_json = json.loads(arguments), True
    usage = (obj.get("usage") or {}) if isinstance(obj, dict) else {}
    return {"total_s": total, "status": r.status_code,
            "error": None if r.status_code == 200 else json.dumps(obj)[:300],
            "finish_reason": choice.get("finish_reason"), "tool_calls": len(calls),
            "name": function.get("name"), "arguments": arguments,
            "json_arguments": is_json,
            "arguments_object": isinstance(parsed, dict),
            "content": (message.get("content") or "")[:200],
            "tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


# ---- the servers: one measured, the others frozen

def tree(server: ServerProcess) -> list[int]:
    return [server.proc.pid, *descendants(server.proc.pid)]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def others_frozen(servers: dict[str, ServerProcess], measured: str) -> Iterator[None]:
    """Every process of every server but ``measured`` stopped (SIGSTOP) meanwhile, so that
    none takes CPU from it; continued (SIGCONT) whatever happens, then a short settle."""
    pids = [pid for name, s in servers.items() if name != measured for pid in tree(s)]
    signal_all(pids, signal.SIGSTOP)
    try:
        time.sleep(THAW_SETTLE_S)
        yield
    finally:
        signal_all(pids, signal.SIGCONT)


def start_servers(tmp: Path, model: str, model_dir: Path, plan: RealPlan,
                  template_arm: bool) -> dict[str, ServerProcess]:
    from serve_app.config.chat_templates import BUILTIN_TEMPLATES

    servers: dict[str, ServerProcess] = {}
    try:
        servers[OURS] = start_ours(tmp, OURS, model, cache=None, max_tokens=plan.max_tokens,
                                   context_length=8192)
        servers[MLX] = start_mlx_lm_server(tmp, MLX, model_dir, plan.max_tokens)
        if template_arm:
            servers[MLX_TEMPLATE] = start_mlx_lm_server(
                tmp, MLX_TEMPLATE, model_dir, plan.max_tokens,
                "--chat-template", BUILTIN_TEMPLATES["smollm2-tools"])
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


# ---- one server's turn in a round

def warm_up(server: ServerProcess, model: str, arm: str, plan: RealPlan) -> None:
    """One request of each kind this arm gets, not measured (prompts of their own)."""
    if arm != MLX_TEMPLATE:
        post_chat(server.base_url, {**nonstreamed_body(model, 0), "messages": [
            {"role": "user", "content": f"Warm up: {PROMPT}"}]})
        stream_chat(server.base_url, {**answer_body(model, 0, 8), "messages": [
            {"role": "user", "content": "Write a long story about warming up."}]})
    tool_call(server.base_url, {**tool_body(model, 0, plan.tool_max_tokens), "messages": [
        {"role": "user", "content": "What is the weather in Reykjavik today?"}]})


def server_turn(server: ServerProcess, model: str, arm: str, rnd: int,
                plan: RealPlan) -> list[dict]:
    """This round's requests of every row to one server: a record per request."""
    url = server.base_url
    out: list[dict] = []

    def keep(row: str, i: int, r: dict, **extra) -> None:
        out.append({"row": row, "i": i, "round": rnd, "arm": arm, **extra,
                    **{k: r.get(k) for k in ("total_s", "text", "tokens", "prompt_tokens",
                                             "cached_tokens", "finish_reason")}})

    if arm != MLX_TEMPLATE:
        for i in range(rnd * plan.nonstreamed, (rnd + 1) * plan.nonstreamed):
            keep("nonstreamed", i, post_chat(url, nonstreamed_body(model, i)))
        for i in range(rnd * plan.answers, (rnd + 1) * plan.answers):
            r = stream_chat(url, answer_body(model, i, plan.answer_tokens))
            decode = (r["tokens"] - 1) / r["decode_s"] if r["decode_s"] > 0 else None
            keep("answers", i, r, ttft=r["ttft"], decode_s=r["decode_s"], decode_tps=decode,
                 e2e_tps=r["tokens"] / r["total_s"] if r["total_s"] > 0 else None)
    for i in range(rnd * plan.tool_calls, (rnd + 1) * plan.tool_calls):
        r = tool_call(url, tool_body(model, i, plan.tool_max_tokens))
        out.append({"row": "tool_call", "i": i, "round": rnd, "arm": arm, **r})
    return out


def run_rounds(servers: dict[str, ServerProcess], models: dict[str, str],
               plan: RealPlan) -> list[dict]:
    """Every round: each server in turn, the others frozen; ours first in even rounds,
    last in odd ones (ABBA), the template arm (tool row only) after mlx_lm.server."""
    for arm, server in servers.items():
        with others_frozen(servers, arm):
            warm_up(server, models[arm], arm, plan)
    records: list[dict] = []
    for rnd in range(plan.rounds):
        mlx = [a for a in (MLX, MLX_TEMPLATE) if a in servers]
        order = [OURS, *mlx] if rnd % 2 == 0 else [*mlx, OURS]
        for arm in order:
            print(f"[serving] round {rnd + 1}/{plan.rounds}: {arm}", file=sys.stderr,
                  flush=True)
            with others_frozen(servers, arm):
                records += server_turn(servers[arm], models[arm], arm, rnd, plan)
    return records


# ---- the numbers

def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def p90(values: list[float]) -> float | None:
    ordered = sorted(v for v in values if v is not None)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)] if ordered else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rows_of(records: list[dict], row: str, arm: str) -> list[dict]:
    return sorted((r for r in records if r["row"] == row and r["arm"] == arm),
                  key=lambda r: r["i"])


def per_round(records: list[dict], row: str, key: str, rounds: int) -> list[float | None]:
    """Ours / mlx_lm.server of each round's medians: how much the ratio moves."""
    out = []
    for rnd in range(rounds):
        mine = [r for r in records if r["round"] == rnd]
        out.append(ratio(median([r[key] for r in rows_of(mine, row, OURS)]),
                         median([r[key] for r in rows_of(mine, row, MLX)])))
    return out


def tool_summary(rows: list[dict]) -> dict:
    ok = sum(bool(r.get("json_arguments")) for r in rows)
    return {"requests": len(rows), "json_arguments": ok,
            "fraction": ok / len(rows) if rows else None,
            "with_tool_calls": sum(bool(r.get("tool_calls")) for r in rows),
            "arguments_objects": sum(bool(r.get("arguments_object")) for r in rows),
            "named_get_weather": sum(r.get("name") == "get_weather" for r in rows),
            "errors": sum(r.get("status") != 200 for r in rows),
            "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in rows)),
            "median_s": median([r["total_s"] for r in rows]),
            "completion_tokens": [r.get("tokens") for r in rows],
            "prompt_tokens": rows[0].get("prompt_tokens") if rows else None,
            "samples": [{k: r.get(k) for k in ("arguments", "content", "finish_reason")}
                        for r in rows[:3]]}


def build_result(model: str, model_dir: Path, host: dict, plan: RealPlan,
                 records: list[dict], arms: list[str]) -> dict:
    plain = {arm: rows_of(records, "nonstreamed", arm) for arm in (OURS, MLX)}
    answers = {arm: rows_of(records, "answers", arm) for arm in (OURS, MLX)}
    walls = {arm: [r["total_s"] for r in rows] for arm, rows in plain.items()}
    decode = {arm: [r["decode_tps"] for r in rows] for arm, rows in answers.items()}
    e2e = {arm: [r["e2e_tps"] for r in rows] for arm, rows in answers.items()}
    m_wall = {arm: median(v) for arm, v in walls.items()}
    p_wall = {arm: p90(v) for arm, v in walls.items()}
    m_dec = {arm: median(v) for arm, v in decode.items()}
    m_e2e = {arm: median(v) for arm, v in e2e.items()}
    tools = {arm: tool_summary(rows_of(records, "tool_call", arm)) for arm in arms}
    ours_tools = tools[OURS]

    def cached(rows: list[dict]) -> dict:
        return {"prompt_tokens": [r["prompt_tokens"] for r in rows],
                "cached_tokens": [r["cached_tokens"] for r in rows]}

    return {
        "model": model,
        "model_dir": str(model_dir),
        "mode": "interleaved",
        "machine": host,
        "settings": {**asdict(plan), "arms": arms, "thaw_settle_s": THAW_SETTLE_S,
                     "order": "ABBA: ours first in even rounds, last in odd ones; the others "
                              "frozen (SIGSTOP) while one is measured",
                     "ours_profile": {"context_length": 8192, "max_tokens": plan.max_tokens,
                                      "cache": "default (enabled)",
                                      "chat_template": "smollm2-tools (the model's default)",
                                      "tool_call_format": "json_tools (the model's default)"},
                     "mlx_lm_server_args": ["--max-tokens", str(plan.max_tokens)],
                     "mlx_lm_server_tools_template_args": [
                         "--max-tokens", str(plan.max_tokens), "--chat-template",
                         "<serve_app.config.chat_templates.BUILTIN_TEMPLATES['smollm2-tools']>"],
                     "tool": TOOL},
        "short_requests": {
            "requests": len(plain[OURS]),
            "prompt_tokens": {"ours": plain[OURS][0]["prompt_tokens"] if plain[OURS] else None,
                              "mlx_lm_server": plain[MLX][0]["prompt_tokens"]
                              if plain[MLX] else None},
            "nonstreamed": {
                "max_tokens": 1,
                "ours_median_s": m_wall[OURS], "mlx_lm_server_median_s": m_wall[MLX],
                "ours_p90_s": p_wall[OURS], "mlx_lm_server_p90_s": p_wall[MLX],
                "ratio": ratio(m_wall[OURS], m_wall[MLX]),
                "p90_ratio": ratio(p_wall[OURS], p_wall[MLX]),
                "goal": GOALS["nonstreamed"],
                "ratio_per_round": per_round(records, "nonstreamed", "total_s", plan.rounds),
                "runs": {"ours": walls[OURS], "mlx_lm_server": walls[MLX]},
                "cache": {"ours": cached(plain[OURS]), "mlx_lm_server": cached(plain[MLX])}},
            "single_stream": {
                "max_tokens": plan.answer_tokens,
                "measure": "decode tok/s: (usage.completion_tokens - 1) / (last content "
                           "chunk - first content chunk)",
                "ours_tps": m_dec[OURS], "mlx_lm_server_tps": m_dec[MLX],
                "ratio": ratio(m_dec[OURS], m_dec[MLX]), "goal": GOALS["answers"],
                "ratio_per_round": per_round(records, "answers", "decode_tps", plan.rounds),
                "ours_e2e_tps": m_e2e[OURS], "mlx_lm_server_e2e_tps": m_e2e[MLX],
                "e2e_ratio": ratio(m_e2e[OURS], m_e2e[MLX]),
                "completion_tokens": {arm: [r["tokens"] for r in rows]
                                      for arm, rows in answers.items()},
                "runs": decode, "e2e_runs": e2e,
                "timings": {arm: [{k: r[k] for k in ("tokens", "ttft", "decode_s", "total_s",
                                                     "prompt_tokens", "cached_tokens")}
                                  for r in rows] for arm, rows in answers.items()}},
        },
        "tool_call": {
            "goal": "every request's tool_calls[0].function.arguments parses as JSON",
            "max_tokens": plan.tool_max_tokens,
            "ours_fraction": ours_tools["fraction"],
            "met": ours_tools["fraction"] == GOALS["tool_json"],
            **tools},
        "outputs": {
            "nonstreamed_vs_mlx_lm_server": compare_outputs(
                plain[OURS], plain[MLX], [f"nonstreamed {r['i']}" for r in plain[OURS]]),
            "answers_vs_mlx_lm_server": compare_outputs(
                answers[OURS], answers[MLX], [f"answer {r['i']}" for r in answers[OURS]]),
        },
        "records": records,
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(result: dict) -> str:
    sr = result["short_requests"]
    p, a, t = sr["nonstreamed"], sr["single_stream"], result["tool_call"]
    o = result["outputs"]
    lines = [
        f"non-streamed, max_tokens 1 ({sr['prompt_tokens']['ours']} prompt tokens, "
        f"{sr['requests']} each): median ours {fmt(p['ours_median_s'], '.3f')} s / "
        f"mlx_lm.server {fmt(p['mlx_lm_server_median_s'], '.3f')} s = {fmt(p['ratio'])}x "
        f"(goal <= {p['goal']}); per round "
        + ", ".join(fmt(x) for x in p["ratio_per_round"]),
        f"{a['max_tokens']}-token answers, decode tok/s: ours {fmt(a['ours_tps'], '.2f')} / "
        f"mlx_lm.server {fmt(a['mlx_lm_server_tps'], '.2f')} = {fmt(a['ratio'])}x (goal >= "
        f"{a['goal']}); whole request {fmt(a['ours_e2e_tps'], '.2f')} / "
        f"{fmt(a['mlx_lm_server_e2e_tps'], '.2f')} = {fmt(a['e2e_ratio'])}x; tokens "
        f"{a['completion_tokens']}",
        *(f"forced tool call, {arm}: {t[arm]['json_arguments']}/{t[arm]['requests']} with "
          f"JSON arguments, {t[arm]['with_tool_calls']} with tool_calls, finish "
          f"{t[arm]['finish_reasons']}" for arm in result["settings"]["arms"]),
        "identical outputs: " + ", ".join(f"{k} {v['identical']}/{v['requests']}"
                                          for k, v in o.items()),
    ]
    return "\n".join(lines)


def main(model: str, host: dict, quick: bool, rounds: int | None, out: Path | None,
         template_arm: bool = True) -> int:
    from serve_app.models.embedded import materialize

    plan = make_plan(quick, rounds)
    model_dir = materialize(model)
    with workdir() as tmp:
        servers = start_servers(tmp, model, model_dir, plan, template_arm)
        models = {OURS: model, MLX: str(model_dir), MLX_TEMPLATE: str(model_dir)}
        try:
            records = run_rounds(servers, models, plan)
        finally:
            for s in servers.values():
                signal_all(tree(s), signal.SIGCONT)  # never left stopped
                s.stop()
    result = build_result(model, model_dir, host, plan, records, list(servers))
    emit(result, out)
    print(summary(result))
    return 0
