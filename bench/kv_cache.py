"""Quantized K/V in serving (issue 44): what 8- and 4-bit K/V buy in bytes and cost in speed.

Three arms per model, each a ``ModelService`` in this process on the same loaded weights:
float K/V (``kv_cache.bits: null``), 8 bits and 4 bits (``--group-size``, default 64; a
smaller group where the head dimension needs it: the tiny models' heads are 32 wide).

1. **Bytes**: KV bytes per token (``service.layout.block_nbytes(1)``), and *measured*
   bytes per block: one prompt of ``--blocks`` blocks (block size ``--block-size``) runs
   through a service with a hot tier and an SSD tier (``TieredStore`` + ``SSDStore``);
   once the staged blocks are on disk, the block files' sizes (``SSDStore.block_path``)
   and the hot tier's KV payload bytes of those blocks are summed. Goals: SSD bytes per
   block <= 0.55x float at 8 bits, <= 0.3x at 4 bits.
2. **Sessions hot within one KV budget** (``--budget``, 1 GiB): concurrent 4096-token
   sessions = budget // (4096 x measured hot-tier KV bytes per token + the recurrent
   state of one sequence), and, as a check that admission counts quantized bytes, how
   many 4096-token requests (3840 prompt + 256 max_tokens) the engine's own KV admission
   (``engine.set_kv_budget``, ``engine.kv``: ``KVBudget.bytes_for`` / ``fits``) admits
   for that budget. Goals: >= 1.9x float at 8 bits, >= 3.5x at 4 bits.
3. **Decode tok/s**, in process, the same chat prompts (``Write a long story about
   <topic>.``, after ``--context`` tokens of shared text when set), temperature 0,
   ``--tokens`` per stream: one stream, and 8 concurrent streams. The prefix cache is *on*
   (hot tier only, block ``--decode-block-size``): a warm-up prefills and caches every
   prompt once per arm, so each timed request restores all but its last few tokens and
   the rounds time decode, not prefill. Requests take the whole service path
   (``service.stream``); the engine's ``submit`` is wrapped to read each token's time
   stamp (``EngineEvent.at``). Single-stream decode tok/s = (tokens - 1) / (last token -
   first token); 8-stream aggregate tok/s = sum over streams of (tokens - 1) / (latest
   last token - earliest first token). Arms are interleaved round by round (ABC, CBA,
   ...; ``--rounds``, 3 by default) and ``os.getloadavg()`` is recorded at the start of
   each round: on a shared 2-core machine the load drifts, and interleaving spreads it
   over the arms alike. Medians and ranges over rounds; the ratio is of medians (the
   per-round ratios are in the JSON). Goal: 8 bits >= 0.9x float, one stream and 8.
4. **mlx_lm.server** (separate rows, over HTTP, so not comparable with 3 as equals):
   ``mlx_lm.server`` on the same weights directory, plain (batched) and with
   ``--kv-bits 8 --kv-group-size G --quantized-kv-start 0`` (its quantized cache cannot
   batch: one request at a time; without ``--quantized-kv-start 0`` it would only
   quantize past 5000 tokens, i.e. never here), 8 concurrent streamed chat requests of the
   same messages (never ``--context``), aggregate tok/s as in 3 (from the client's chunk
   times), interleaved.

Nothing is asserted; goals are reported met or missed.

Hybrid models' recurrent checkpoints (never quantized) go to SSD sidecars: reported
beside the block files, the goal is on the block files (the K/V).

Usage: python -m bench.kv_cache [--quick] [--models a,b] [--rounds N] [--tokens N]
       [--context N] [--group-size 64] [--budget BYTES] [--server-models a,b] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm

from bench.common import start_mlx_lm_server, stream_chat
from serve_app.cache.client import LocalCacheClient
from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.ssd import SSDStore
from serve_app.cache.tiers import TieredStore
from serve_app.config.paths import default_home
from serve_app.config.profile import ModelProfile
from serve_app.kvquant.format import GROUP_SIZES, KVQuant
from serve_app.models.embedded import materialize
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.events import Failure
from serve_app.serving.request import ChatCompletionRequest, CompletionRequest
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.service import ModelService

MODELS = ["smollm2-135m-fp32", "smollm2-135m-bf16", "tiny-dense", "tiny-hybrid"]
ARMS = {"float": None, "q8": 8, "q4": 4}  # arm -> bits
GOALS = {"ssd_bytes": {"q8": 0.55, "q4": 0.3}, "sessions": {"q8": 1.9, "q4": 3.5},
         "decode": {"q8": 0.9}}
SESSION_TOKENS = 4096
SESSION_MAX_TOKENS = 256  # the 4096-token request admission is asked about: 3840 + 256
STREAMS = 8
TOPICS = ("a lighthouse keeper and a storm", "a robot who learns to paint",
          "two friends crossing a desert", "a dragon who is afraid of heights",
          "a village that forgets its name", "a clockmaker's last clock",
          "a cat who becomes mayor", "a ship lost in the ice")
DEFAULT_OUT = Path("bench/results/2026-12-05-issue44/kv-cache.json")


BACKGROUND = ("The harbor town kept its records in a long ledger, and every entry named a "
              "ship, its captain, its cargo and the weather on the day it sailed. ")


def background(tokenizer: Any, tokens: int) -> str:
    """About ``tokens`` tokens of text that every stream's prompt starts with (``--context``:
    decode over a longer K/V; the prefix cache prefills it once per arm)."""
    text = ""
    while tokens > 0 and len(tokenizer.encode(text)) < tokens:
        text += BACKGROUND
    return text


def messages(i: int, prefix: str = "") -> list[dict]:
    ask = f"Write a long story about {TOPICS[i % len(TOPICS)]}."
    return [{"role": "user", "content": f"{prefix}\n\n{ask}" if prefix else ask}]


def head_dim(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def fit_group(dim: int, want: int) -> int:
    """``want`` if a head of ``dim`` values splits into whole groups of it, else the
    largest smaller group size that does (the tiny models' 32-wide heads take 32)."""
    for g in sorted((g for g in GROUP_SIZES if g <= want), reverse=True):
        if KVQuant(8, g).fits(dim) and KVQuant(4, g).fits(dim):
            return g
    raise ValueError(f"no group size <= {want} fits a head of {dim} values")


def kv_profile(arm: str, group: int) -> dict:
    bits = ARMS[arm]
    return {} if bits is None else {"bits": bits, "group_size": group}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "all": values}


