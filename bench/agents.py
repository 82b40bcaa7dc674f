"""Agent sessions sharing one system prompt, side by side with ``mlx_lm.server``.

``--sessions`` agent sessions (default 12) share one system prompt (default
1,500 tokens: an agent's tool preamble, scaled down so the run takes minutes on
a 2-core CPU) and run ``--turns`` turns each (default 3; ``--user-tokens`` new
user tokens and ``--gen`` generated tokens a turn, temperature 0). Turns are
interleaved across sessions (turn 1 of every session, then turn 2, ...), so 12
conversations are live at once: more than ``mlx_lm.server``'s prompt cache
holds (``--prompt-cache-size``, 10 entries by default, passed explicitly: each
request leaves one entry, its prompt + answer, beside one for the system
prompt, which its LRU evicts last). Then one session's
earlier user message is edited in the middle of its history (the answers after
it are kept) and a new user turn is asked, and the conversation continues one
more turn after that.

Per request, on both servers (each alone on the machine, same weights): TTFT
(streamed, first content token), prompt tokens, cached tokens
(``usage.prompt_tokens_details.cached_tokens``; mlx_lm.server 0.32 reports it
too) and prompt tokens recomputed = prompt - cached. A request's *new tokens*
are the tokens of its prompt past the longest common prefix with any earlier
request's prompt + answer of the same session, or with the shared system
prompt once any earlier request carried it. The answer counts only as far as
its text re-tokenizes to what was generated: the random embedded models emit
bytes that are not valid UTF-8, which come back as U+FFFD, so an answer counts
up to its first U+FFFD. The check: recomputed <= new + one block (our
profile's block size). Reports the total TTFT ratio ours / mlx_lm.server
(goal <= 0.6x), whether every request's output is identical, and (hybrid
models) recurrent-checkpoint bytes per 1K cached tokens from our /v1/stats.
During our run, /v1/stats is also sampled every ``--sample-interval`` s (0.5) for
``cache_bytes_timeline``: bytes in the hot tier, on SSD and in write staging over time.

Usage: python -m bench.agents --model tiny-hybrid   (writes bench/results/agents-<model>.json)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    MLX_LM_PROMPT_CACHE_SIZE,
    ServerProcess,
    add_cache_options,
    add_model_option,
    cache_profile,
    checkpoint_line,
    checkpoint_memory,
    compare_outputs,
    emit,
    model_stats,
    start_mlx_lm_server,
    start_ours,
    stream_chat,
    wait_written,
    workdir,
)
from bench.multiturn import text_of
from serve_app.models.embedded import materialize

GOAL_TTFT_RATIO = 0.6


@dataclass
class Request:
    """One request of the script: which session, what kind, what user message."""

    label: str
    session: int
    kind: str  # "first turn", "later turn", "edit" or "after edit"
    user: str
    edit: tuple[int, str] | None = None  # (index of the user message, its new text)


@dataclass
class Session:
    messages: list[dict]
    known: list[list[int]] = field(default_factory=list)  # earlier prompts + answers


def script(args: argparse.Namespace) -> tuple[str, list[Request]]:
    """The system prompt and every request, in the order they are sent."""
    system = text_of(args.system_tokens, 0)
    requests = [Request(f"s{s}t{t + 1}", s, "later turn" if t else "first turn",
                        text_of(args.user_tokens, 1000 + 100 * s + t))
                for t in range(args.turns) for s in range(args.sessions)]
    s, edited = args.edit_session, args.edit_turn - 1
    requests.append(Request(f"s{s}edit", s, "edit", text_of(args.user_tokens, 90001),
                            edit=(edited, text_of(args.user_tokens, 90000))))
    requests.append(Request(f"s{s}edit+1", s, "after edit", text_of(args.user_tokens, 90002)))
    return system, requests


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def run(base_url: str, model: str, tokenizer, system: str, requests: list[Request],
        gen: int) -> list[dict]:
    """Send the script with this server's own answers as history; measure each request."""
    system_ids = list(tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                                    add_generation_prompt=False, tokenize=True))
    sessions: dict[int, Session] = {}
    out = []
    for req in requests:
        sess = sessions.setdefault(req.session,
                                   Session([{"role": "system", "content": system}]))
        if req.edit is not None:
            index, text = req.edit
            users = [m for m in sess.messages if m["role"] == "user"]
            users[index]["content"] = text  # the same dict as in sess.messages
        sess.messages.append({"role": "user", "content": req.user})
        prompt = list(tokenizer.apply_chat_template(sess.messages, add_generation_prompt=True,
                                                    tokenize=True))
        known = sess.known + ([system_ids] if out else [])
        new = len(prompt) - max((common_prefix(prompt, k) for k in known), default=0)
        r = stream_chat(base_url, {"model": model, "messages": sess.messages,
                                   "max_tokens": gen, "temperature": 0})
        answer = r["text"]
        sess.messages.append({"role": "assistant", "content": answer})
        kept = answer.split("\ufffd", 1)[0]  # what re-tokenizes to the generated tokens
        sess.known.append(prompt + list(tokenizer.encode(kept, add_special_tokens=False)))
        cached = r["cached_tokens"]
        out.append({"request": req.label, "session": req.session, "kind": req.kind,
                    "ttft": r["ttft"], "prompt_tokens": r["prompt_tokens"],
                    "prompt_tokens_rendered_here": len(prompt),
                    "cached_tokens": cached,
                    "recomputed_tokens": (r["prompt_tokens"] - cached
                                          if cached is not None else None),
                    "new_tokens": new, "completion_tokens": r["tokens"],
                    "finish_reason": r["finish_reason"],
                    "answer_roundtrips": kept == answer, "text": answer})
    return out


