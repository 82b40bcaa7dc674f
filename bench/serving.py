"""Serving throughput, latency and memory: our HTTP server against ``mlx_lm.server``.

Both servers get the same weights (``mlx_lm.server --model <materialized dir>``) and
are driven over HTTP the same way, one at a time (the other is stopped, so they never
share the CPU). Reported, ratios always ours / mlx_lm.server, each with its goal next
to it (goals are reported, never asserted):

- single-stream decode tokens/s, median of several requests after a warm-up
  (goal >= 0.95x); for reference also our ``Engine`` driven in-process (no Ray, no
  HTTP) and in-process ``mlx_lm.stream_generate``;
- aggregate tokens/s at 1, 2, 4, ... N concurrent streams (goal at N=8: >= 1.2x;
  mlx_lm.server runs with ``--decode-concurrency N``, which makes it batch);
- short requests, the fixed cost of a request where no cache can help (issue 21): every
  request has a prompt of its own (~80 tokens, distinct from its first characters), and
  (a) non-streamed requests with ``max_tokens`` 1, wall time per request measured here over
  HTTP, median and p90 (goal <= 1.1x); (b) streamed requests of 8 tokens, time to the first
  content chunk, median (goal <= 1.0x); (c) single streams with 64-token answers, tokens/s over the
  whole request (all tokens / wall time from sending it to the end of the stream), median
  (goal >= 0.95x);
- time to first token of a cold ~4K-token prompt, a unique one per request so no
  prefix cache helps (median of 3; goal <= 1.05x); ours runs its default profile, cache
  enabled (the cold prompt misses anyway);
- resident memory of each whole server: ``serve run`` and every process Ray started
  (RSS, with PSS beside it), idle after warm-up and at peak during the N-stream run,
  per process for ours; plus the "lean" start of ours (``python -m serve_app serve``: the
  same profile, Ray without its dashboard), each knob checked by the processes that
  really ran.

Neither server has ``ignore_eos`` (mlx_lm.server's ``logit_bias`` could imitate it,
ours rejects ``logit_bias``), so both get the same prompts and ``max_tokens`` and the
outputs (temperature 0) are compared request by request, with token counts.

A real model (``--model smollm2-135m``; ``serve_app.models.embedded.REAL_MODELS``) is far too slow
on a CPU for all that: it runs ``bench/serving_real.py`` instead (the rows users feel: a
non-streamed 1-token request, 64-token answers, a forced tool call; interleaved A/B rounds).

Usage: python -m bench.serving --model tiny-hybrid [--tokens 256] [--streams 8]
       [--out PATH] [--quick] [--no-lean]
       python -m bench.serving --model smollm2-135m [--rounds 4] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import (
    MemorySampler,
    ServerProcess,
    add_model_option,
    compare_outputs,
    emit,
    free_port,
    idle_cpu,
    post_chat,
    ready,
    start_mlx_lm_server,
    start_ours,
    stream_chat,
    workdir,
    write_config,
)
from serve_app.config.catalog import REAL_MODELS
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize

PROMPT = "Once upon a time, in a land far away, there lived a"
GOALS = {"single_stream": 0.95, "aggregate": 1.2, "cold_ttft": 1.05,
         # issue 21: the fixed cost of a request (short prompts, nothing cached)
         "short_request": 1.1, "short_ttft": 1.0, "short_single": 0.95}
IDLE_CPU_SECONDS = 10.0  # each server's idle CPU, per process, after warm-up
SHORT_STREAM_TOKENS = 8  # streamed short requests: enough for a first content chunk
FILLER = ("The archive keeps letters, ledgers and maps from the old harbour town; "
          "each page is numbered, dated and copied by hand before it is shelved. ")


@dataclass(frozen=True)
class Plan:
    """How much to measure: the full run, or ``--quick`` for a smoke run."""

    tokens: int
    streams: int
    repeats: int  # single-stream requests after the warm-up (median)
    rounds: int  # rounds per concurrency level (median)
    cold_tokens: int
    cold_repeats: int
    short_requests: int  # short requests of each kind (non-streamed, streamed), after warm-up
    short_answer_tokens: int  # max_tokens of the short single streams
    short_answer_repeats: int  # short single streams (median)

    @property
    def max_tokens(self) -> int:
        """Each server's ``max_tokens`` setting (ours caps requests at it): the longest
        request of the plan."""
        return max(self.tokens, self.short_answer_tokens, 16)

    @property
    def levels(self) -> list[int]:
        return [n for n in (1, 2, 4, 8) if n < self.streams] + [self.streams]


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        return Plan(tokens=args.tokens or 32, streams=args.streams, repeats=2, rounds=1,
                    cold_tokens=1024, cold_repeats=1, short_requests=4,
                    short_answer_tokens=64, short_answer_repeats=2)
    return Plan(tokens=args.tokens or 256, streams=args.streams, repeats=5, rounds=3,
                cold_tokens=4096, cold_repeats=3, short_requests=20,
                short_answer_tokens=64, short_answer_repeats=7)


def prompt_text(i: int) -> str:
    """Stream ``i``'s prompt: distinct per stream, the same for both servers."""
    return PROMPT if i == 0 else f"{PROMPT} (story {i})"