def wait_until(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def run_completion(service: ModelService, prompt: list[int], max_tokens: int) -> None:
    async def go() -> None:
        prepared = service.prepare(CompletionRequest(model="m", prompt=prompt,
                                                     max_tokens=max_tokens, temperature=0))
        async for _ in service.stream(prepared):
            pass

    asyncio.run(go())


# ---- 1 and 2: bytes, sessions, admission ------------------------------------------------

def measure_bytes(name: str, model_dir: Path, model: Any, tokenizer: Any, arm: str, group: int,
                  block: int, blocks: int, budget: int, tmp: Path) -> dict:
    """One prompt of ``blocks`` blocks through a service with hot + SSD tiers: the block
    files' bytes, the hot tier's payload bytes, sessions and KV admission for ``budget``."""
    ssd = SSDStore(tmp / f"ssd-{name}-{arm}", 1 << 30)
    store = TieredStore(1 << 30, ssd)
    profile = ModelProfile(name=f"bytes-{arm}", source=f"embedded:{name}",
                           cache={"block_size": block}, kv_cache=kv_profile(arm, group))
    service = ModelService(profile, model, tokenizer, model_dir, LocalCacheClient(store))
    try:
        layout = service.layout
        prompt = [5 + (i * 7) % 240 for i in range(blocks * block + 3)]
        start = time.perf_counter()
        run_completion(service, prompt, 1)
        prefill_s = time.perf_counter() - start
        ids = chain(salted_root(service.cache.root, None), prompt, block)
        wait_until(lambda: not store.snapshot()["staging"]["pending_bytes"]
                   and all(ssd.block_path(i).exists() for i in ids), "blocks on SSD")
        files = [ssd.block_path(i).stat().st_size for i in ids]
        sidecars = [ssd.sidecar_path(layout.digest, i) for i in ids]  # hybrids' checkpoints
        sidecar_bytes = [p.stat().st_size if p.exists() else 0 for p in sidecars]
        entries = [store.hot.entry(i) for i in ids]
        if any(e is None for e in entries):
            raise RuntimeError(f"{name} {arm}: a full block is missing from the hot tier")
        kv_payload = sum(k.nbytes + v.nbytes for e in entries if e is not None
                         for k, v in e.handle.kv.values())
        entry_bytes = sum(e.nbytes for e in entries if e is not None)
        per_token = kv_payload / (len(ids) * block)
        state = layout.state_nbytes()
        session = round(SESSION_TOKENS * per_token) + state
        service.engine.set_kv_budget(budget)
        kv = service.engine.kv
        need = kv.bytes_for(SESSION_TOKENS - SESSION_MAX_TOKENS, SESSION_MAX_TOKENS)
        admitted, in_use = 0, 0
        if kv.refusal(name, SESSION_TOKENS - SESSION_MAX_TOKENS, SESSION_MAX_TOKENS) is None:
            while admitted < 1_000_000 and kv.fits(in_use, need, admitted):
                admitted, in_use = admitted + 1, in_use + need
        return {
            "kv_format": layout.kv_format, "layout_bytes_per_token": layout.block_nbytes(1),
            "state_bytes_per_sequence": state, "block_size": block, "blocks": len(ids),
            "prefill_s": prefill_s,
            "ssd_file_bytes": files, "ssd_bytes_per_block": statistics.mean(files),
            "ssd_sidecar_bytes_per_block": statistics.mean(sidecar_bytes),
            "hot_kv_bytes_per_block": kv_payload / len(ids),
            "hot_entry_bytes_per_block": entry_bytes / len(ids),
            "hot_kv_bytes_per_token": per_token,
            "measured_matches_layout": per_token == layout.block_nbytes(1),
            "session_bytes": session, "sessions": budget // session,
            "admission": {"bytes_per_token": kv.shape.kv_bytes_per_token if kv.shape else None,
                          "request_bytes": need, "admitted": admitted},
        }
    finally:
        service.shutdown()


# ---- 3: decode tok/s, in process ------------------------------------------------------

class TokenTimes:
    """The engine's time stamp of every token (``EngineEvent.at``) and the tokens restored,
    per prompt: ``engine.submit`` wrapped, so requests take the whole service path (cache
    plan, restore, events) and are still timed where the tokens are made."""

    def __init__(self, service: ModelService) -> None:
        self.times: dict[tuple[int, ...], list[float]] = {}
        self.restored: dict[tuple[int, ...], int] = {}
        submit = service.engine.submit

        def timed(prompt: list[int], params: SamplingParams, sink, *args, **kwargs) -> int:
            key = tuple(prompt)
            stamps = self.times[key] = []

            def record(event: EngineEvent) -> None:
                if event.token is not None:
                    stamps.append(event.at)
                if event.restored is not None:
                    self.restored[key] = event.restored
                sink(event)

            return submit(prompt, params, record, *args, **kwargs)

        service.engine.submit = timed  # type: ignore[method-assign]


def decode(service: ModelService, timer: TokenTimes, prompts: list[list[int]],
           tokens: int) -> dict:
    """``prompts`` sent at once through ``service.stream`` (greedy, ``tokens`` each)."""
    async def one(prompt: list[int]) -> tuple[int, ...]:
        prepared = service.prepare(CompletionRequest(model="m", prompt=prompt,
                                                     max_tokens=tokens, temperature=0))
        async for events in service.stream(prepared):
            for e in events:
                if isinstance(e, Failure):
                    raise RuntimeError(f"request failed: {e.message}")
        return tuple(prepared.prompt)

    async def all_of() -> list[tuple[int, ...]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    start = time.perf_counter()
    keys = asyncio.run(all_of())
    times = [timer.times[k] for k in keys]
    firsts, lasts = [t[0] for t in times], [t[-1] for t in times]
    generated = [len(t) for t in times]
    per_stream = [(n - 1) / (t[-1] - t[0]) for n, t in zip(generated, times, strict=True)
                  if n > 1 and t[-1] > t[0]]
    window = max(lasts) - min(firsts)
    return {"tokens": generated, "restored": [timer.restored.get(k, 0) for k in keys],
            "ttft_s": statistics.median(f - start for f in firsts),
            "per_stream_tok_s": statistics.median(per_stream) if per_stream else 0.0,
            "aggregate_tok_s": sum(n - 1 for n in generated) / window if window else 0.0,
            "wall_s": max(lasts) - start}


def bench_decode(name: str, model_dir: Path, model: Any, tokenizer: Any, arms: dict[str, int],
                 rounds: int, tokens: int, block: int, context: int, log) -> dict:
    services = {arm: ModelService(
        ModelProfile(name=f"decode-{arm}", source=f"embedded:{name}",
                     cache={"block_size": block}, kv_cache=kv_profile(arm, arms[arm])),
        model, tokenizer, model_dir, LocalCacheClient(TieredStore(1 << 30)))
        for arm in arms}
    timers = {arm: TokenTimes(service) for arm, service in services.items()}
    try:
        first = next(iter(services.values()))
        prefix = background(tokenizer, context)
        prompts = [first.prepare(ChatCompletionRequest(
            model="m", messages=messages(i, prefix), max_tokens=tokens, temperature=0)).prompt
            for i in range(STREAMS)]
        for arm, service in services.items():  # warm-up: every prompt prefilled and cached
            decode(service, timers[arm], prompts[:1], 1)  # the shared prefix, once
            decode(service, timers[arm], prompts, 1)
            decode(service, timers[arm], prompts[:2], 2)
        runs: dict[str, dict[str, list[dict]]] = {a: {"single": [], "eight": []} for a in arms}
        loads: list[list[float]] = []
        orders: list[str] = []
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            orders.append(",".join(order))
            loads.append([round(x, 2) for x in os.getloadavg()])
            for arm in order:
                single = decode(services[arm], timers[arm], prompts[:1], tokens)
                eight = decode(services[arm], timers[arm], prompts, tokens)
                runs[arm]["single"].append(single)
                runs[arm]["eight"].append(eight)
                log(f"  {name} round {r + 1} {arm}: single {single['aggregate_tok_s']:.2f} "
                    f"tok/s, 8 streams {eight['aggregate_tok_s']:.2f} tok/s "
                    f"(load {loads[-1][0]})")
        out: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts], "load_avg": loads,
                               "orders": orders, "arms": {}}
        for arm in arms:
            single, eight = runs[arm]["single"], runs[arm]["eight"]
            out["arms"][arm] = {
                "single_tok_s": spread([s["aggregate_tok_s"] for s in single]),
                "eight_aggregate_tok_s": spread([e["aggregate_tok_s"] for e in eight]),
                "eight_per_stream_tok_s": spread([e["per_stream_tok_s"] for e in eight]),
                "single_ttft_s": spread([s["ttft_s"] for s in single]),
                "eight_ttft_s": spread([e["ttft_s"] for e in eight]),
                "tokens_short": sum(n < tokens for e in single + eight for n in e["tokens"]),
                "restored_tokens": statistics.median(n for e in single + eight
                                                     for n in e["restored"]),
            }
        for arm in arms:
            if arm == "float":
                continue
            ratios = {}
            for key in ("single", "eight"):
                mine = [x["aggregate_tok_s"] for x in runs[arm][key]]
                base = [x["aggregate_tok_s"] for x in runs["float"][key]]
                per_round = [a / b for a, b in zip(mine, base, strict=True)]
                ratios[key] = {"of_medians": statistics.median(mine) / statistics.median(base),
                               "per_round": spread(per_round)}
            out["arms"][arm]["ratio_to_float"] = ratios
        return out
    finally:
        for service in services.values():
            service.shutdown()