def cache_bytes_sample(stats: dict, t: float) -> dict:
    """One point of the cache-bytes timeline: bytes held by each tier at ``t`` seconds."""
    store = stats.get("cache_store") or {}
    ssd = store.get("ssd") or {}
    return {"t": round(t, 3), "hot_bytes": store.get("bytes") or 0,
            "ssd_bytes": (ssd.get("block_bytes") or 0) + (ssd.get("sidecar_bytes") or 0),
            "staging_bytes": (store.get("staging") or {}).get("pending_bytes") or 0}


@contextlib.contextmanager
def cache_bytes_timeline(server: ServerProcess, model: str,
                         interval: float) -> Iterator[list[dict]]:
    """Sample our ``/v1/stats`` every ``interval`` s in a thread while the run goes on, so
    the report can plot bytes by tier over time (the end-of-run stats hide the growth).

    Yields the list the samples go to; ``interval`` <= 0 samples nothing. A failed
    sample is skipped: the timeline must never fail the bench.
    """
    samples: list[dict] = []
    stop = threading.Event()
    start = time.monotonic()

    def loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                stats = model_stats(server, model)
                samples.append(cache_bytes_sample(stats, time.monotonic() - start))
            stop.wait(interval)

    thread = threading.Thread(target=loop, name="cache-bytes-sampler", daemon=True)
    if interval > 0:
        thread.start()
    try:
        yield samples
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=60)


def check_bound(rows: list[dict], block_size: int) -> None:
    for row in rows:
        rec = row["recomputed_tokens"]
        row["recomputed_bound"] = row["new_tokens"] + block_size
        row["within_bound"] = None if rec is None else rec <= row["recomputed_bound"]


def totals(rows: list[dict]) -> dict:
    """TTFT and token sums over all requests and by kind."""
    def part(sel: list[dict]) -> dict:
        rec = [r["recomputed_tokens"] for r in sel]
        return {"requests": len(sel), "ttft_s": sum(r["ttft"] for r in sel),
                "prompt_tokens": sum(r["prompt_tokens"] for r in sel),
                "new_tokens": sum(r["new_tokens"] for r in sel),
                "recomputed_tokens": sum(rec) if None not in rec else None}
    kinds = ("first turn", "later turn", "edit", "after edit")
    return {"all": part(rows), **{k: part([r for r in rows if r["kind"] == k]) for k in kinds}}


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The workload's options (this bench's and ``bench.cluster``'s)."""
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=150)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--edit-session", type=int, default=0)
    parser.add_argument("--edit-turn", type=int, default=None,
                        help="which user message (1-based) of that session is edited "
                             "(default: the middle one)")