def short_prompt(kind: str, i: int) -> str:
    """Short request ``i`` of ``kind``: distinct from its first characters (after the chat
    template's few), so neither server's prefix cache has any of it; the same prompts go
    to both servers, so their outputs compare."""
    return f"Note {kind}-{i}: {PROMPT}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def p90(values: list[float]) -> float | None:
    """Nearest-rank 90th percentile (the largest value below 10 samples)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


# ---- in-process references: mlx_lm.stream_generate and our Engine (no Ray, no HTTP) ----

def chat_tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


def generate_in_process(model, tokenizer, plan: Plan) -> dict:
    """Median decode tokens/s of ``mlx_lm.stream_generate`` (greedy) and its text."""
    import mlx_lm

    prompt = chat_tokens(tokenizer, prompt_text(0))
    runs, text = [], ""
    for i in range(plan.repeats + 1):  # the first run warms up
        responses = list(mlx_lm.stream_generate(model, tokenizer, prompt,
                                                max_tokens=plan.tokens))
        text = "".join(r.text for r in responses)
        if i:
            runs.append(responses[-1].generation_tps)
    return {"tps": median(runs), "runs": runs, "text": text}


def engine_round(engine, tokenizer, n: int, tokens: int) -> tuple[float, list[dict]]:
    """``n`` requests submitted at once; aggregate tokens/s and each one's text.

    One request's tokens/s counts from its first token to its last, like the
    HTTP measure; several count from submission to the last token of any.
    """
    from serve_app.serving.sampling import SamplingParams

    done = [threading.Event() for _ in range(n)]
    events: list[list] = [[] for _ in range(n)]

    def sink(i: int):
        def put(event) -> None:
            events[i].append(event)
            if event.finish_reason or event.error:
                done[i].set()
        return put

    start = time.perf_counter()
    for i in range(n):
        engine.submit(chat_tokens(tokenizer, prompt_text(i)),
                      SamplingParams(max_tokens=tokens), sink(i))
    for d in done:
        d.wait(600)
    token_events = [[e for e in ev if e.token is not None] for ev in events]
    outputs = [{"text": tokenizer.decode([e.token for e in ev]), "tokens": len(ev)}
               for ev in token_events]
    if n == 1:
        ev = token_events[0]
        span = ev[-1].at - ev[0].at if len(ev) > 1 else 0.0
        return ((len(ev) - 1) / span if span else 0.0), outputs
    end = max(ev[-1].at for ev in token_events if ev)
    return sum(o["tokens"] for o in outputs) / (end - start), outputs


@contextlib.contextmanager
def running_engine(model, tokenizer, plan: Plan) -> Iterator:
    """Our ``Engine`` with the default profile's batching settings, ready and warmed up."""
    from serve_app.serving.engine import Engine

    defaults = ModelProfile.model_fields
    engine = Engine(model, stop_tokens=set(tokenizer.eos_token_ids),
                    max_batch_size=plan.streams,
                    max_queued_requests=defaults["max_queued_requests"].default,
                    prefill_step_size=defaults["prefill_step_size"].default, name="bench")
    try:
        engine.wait_ready(300)
        engine_round(engine, tokenizer, 1, plan.tokens)  # warm up
        yield engine
    finally:
        engine.shutdown()


def engine_in_process(model, tokenizer, plan: Plan) -> dict:
    """Our ``Engine`` driven directly: single stream and every concurrency level."""
    with running_engine(model, tokenizer, plan) as engine:
        engine_round(engine, tokenizer, plan.streams, 8)
        single = [engine_round(engine, tokenizer, 1, plan.tokens) for _ in range(plan.repeats)]
        levels = {n: [engine_round(engine, tokenizer, n, plan.tokens)[0]
                      for _ in range(plan.rounds)] for n in plan.levels}
    return {"tps": median([tps for tps, _ in single]), "runs": [tps for tps, _ in single],
            "outputs": single[0][1], "concurrency": {n: median(v) for n, v in levels.items()}}