# ---- 4: mlx_lm.server over HTTP -------------------------------------------------------

def http_eight(base_url: str, model: str, tokens: int) -> dict:
    def one(i: int) -> dict:
        t0 = time.perf_counter()
        r = stream_chat(base_url, {"model": model, "messages": messages(i),
                                   "max_tokens": tokens, "temperature": 0})
        r["first_at"] = t0 + r["ttft"]
        r["last_at"] = r["first_at"] + r["decode_s"]
        return r

    with ThreadPoolExecutor(STREAMS) as pool:
        rs = list(pool.map(one, range(STREAMS)))
    window = max(r["last_at"] for r in rs) - min(r["first_at"] for r in rs)
    return {"tokens": [r["tokens"] for r in rs],
            "aggregate_tok_s": sum(r["tokens"] - 1 for r in rs) / window,
            "per_stream_tok_s": statistics.median((r["tokens"] - 1) / r["decode_s"]
                                                  for r in rs if r["decode_s"] > 0),
            "ttft_s": statistics.median(r["ttft"] for r in rs)}


def bench_server(name: str, model_dir: Path, group: int, rounds: int, tokens: int, tmp: Path,
                 log) -> dict:
    kv8 = ["--kv-bits", "8", "--kv-group-size", str(group), "--quantized-kv-start", "0"]
    servers = {}
    try:
        servers["plain_batched"] = start_mlx_lm_server(tmp, f"{name}-plain", model_dir, tokens)
        servers["kv8_serial"] = start_mlx_lm_server(tmp, f"{name}-kv8", model_dir, tokens, *kv8)
        for server in servers.values():  # warm-up
            stream_chat(server.base_url, {"model": str(model_dir), "messages": messages(0),
                                          "max_tokens": 4, "temperature": 0})
        runs: dict[str, list[dict]] = {k: [] for k in servers}
        loads = []
        for r in range(rounds):
            loads.append([round(x, 2) for x in os.getloadavg()])
            for key in (list(servers) if r % 2 == 0 else list(reversed(servers))):
                res = http_eight(servers[key].base_url, str(model_dir), tokens)
                runs[key].append(res)
                log(f"  mlx_lm.server {name} round {r + 1} {key}: 8 streams "
                    f"{res['aggregate_tok_s']:.2f} tok/s (load {loads[-1][0]})")
    finally:
        for server in servers.values():
            server.stop()
    out: dict[str, Any] = {"args": {"kv8_serial": kv8, "plain_batched": []},
                           "load_avg": loads, "arms": {}}
    for key, rs in runs.items():
        out["arms"][key] = {"eight_aggregate_tok_s": spread([x["aggregate_tok_s"] for x in rs]),
                            "eight_per_stream_tok_s": spread([x["per_stream_tok_s"] for x in rs]),
                            "eight_ttft_s": spread([x["ttft_s"] for x in rs]),
                            "tokens_short": sum(n < tokens for x in rs for n in x["tokens"])}
    base = out["arms"]["plain_batched"]["eight_aggregate_tok_s"]["median"]
    out["kv8_over_plain"] = out["arms"]["kv8_serial"]["eight_aggregate_tok_s"]["median"] / base
    return out