def check_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The edited message defaults to the middle one; both must exist."""
    args.edit_turn = args.edit_turn or (args.turns + 1) // 2
    if not 1 <= args.edit_turn <= args.turns or not 0 <= args.edit_session < args.sessions:
        parser.error("--edit-turn/--edit-session out of range")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, "tiny-hybrid")
    add_cache_options(parser)
    add_workload_options(parser)
    parser.add_argument("--prompt-cache-size", type=int, default=MLX_LM_PROMPT_CACHE_SIZE,
                        help="mlx_lm.server --prompt-cache-size (its default: 10)")
    parser.add_argument("--sample-interval", type=float, default=0.5,
                        help="seconds between samples of our /v1/stats for the cache-bytes "
                             "timeline (0: no timeline)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default bench/results/agents-<model>.json)")
    args = parser.parse_args()
    check_workload(parser, args)
    out = args.out or Path("bench/results") / f"agents-{args.model}.json"

    from mlx_lm.utils import load_tokenizer

    system, requests = script(args)
    model_dir = materialize(args.model)
    tokenizer = load_tokenizer(model_dir)
    cache = cache_profile(args)
    with workdir() as tmp:
        server = start_ours(tmp, "ours", args.model, cache=cache, max_tokens=args.gen)
        try:
            block_size = model_stats(server, args.model)["cache"]["block_size"]
            with cache_bytes_timeline(server, args.model, args.sample_interval) as timeline:
                ours = run(server.base_url, args.model, tokenizer, system, requests, args.gen)
                stats = wait_written(server, args.model)
        finally:
            server.stop()
        server = start_mlx_lm_server(tmp, "mlx_lm_server", model_dir, args.gen,
                                     "--prompt-cache-size", str(args.prompt_cache_size))
        try:
            theirs = run(server.base_url, str(model_dir), tokenizer, system, requests, args.gen)
        finally:
            server.stop()

    check_bound(ours, block_size)
    check_bound(theirs, block_size)
    outputs = compare_outputs(ours, theirs, [r.label for r in requests])
    t_ours, t_theirs = totals(ours), totals(theirs)
    ratio = t_ours["all"]["ttft_s"] / t_theirs["all"]["ttft_s"]
    result = {
        "model": args.model,
        "model_dir": str(model_dir),
        "settings": {"sessions": args.sessions, "turns": args.turns,
                     "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
                     "gen": args.gen, "edit": {"session": args.edit_session,
                                               "user_message": args.edit_turn},
                     "cache": cache, "block_size": block_size,
                     "mlx_lm_server_prompt_cache_size": args.prompt_cache_size,
                     "interleaving": "round-robin: turn t of every session, then turn t+1",
                     "cache_bytes_sample_interval_s": args.sample_interval},
        "ttft_total": {"ours": t_ours["all"]["ttft_s"],
                       "mlx_lm_server": t_theirs["all"]["ttft_s"]},
        "ratio_vs_mlx_lm_server": ratio,
        "goal_vs_mlx_lm_server": GOAL_TTFT_RATIO,
        "breakdown": {"ours": t_ours, "mlx_lm_server": t_theirs},
        "recomputed_within_new_plus_one_block": {
            "ours": sum(bool(r["within_bound"]) for r in ours),
            "mlx_lm_server": sum(bool(r["within_bound"]) for r in theirs),
            "requests": len(requests),
            "ours_over": [r["request"] for r in ours if r["within_bound"] is False]},
        "vs_mlx_lm_server_outputs": outputs,
        "checkpoint_memory": checkpoint_memory(stats),
        "cache_stats": {k: stats["cache"].get(k) for k in (
            "hit_tokens", "missed_tokens", "hit_rate", "walkbacks", "misses_by_reason",
            "hit_tokens_by_tier")},
        "cache_bytes_timeline": timeline,
        "requests": [{"ours": {k: v for k, v in a.items() if k != "text"},
                      "mlx_lm_server": {k: v for k, v in b.items() if k != "text"},
                      "identical": a["text"] == b["text"]}
                     for a, b in zip(ours, theirs, strict=True)],
    }
    emit(result, out)
    print(table(result, ours, theirs))
    return 0


def table(result: dict, ours: list[dict], theirs: list[dict]) -> str:
    s = result["settings"]
    head = (f"{'request':<9} {'prompt':>6} {'new':>5} | {'cached':>6} {'recomp':>6} "
            f"{'ok':>3} {'ttft':>6} | {'cached':>6} {'recomp':>6} {'ok':>3} {'ttft':>6} | same")
    lines = [f"agents bench: {result['model']}, {s['sessions']} sessions x {s['turns']} turns + "
             f"edit, system {s['system_tokens']} tokens, block {s['block_size']}, "
             f"mlx_lm.server --prompt-cache-size {s['mlx_lm_server_prompt_cache_size']}",
             f"{'':<22}| {'ours':^27} | {'mlx_lm.server':^27} |", head, "-" * len(head)]

    def cell(r: dict) -> str:
        ok = {True: "yes", False: "NO", None: "n/a"}[r["within_bound"]]
        return (f"{str(r['cached_tokens']):>6} {str(r['recomputed_tokens']):>6} {ok:>3} "
                f"{r['ttft']:>6.3f}")

    for a, b in zip(ours, theirs, strict=True):
        lines.append(f"{a['request']:<9} {a['prompt_tokens']:>6} {a['new_tokens']:>5} | "
                     f"{cell(a)} | {cell(b)} | {'yes' if a['text'] == b['text'] else 'NO'}")
    t, cmp = result["ttft_total"], result["vs_mlx_lm_server_outputs"]
    bound = result["recomputed_within_new_plus_one_block"]
    lines += [
        f"TTFT total: ours {t['ours']:.3f} s, mlx_lm.server {t['mlx_lm_server']:.3f} s -> "
        f"{result['ratio_vs_mlx_lm_server']:.2f}x (goal <= {GOAL_TTFT_RATIO}x)",
        f"recomputed <= new + {s['block_size']}: ours {bound['ours']}/{bound['requests']}, "
        f"mlx_lm.server {bound['mlx_lm_server']}/{bound['requests']}",
        f"identical outputs: {cmp['identical']}/{cmp['requests']}",
        checkpoint_line(result["checkpoint_memory"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