def in_process(model_dir: Path, plan: Plan) -> dict:
    """Both in-process references, run before any server so nothing shares the CPU."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    return {"generate": generate_in_process(model, tokenizer, plan),
            "engine": engine_in_process(model, tokenizer, plan), "tokenizer": tokenizer,
            "model": model}


def engine_beside_idle_server(model, tokenizer, plan: Plan) -> dict:
    """The in-process engine's single stream while our server idles beside it.

    The control for the single-stream gap: this process has no Ray in it, so
    whatever it loses against ``engine_in_process`` is the cost of Ray's idle
    processes sharing the machine, not of our replica.
    """
    with running_engine(model, tokenizer, plan) as engine:
        runs = [engine_round(engine, tokenizer, 1, plan.tokens)[0]
                for _ in range(plan.repeats)]
    return {"tps": median(runs), "runs": runs}


# ---- over HTTP: the same requests to either server ----

def chat(base_url: str, model: str, text: str, tokens: int) -> dict:
    return stream_chat(base_url, {"model": model, "max_tokens": tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": text}]})


def decode_tps(result: dict) -> float:
    """Tokens after the first over the time from the first to the last content chunk
    (our server sends its first token at once, then coalesces per stream interval)."""
    return (result["tokens"] - 1) / result["decode_s"] if result["decode_s"] > 0 else 0.0


def single_stream(base_url: str, model: str, plan: Plan) -> dict:
    """Decode tokens/s (median), and end to end (all tokens over the whole request),
    which no chunking of the stream can skew."""
    runs = [chat(base_url, model, prompt_text(0), plan.tokens) for _ in range(plan.repeats)]
    tps = [decode_tps(r) for r in runs]
    return {"tps": median(tps), "runs": tps, "tokens": [r["tokens"] for r in runs],
            "e2e_tps": median([r["tokens"] / r["total_s"] for r in runs]),
            "timings": [{k: r[k] for k in ("tokens", "ttft", "decode_s", "total_s")}
                        for r in runs],
            "outputs": runs[:1]}


def concurrent_round(base_url: str, model: str, n: int, tokens: int) -> tuple[float, list]:
    """``n`` streams at once (stream ``i`` gets prompt ``i``); aggregate tokens/s."""
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: chat(base_url, model, prompt_text(i), tokens),
                                range(n)))
    return sum(r["tokens"] for r in results) / (time.perf_counter() - start), results


def concurrency_sweep(base_url: str, model: str, plan: Plan,
                      sampler: MemorySampler) -> dict[int, dict]:
    out = {}
    for n in plan.levels:
        sampler.phase = f"streams{n}"
        rounds = [concurrent_round(base_url, model, n, plan.tokens) for _ in range(plan.rounds)]
        out[n] = {"tps": median([tps for tps, _ in rounds]), "runs": [tps for tps, _ in rounds],
                  "outputs": rounds[0][1]}
    sampler.phase = "after"
    return out


def cold_prompt(tokenizer, target: int) -> str:
    """About ``target`` prompt tokens (chat template included) starting with a fresh
    nonce, so no prefix cache of either server has seen any of it."""
    head = f"[{uuid.uuid4().hex}] Summarize this archive record. "
    more = FILLER * (1 + 4 * target // len(FILLER))  # ~4 characters a token, or fewer
    text = head + more
    for _ in range(4):  # converge on the target through the real tokenizer
        n = len(chat_tokens(tokenizer, text))
        if abs(n - target) <= 2:
            break
        text = (text + more)[:max(len(head), int(len(text) * target / n))]
    return text


def cold_ttft(base_url: str, model: str, tokenizer, plan: Plan) -> dict:
    runs = [chat(base_url, model, cold_prompt(tokenizer, plan.cold_tokens), 4)
            for _ in range(plan.cold_repeats)]
    return {"s": median([r["ttft"] for r in runs]), "runs": [r["ttft"] for r in runs],
            "prompt_tokens": runs[0]["prompt_tokens"]}


def short_requests(base_url: str, model: str, plan: Plan) -> dict:
    """Issue 21's short requests, each with a prompt of its own: non-streamed with
    ``max_tokens`` 1 (wall time), streamed (time to the first content chunk), and single
    streams of ``short_answer_tokens`` (tokens/s over the whole request)."""
    def body(text: str, tokens: int) -> dict:
        return {"model": model, "max_tokens": tokens, "temperature": 0,
                "messages": [{"role": "user", "content": text}]}

    for i in range(2):  # the first requests of each kind, not measured
        post_chat(base_url, body(short_prompt("warm", i), 1))
        stream_chat(base_url, body(short_prompt("warm-stream", i), SHORT_STREAM_TOKENS))
    plain = [post_chat(base_url, body(short_prompt("a", i), 1))
             for i in range(plan.short_requests)]
    streamed = [stream_chat(base_url, body(short_prompt("b", i), SHORT_STREAM_TOKENS))
                for i in range(plan.short_requests)]
    answers = [stream_chat(base_url, body(short_prompt("c", i), plan.short_answer_tokens))
               for i in range(plan.short_answer_repeats)]
    walls = [r["total_s"] for r in plain]
    ttfts = [r["ttft"] for r in streamed]
    tps = [r["tokens"] / r["total_s"] for r in answers if r["total_s"] > 0]
    return {
        "nonstreamed": {"median_s": median(walls), "p90_s": p90(walls), "runs": walls,
                        "prompt_tokens": plain[0]["prompt_tokens"] if plain else None,
                        "outputs": [{k: r[k] for k in ("text", "tokens")} for r in plain]},
        "streamed_ttft": {"median_s": median(ttfts), "p90_s": p90(ttfts), "runs": ttfts,
                          # no content chunk at all: its "TTFT" is the end of the stream
                          "without_content": sum(not r["text"] for r in streamed),
                          "outputs": [{k: r[k] for k in ("text", "tokens")}
                                      for r in streamed]},
        "answers": {"tps": median(tps), "runs": tps,
                    "timings": [{k: r[k] for k in ("tokens", "ttft", "decode_s", "total_s")}
                                for r in answers],
                    "outputs": [{k: r[k] for k in ("text", "tokens")} for r in answers]},
    }


def warm_up(base_url: str, model: str, plan: Plan) -> None:
    """One full-length stream and one short round at full concurrency, not measured."""
    chat(base_url, model, "Warm up: " + PROMPT, plan.tokens)
    concurrent_round(base_url, model, plan.streams, 8)


def measure(server: ServerProcess, model: str, tokenizer, plan: Plan,
            roots: list[int]) -> dict:
    """Everything over HTTP for one running server, memory sampled throughout."""
    with MemorySampler(roots) as sampler:
        sampler.phase = "warm-up"
        warm_up(server.base_url, model, plan)
        sampler.phase = "idle"
        time.sleep(1.5)
        cpu = idle_cpu(roots, IDLE_CPU_SECONDS)
        sampler.phase = "single"
        single = single_stream(server.base_url, model, plan)
        sampler.phase = "short"
        short = short_requests(server.base_url, model, plan)
        sweep = concurrency_sweep(server.base_url, model, plan, sampler)
        sampler.phase = "cold"
        cold = cold_ttft(server.base_url, model, tokenizer, plan)
    return {"single": single, "short": short, "sweep": sweep, "cold": cold,
            "rss": {**rss_summary(sampler, f"streams{plan.streams}"), "idle_cpu": cpu}}


def rss_summary(sampler: MemorySampler, peak_phase: str) -> dict:
    idle, peak, overall = sampler.median("idle"), sampler.peak(peak_phase), sampler.peak()
    return {"idle_mib": idle and idle["rss_mib"], "peak_mib": peak and peak["rss_mib"],
            "peak_phase": peak_phase,
            "pss_idle_mib": idle and idle["pss_mib"], "pss_peak_mib": peak and peak["pss_mib"],
            "peak_any_phase_mib": overall and overall["rss_mib"],
            "processes": peak and peak["processes"],
            "processes_idle": idle and idle["processes"],
            "process_counts": peak and peak["process_counts"],
            "samples": len(sampler.samples)}


# ---- the servers, one at a time ----

def our_profile(plan: Plan) -> dict:
    return {"context_length": 8192, "max_batch_size": plan.streams, "max_queued_requests": 64}


def run_ours(model: str, ref: dict, plan: Plan, tmp: Path) -> dict:
    server = start_ours(tmp, "ours", model, cache=None,
                        max_tokens=plan.max_tokens, **our_profile(plan))
    try:
        beside = engine_beside_idle_server(ref["model"], ref["tokenizer"], plan)
        return {**measure(server, model, ref["tokenizer"], plan, [server.proc.pid]),
                "engine_beside_idle_server": beside}
    finally:
        server.stop()


def run_mlx_lm_server(model_dir: Path, tokenizer, plan: Plan, tmp: Path) -> dict:
    server = start_mlx_lm_server(tmp, "mlx_lm_server", model_dir, plan.max_tokens,
                                 "--decode-concurrency", str(plan.streams))
    try:
        return measure(server, str(model_dir), tokenizer, plan, [server.proc.pid])
    finally:
        server.stop()


LEAN_KNOBS = [
    {"knob": "no Ray dashboard",
     "how": "`python -m serve_app serve CONFIG` (Ray started with include_dashboard=False, "
            "then Serve's own `serve run CONFIG` in the same process)",
     "gives_up": "the dashboard UI and its REST API (jobs, state API `ray list ...`, "
                 "`serve status`/`serve deploy` over REST); a minimal dashboard head "
                 "(dashboard.py) still starts, and the dashboard agent (metrics export, "
                 "which our /metrics reads) stays",
     "processes": ("ray-dashboard-", "multiprocessing")},
]
# What ``ray.init`` cannot turn off (only ``ray start`` can: ``--include-log-monitor=false``
# for replica logs on the console, ``--no-monitor`` for the autoscaler monitor, ~160 MiB
# together): docs/cli.md ("The lean start") says how, and what each gives up.


def start_lean_serve(tmp: Path, model: str, plan: Plan) -> ServerProcess:
    """``python -m serve_app serve`` with the same profile as ours: the default one-machine
    start, Ray without its dashboard."""
    port = free_port()
    config = write_config(tmp / "lean.yaml", port, [{
        "name": model, "source": f"embedded:{model}", "max_tokens": plan.max_tokens,
        **our_profile(plan)}], cache_store={"ssd_dir": str(tmp / "kv-lean")})
    argv = [sys.executable, "-m", "serve_app", "serve", str(config)]
    return ready(ServerProcess(argv, port, tmp / "lean-serve.log"), [model])


def run_lean(model: str, tokenizer, plan: Plan, tmp: Path) -> dict:
    """Ours started lean (``LEAN_KNOBS``), measured as ``run_ours`` measures ``serve run``;
    ``knob_checks`` says which knobs took effect."""
    server = start_lean_serve(tmp, model, plan)
    try:
        return measure(server, model, tokenizer, plan, [server.proc.pid])
    finally:
        server.stop()


def process_names(rss: dict) -> set[str]:
    return set(rss["processes"] or {}) | set(rss["processes_idle"] or {})


def knob_checks(default_rss: dict, lean_rss: dict) -> list[dict]:
    """A knob works if its processes ran in the default start and none in the lean one."""
    default, lean = process_names(default_rss), process_names(lean_rss)
    out = []
    for knob in LEAN_KNOBS:
        was = sorted(n for n in default if any(p in n for p in knob["processes"]))
        left = sorted(n for n in lean if any(p in n for p in knob["processes"]))
        works = bool(was) and not left
        out.append({k: knob[k] for k in ("knob", "how", "gives_up")}
                   | {"default_processes": was, "lean_processes": left, "effective": works})
    return out


# ---- the report ----

def machine() -> dict:
    import mlx.core as mx
    import mlx_lm
    import ray

    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "ray": ray.__version__,
            "load_avg_at_start": os.getloadavg()}


def concurrency_rows(ours: dict, theirs: dict, engine: dict, plan: Plan) -> list[dict]:
    return [{"streams": n, "ours_tps": ours["sweep"][n]["tps"],
             "mlx_lm_server_tps": theirs["sweep"][n]["tps"],
             "ours_in_process_engine_tps": engine["concurrency"][n],
             "ratio": ratio(ours["sweep"][n]["tps"], theirs["sweep"][n]["tps"]),
             "ours_runs": ours["sweep"][n]["runs"],
             "mlx_lm_server_runs": theirs["sweep"][n]["runs"]} for n in plan.levels]


def output_checks(ours: dict, theirs: dict, ref: dict, plan: Plan) -> dict:
    """Text equality request by request (temperature 0), with token counts."""
    n = plan.streams
    labels = [f"stream {i}" for i in range(n)]
    return {
        "single_stream_vs_mlx_lm_server": compare_outputs(
            ours["single"]["outputs"], theirs["single"]["outputs"], ["single stream"]),
        "mlx_lm_server_vs_stream_generate": compare_outputs(
            theirs["single"]["outputs"], [{"text": ref["generate"]["text"]}],
            ["single stream"]),
        "engine_in_process_vs_mlx_lm_server": compare_outputs(
            ref["engine"]["outputs"], theirs["single"]["outputs"], ["single stream"]),
        f"streams{n}_vs_mlx_lm_server": compare_outputs(
            ours["sweep"][n]["outputs"], theirs["sweep"][n]["outputs"], labels),
        **{f"short_{kind}_vs_mlx_lm_server": compare_outputs(
            ours["short"][kind]["outputs"], theirs["short"][kind]["outputs"],
            [f"{kind} {i}" for i in range(len(ours["short"][kind]["outputs"]))])
           for kind in ("nonstreamed", "streamed_ttft", "answers")},
        "completion_tokens": {
            "single_stream": {"ours": ours["single"]["tokens"],
                              "mlx_lm_server": theirs["single"]["tokens"]},
            f"streams{n}": {"ours": [r["tokens"] for r in ours["sweep"][n]["outputs"]],
                            "mlx_lm_server": [r["tokens"] for r in theirs["sweep"][n]["outputs"]]},
            "short_answers": {
                "ours": [r["tokens"] for r in ours["short"]["answers"]["outputs"]],
                "mlx_lm_server": [r["tokens"] for r in theirs["short"]["answers"]["outputs"]]},
        },
    }


def short_result(ours: dict, theirs: dict, lean: dict | None, plan: Plan) -> dict:
    """Issue 21's rows: each measure ours and mlx_lm.server's, the ratio and its goal."""
    o, t = ours["short"], theirs["short"]
    walls, ttfts, answers = (
        {"ours": o[k], "mlx_lm_server": t[k]} for k in ("nonstreamed", "streamed_ttft",
                                                        "answers"))
    out = {
        "requests": plan.short_requests,
        "prompt_tokens": {"ours": o["nonstreamed"]["prompt_tokens"],
                          "mlx_lm_server": t["nonstreamed"]["prompt_tokens"]},
        "nonstreamed": {
            "max_tokens": 1,
            "ours_median_s": o["nonstreamed"]["median_s"],
            "mlx_lm_server_median_s": t["nonstreamed"]["median_s"],
            "ours_p90_s": o["nonstreamed"]["p90_s"],
            "mlx_lm_server_p90_s": t["nonstreamed"]["p90_s"],
            "ratio": ratio(o["nonstreamed"]["median_s"], t["nonstreamed"]["median_s"]),
            "p90_ratio": ratio(o["nonstreamed"]["p90_s"], t["nonstreamed"]["p90_s"]),
            "goal": GOALS["short_request"],
            "runs": {k: v["runs"] for k, v in walls.items()}},
        "streamed_ttft": {
            "max_tokens": SHORT_STREAM_TOKENS,
            "ours_median_s": o["streamed_ttft"]["median_s"],
            "mlx_lm_server_median_s": t["streamed_ttft"]["median_s"],
            "ours_p90_s": o["streamed_ttft"]["p90_s"],
            "mlx_lm_server_p90_s": t["streamed_ttft"]["p90_s"],
            "ratio": ratio(o["streamed_ttft"]["median_s"], t["streamed_ttft"]["median_s"]),
            "goal": GOALS["short_ttft"],
            "without_content": {k: v["without_content"] for k, v in ttfts.items()},
            "runs": {k: v["runs"] for k, v in ttfts.items()}},
        "single_stream": {
            "max_tokens": plan.short_answer_tokens,
            "ours_tps": o["answers"]["tps"], "mlx_lm_server_tps": t["answers"]["tps"],
            "ratio": ratio(o["answers"]["tps"], t["answers"]["tps"]),
            "goal": GOALS["short_single"],
            "runs": {k: v["runs"] for k, v in answers.items()},
            "timings": {k: v["timings"] for k, v in answers.items()}},
    }
    if lean:
        out["lean"] = {"nonstreamed_median_s": lean["short"]["nonstreamed"]["median_s"],
                       "streamed_ttft_median_s": lean["short"]["streamed_ttft"]["median_s"],
                       "single_stream_tps": lean["short"]["answers"]["tps"]}
    return out


def build_result(model: str, host: dict, plan: Plan, ref: dict, ours: dict, theirs: dict,
                 lean: dict | None) -> dict:
    rows = concurrency_rows(ours, theirs, ref["engine"], plan)
    top = rows[-1]
    rss = {"ours": ours["rss"], "mlx_lm_server": theirs["rss"],
           "note": "RSS counts shared pages (libraries, Ray's shared-memory object store) "
                   "in every process that maps them; pss_* splits them among processes"}
    if lean:
        rss["lean"] = {**lean["rss"], "knobs": knob_checks(ours["rss"], lean["rss"]),
                       "command": "python -m serve_app serve CONFIG",
                       "only_in_lean": sorted(process_names(lean["rss"])
                                              - process_names(ours["rss"])),
                       "ours_tps_streams": lean["sweep"][plan.streams]["tps"],
                       "single_stream_tps": lean["single"]["tps"],
                       "cold_ttft_s": lean["cold"]["s"]}
    return {
        "model": model,
        "machine": host,
        "settings": {**asdict(plan), "levels": plan.levels,
                     "ours_profile": {**our_profile(plan), "cache": "default (enabled)"},
                     "mlx_lm_server_args": ["--decode-concurrency", str(plan.streams)]},
        "single_stream": {
            "ours_http_tps": ours["single"]["tps"],
            "mlx_lm_server_http_tps": theirs["single"]["tps"],
            "ours_in_process_engine_tps": ref["engine"]["tps"],
            # the same engine, no Ray in its process, while our server idles beside it
            "ours_in_process_engine_beside_idle_server_tps":
                ours["engine_beside_idle_server"]["tps"],
            "mlx_lm_generate_tps": ref["generate"]["tps"],
            "ratio": ratio(ours["single"]["tps"], theirs["single"]["tps"]),
            "goal": GOALS["single_stream"],
            "ours_http_e2e_tps": ours["single"]["e2e_tps"],
            "mlx_lm_server_http_e2e_tps": theirs["single"]["e2e_tps"],
            "e2e_ratio": ratio(ours["single"]["e2e_tps"], theirs["single"]["e2e_tps"]),
            "timings": {"ours": ours["single"]["timings"],
                        "mlx_lm_server": theirs["single"]["timings"]},
            "runs": {"ours": ours["single"]["runs"], "mlx_lm_server": theirs["single"]["runs"],
                     "engine": ref["engine"]["runs"], "generate": ref["generate"]["runs"]}},
        "concurrency": rows,
        "aggregate": {"streams": plan.streams, "ours_tps": top["ours_tps"],
                      "mlx_lm_server_tps": top["mlx_lm_server_tps"], "ratio": top["ratio"],
                      "goal": GOALS["aggregate"]},
        "cold_ttft": {
            "prompt_tokens": ours["cold"]["prompt_tokens"],
            "mlx_lm_server_prompt_tokens": theirs["cold"]["prompt_tokens"],
            "ours_s": ours["cold"]["s"], "mlx_lm_server_s": theirs["cold"]["s"],
            "ratio": ratio(ours["cold"]["s"], theirs["cold"]["s"]),
            "goal": GOALS["cold_ttft"],
            "ours_cache": "enabled (default profile); the unique prompt misses",
            "ours_lean_s": lean["cold"]["s"] if lean else None,
            "runs": {"ours": ours["cold"]["runs"], "mlx_lm_server": theirs["cold"]["runs"]}},
        "short_requests": short_result(ours, theirs, lean, plan),
        "rss": rss,
        "outputs": output_checks(ours, theirs, ref, plan),
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(result: dict) -> str:
    s, a, c = result["single_stream"], result["aggregate"], result["cold_ttft"]
    r, o = result["rss"], result["outputs"]
    n = a["streams"]
    agg = o[f"streams{n}_vs_mlx_lm_server"]
    lines = [
        f"single stream: ours {fmt(s['ours_http_tps'], '.0f')} / mlx_lm.server "
        f"{fmt(s['mlx_lm_server_http_tps'], '.0f')} tok/s = {fmt(s['ratio'])}x "
        f"(goal >= {s['goal']}; end to end {fmt(s['e2e_ratio'])}x); engine in-process "
        f"{fmt(s['ours_in_process_engine_tps'], '.0f')} (beside our idle server "
        f"{fmt(s['ours_in_process_engine_beside_idle_server_tps'], '.0f')}), "
        f"stream_generate {fmt(s['mlx_lm_generate_tps'], '.0f')}",
        *(f"{row['streams']} streams: ours {fmt(row['ours_tps'], '.0f')} / mlx_lm.server "
          f"{fmt(row['mlx_lm_server_tps'], '.0f')} tok/s = {fmt(row['ratio'])}x"
          for row in result["concurrency"]),
        f"aggregate goal at {n} streams: >= {a['goal']}x (got {fmt(a['ratio'])}x)",
        *short_lines(result["short_requests"]),
        f"cold TTFT ({c['prompt_tokens']} tokens): ours {fmt(c['ours_s'], '.3f')} s / "
        f"mlx_lm.server {fmt(c['mlx_lm_server_s'], '.3f')} s = {fmt(c['ratio'])}x "
        f"(goal <= {c['goal']})",
        f"RSS idle/peak MiB: ours {fmt(r['ours']['idle_mib'], '.0f')}/"
        f"{fmt(r['ours']['peak_mib'], '.0f')}, mlx_lm.server "
        f"{fmt(r['mlx_lm_server']['idle_mib'], '.0f')}/{fmt(r['mlx_lm_server']['peak_mib'], '.0f')}"
        + (f", lean {fmt(r['lean']['idle_mib'], '.0f')}/{fmt(r['lean']['peak_mib'], '.0f')}"
           if "lean" in r else ""),
        f"identical outputs: single {o['single_stream_vs_mlx_lm_server']['all_identical']}, "
        f"{n} streams {agg['identical']}/{agg['requests']}, short requests "
        + ", ".join(f"{kind} {o[f'short_{kind}_vs_mlx_lm_server']['identical']}/"
                    f"{o[f'short_{kind}_vs_mlx_lm_server']['requests']}"
                    for kind in ("nonstreamed", "streamed_ttft", "answers")),
    ]
    return "\n".join(lines)


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def short_lines(sr: dict) -> list[str]:
    p, t, a = sr["nonstreamed"], sr["streamed_ttft"], sr["single_stream"]
    return [
        f"short requests ({sr['prompt_tokens']['ours']} prompt tokens, {sr['requests']} each): "
        f"non-streamed max_tokens 1, median ours {ms(p['ours_median_s'])} / mlx_lm.server "
        f"{ms(p['mlx_lm_server_median_s'])} = {fmt(p['ratio'])}x (goal <= {p['goal']}); "
        f"p90 {ms(p['ours_p90_s'])} / {ms(p['mlx_lm_server_p90_s'])}",
        f"short requests, streamed: first content chunk, median ours {ms(t['ours_median_s'])} "
        f"/ mlx_lm.server {ms(t['mlx_lm_server_median_s'])} = {fmt(t['ratio'])}x "
        f"(goal <= {t['goal']})",
        f"short single stream, {a['max_tokens']}-token answers (tok/s over the whole request): "
        f"ours {fmt(a['ours_tps'], '.0f')} / mlx_lm.server {fmt(a['mlx_lm_server_tps'], '.0f')}"
        f" = {fmt(a['ratio'])}x (goal >= {a['goal']})",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser, "tiny-hybrid")
    parser.add_argument("--tokens", type=int, default=None,
                        help="max_tokens per request (default 256; 32 with --quick)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: fewer repeats and tokens, a 1K cold prompt")
    parser.add_argument("--no-lean", action="store_true", help="skip the lean start of ours")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=None,
                        help="a real model's interleaved rounds (default 4; 1 with --quick)")
    parser.add_argument("--no-template-arm", action="store_true",
                        help="a real model: no second mlx_lm.server with our chat template "
                             "for the tool row")
    args = parser.parse_args()
    host = machine()  # the load average before this bench adds to it
    if args.model in REAL_MODELS:
        from bench import serving_real

        return serving_real.main(args.model, host, args.quick, args.rounds, args.out,
                                 template_arm=not args.no_template_arm)
    plan = make_plan(args)

    model_dir = materialize(args.model)
    ref = in_process(model_dir, plan)
    tokenizer = ref["tokenizer"]
    with workdir() as tmp:
        ours = run_ours(args.model, ref, plan, tmp)
        theirs = run_mlx_lm_server(model_dir, tokenizer, plan, tmp)
        lean = None if args.no_lean else run_lean(args.model, tokenizer, plan, tmp)
    result = build_result(args.model, host, plan, ref, ours, theirs, lean)
    emit(result, args.out)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