# ---- report ---------------------------------------------------------------------------

def goals(model: dict) -> dict:
    arms = model["arms"]
    fb = arms["float"]["bytes"]
    out: dict[str, Any] = {}
    for arm in ("q8", "q4"):
        b = arms[arm]["bytes"]
        out[arm] = {
            "ssd_ratio": b["ssd_bytes_per_block"] / fb["ssd_bytes_per_block"],
            "ssd_with_sidecars_ratio": (b["ssd_bytes_per_block"] + b["ssd_sidecar_bytes_per_block"])
            / (fb["ssd_bytes_per_block"] + fb["ssd_sidecar_bytes_per_block"]),
            "hot_kv_ratio": b["hot_kv_bytes_per_token"] / fb["hot_kv_bytes_per_token"],
            "sessions_ratio": b["sessions"] / fb["sessions"],
            "bytes_per_session_ratio": fb["session_bytes"] / b["session_bytes"],
            "admitted_ratio": b["admission"]["admitted"] / fb["admission"]["admitted"],
        }
        out[arm]["ssd_met"] = out[arm]["ssd_ratio"] <= GOALS["ssd_bytes"][arm]
        out[arm]["sessions_met"] = out[arm]["sessions_ratio"] >= GOALS["sessions"][arm]
        out[arm]["admitted_met"] = out[arm]["admitted_ratio"] >= GOALS["sessions"][arm]
        ratio = model.get("decode", {}).get("arms", {}).get(arm, {}).get("ratio_to_float")
        if ratio:
            for key in ("single", "eight"):
                out[arm][f"decode_{key}_ratio"] = ratio[key]["of_medians"]
                out[arm][f"decode_{key}_per_round"] = [ratio[key]["per_round"]["min"],
                                                       ratio[key]["per_round"]["max"]]
            if arm in GOALS["decode"]:
                goal = GOALS["decode"][arm]
                out[arm]["decode_met"] = (ratio["single"]["of_medians"] >= goal
                                          and ratio["eight"]["of_medians"] >= goal)
    return out


def _x(goal: dict, key: str) -> str:
    return f"{goal[key]:.3f}" if key in goal else "1"


def _cell(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def markdown(result: dict) -> str:
    config = result["config"]
    lines = [f"## Bytes and sessions (budget {config['budget']} bytes, "
             f"{SESSION_TOKENS}-token sessions, block {config['block_size']})", "",
             "| model | arm | format | KV B/token (layout) | hot KV B/token (measured) "
             "| SSD B/block | x float | + sidecar | x float | sessions | x float "
             "| admitted | x float |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in result["models"].items():
        for arm, a in m["arms"].items():
            b, g = a["bytes"], m["goals"].get(arm, {})
            lines.append(f"| {name} | {arm} | {b['kv_format']} | {b['layout_bytes_per_token']} "
                         f"| {b['hot_kv_bytes_per_token']:.0f} | {b['ssd_bytes_per_block']:.0f} "
                         f"| {_x(g, 'ssd_ratio')} | {b['ssd_sidecar_bytes_per_block']:.0f} "
                         f"| {_x(g, 'ssd_with_sidecars_ratio')} "
                         f"| {b['sessions']} | {_x(g, 'sessions_ratio')} "
                         f"| {b['admission']['admitted']} | {_x(g, 'admitted_ratio')} |")
    lines += ["", f"## Decode tok/s in process (prefix cache {config['decode_prefix_cache']}; "
              f"{config['tokens']} tokens "
              f"per stream, {config['rounds']} interleaved rounds; median [min-max])", "",
              "| model | arm | prompt tokens | 1 stream | x float | 8 streams aggregate "
              "| x float | 8 streams per stream | load avg (1 min) per round |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, m in result["models"].items():
        d = m.get("decode")
        for arm, a in (d["arms"] if d else {}).items():
            g = m["goals"].get(arm, {})
            lines.append(f"| {name} | {arm} | {statistics.median(d['prompt_tokens']):.0f} "
                         f"| {_cell(a['single_tok_s'])} "
                         f"| {_x(g, 'decode_single_ratio')} "
                         f"| {_cell(a['eight_aggregate_tok_s'])} "
                         f"| {_x(g, 'decode_eight_ratio')} "
                         f"| {_cell(a['eight_per_stream_tok_s'])} "
                         f"| {', '.join(str(x[0]) for x in d['load_avg'])} |")
    if result.get("mlx_lm_server"):
        lines += ["", "## mlx_lm.server over HTTP (separate rows: HTTP + its own scheduler; "
                  "not comparable with the in-process rows as equals)", "",
                  "| model | server | 8 streams aggregate tok/s | 8 streams per stream "
                  "| x plain | load avg (1 min) per round |", "|---|---|---:|---:|---:|---|"]
        for name, s in result["mlx_lm_server"].items():
            for key, a in s["arms"].items():
                x = f"{s['kv8_over_plain']:.3f}" if key == "kv8_serial" else "1"
                lines.append(f"| {name} | {key} {' '.join(s['args'][key])} "
                             f"| {_cell(a['eight_aggregate_tok_s'])} "
                             f"| {_cell(a['eight_per_stream_tok_s'])} | {x} "
                             f"| {', '.join(str(v[0]) for v in s['load_avg'])} |")
    lines += ["", "## Goals", ""]
    for name, m in result["models"].items():
        for arm, g in m["goals"].items():
            parts = [f"SSD {g['ssd_ratio']:.3f}x ({_met(g['ssd_met'])} "
                     f"<= {GOALS['ssd_bytes'][arm]})",
                     f"sessions {g['sessions_ratio']:.3f}x ({_met(g['sessions_met'])} "
                     f">= {GOALS['sessions'][arm]}; bytes per session "
                     f"{g['bytes_per_session_ratio']:.3f}x; admitted {g['admitted_ratio']:.3f}x)"]
            if "decode_met" in g:
                lo1, hi1 = g["decode_single_per_round"]
                lo8, hi8 = g["decode_eight_per_round"]
                parts.append(f"decode 1 stream {g['decode_single_ratio']:.3f}x (rounds "
                             f"{lo1:.3f}-{hi1:.3f}), 8 streams {g['decode_eight_ratio']:.3f}x "
                             f"(rounds {lo8:.3f}-{hi8:.3f}) ({_met(g['decode_met'])} "
                             f">= {GOALS['decode'][arm]})")
            lines.append(f"- {name} {arm}: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES)
    parser.add_argument("--budget", type=int, default=1 << 30, help="KV budget in bytes")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per stream")
    parser.add_argument("--context", type=int, default=0,
                        help="decode: about this many tokens of shared text before each prompt")
    parser.add_argument("--decode-block-size", type=int, default=16,
                        help="prefix-cache block size of the decode services")
    parser.add_argument("--decode-models", default=None,
                        help="models whose decode is timed (default: every model)")
    parser.add_argument("--server-models", default="smollm2-135m-bf16",
                        help="models also timed on mlx_lm.server ('' for none)")
    parser.add_argument("--server-rounds", type=int, default=None,
                        help="rounds for mlx_lm.server (default: --rounds)")
    parser.add_argument("--home", type=Path, default=None, help="where models materialize")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the tiny models, 1 round, 16 tokens")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.tokens = "tiny-dense,tiny-hybrid", 1, 16
        args.server_models = "tiny-dense" if args.server_models == "smollm2-135m-bf16" \
            else args.server_models
    models = [m for m in args.models.split(",") if m]
    timed = models if args.decode_models is None else \
        [m for m in args.decode_models.split(",") if m]
    served = [m for m in args.server_models.split(",") if m]
    home = args.home or default_home()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    began = time.perf_counter()
    result: dict[str, Any] = {
        "bench": "kv_cache", "issue": 44, "command": " ".join(["python -m bench.kv_cache",
                                                               *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                    "device": str(mx.default_device()), "load_avg_start": os.getloadavg()},
        "config": {"budget": args.budget, "block_size": args.block_size, "blocks": args.blocks,
                   "rounds": args.rounds, "tokens": args.tokens, "streams": STREAMS,
                   "context": args.context,
                   "group_size": args.group_size,
                   "decode_prefix_cache": f"on (hot tier, block {args.decode_block_size})",
                   "session_tokens": SESSION_TOKENS},
        "goals": GOALS, "models": {}, "mlx_lm_server": {}}
    with tempfile.TemporaryDirectory(prefix="bench-kv-cache-") as tmp_name:
        tmp = Path(tmp_name)
        for name in models:
            model_dir = materialize(name, home)
            dim = head_dim(model_dir)
            group = fit_group(dim, args.group_size)
            arms = {arm: group for arm in ARMS}
            log(f"{name}: head dim {dim}, group {group}")
            model, tokenizer = mlx_lm.load(str(model_dir))[:2]
            entry: dict[str, Any] = {"head_dim": dim, "group_size": group, "arms": {}}
            for arm in ARMS:
                b = measure_bytes(name, model_dir, model, tokenizer, arm, group,
                                  args.block_size, args.blocks, args.budget, tmp)
                entry["arms"][arm] = {"bytes": b}
                log(f"  {name} {arm}: {b['kv_format']} {b['ssd_bytes_per_block']:.0f} B/block "
                    f"on SSD, {b['sessions']} sessions, admitted {b['admission']['admitted']}")
            if name in timed:
                entry["decode"] = bench_decode(name, model_dir, model, tokenizer, arms,
                                               args.rounds, args.tokens,
                                               args.decode_block_size, args.context, log)
            entry["goals"] = goals(entry)
            result["models"][name] = entry
            del model, tokenizer
            mx.clear_cache()
        for name in served:
            model_dir = materialize(name, home)
            group = fit_group(head_dim(model_dir), args.group_size)
            result["mlx_lm_server"][name] = bench_server(
                name, model_dir, group, args.server_rounds or args.rounds, args.tokens, tmp, log)
    result["wall_s"] = time.perf_counter() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    log(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
