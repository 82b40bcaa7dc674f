"""Multi-turn replay: time to first token with the hot prefix cache, side by side.

A 6-turn conversation (~1,500-token system prompt, ~300-token user turns,
24 generated tokens per turn, temperature 0) is replayed against our server
with caching, our server with caching disabled (the cold reference), and
``mlx_lm.server``, each alone on the machine. Reports the sum of TTFT over
turns 2-6 (goal: ours <= 0.8x mlx_lm.server), whether every turn's output is
identical between our warm and cold runs, and hot-restore throughput next to
a plain memory copy of the same number of bytes.

Usage: python -m bench.multiturn [--model tiny-hybrid] [--block-size N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import emit, stream_chat
from serve_app.devserver import ServerProcess, free_port, write_config
from serve_app.embedded import materialize

WORDS = ("cache block prefix token model layer state replay agent code review test "
         "serve batch decode restore").split()


def text_of(n_chars: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    out, size = [], 0
    while size < n_chars:
        w = WORDS[int(rng.integers(len(WORDS)))]
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def conversation(turns: int, system_chars: int, user_chars: int) -> tuple[str, list[str]]:
    return text_of(system_chars, 0), [text_of(user_chars, i + 1) for i in range(turns)]


def replay(base_url: str, model: str, system: str, users: list[str], gen: int) -> list[dict]:
    """Each user turn in order, with the server's own answers as history."""
    messages = [{"role": "system", "content": system}]
    results = []
    for user in users:
        messages.append({"role": "user", "content": user})
        r = stream_chat(base_url, {"model": model, "messages": messages, "max_tokens": gen,
                                   "temperature": 0})
        results.append(r)
        messages.append({"role": "assistant", "content": r["text"]})
    return results


def run_ours(name, cache: dict, system, users, gen, tmp: Path) -> tuple[list[dict], dict]:
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, [{
        "name": name, "source": f"embedded:{name}", "context_length": 16384,
        "max_tokens": gen, "cache": cache}], cache_store={"ssd_dir": str(tmp / "kv")})
    server = ServerProcess.serve_run(config, port, tmp / "serve.log")
    try:
        server.wait_ready([name])
        results = replay(server.base_url, name, system, users, gen)
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()["models"][name]
    finally:
        server.stop()
    return results, stats


def run_mlx_lm_server(model_dir: Path, system, users, gen, tmp: Path) -> list[dict]:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port",
            str(port), "--max-tokens", str(gen)]
    server = ServerProcess(argv, port, tmp / "mlx_lm_server.log")
    try:
        server.wait_ready([str(model_dir)])
        return replay(server.base_url, str(model_dir), system, users, gen)
    finally:
        server.stop()


def memcpy_bytes_per_second(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(max(nbytes, 1) // 4 + 1, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - tic)
    return src.nbytes / best


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-hybrid", choices=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=300)
    parser.add_argument("--gen", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    # The embedded tokenizer is byte-level: one ASCII character is one token.
    system, users = conversation(args.turns, args.system_tokens, args.user_tokens)
    model_dir = materialize(args.model)
    warm_cache = {"enabled": True}
    if args.block_size:
        warm_cache["block_size"] = args.block_size
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        warm, stats = run_ours(args.model, warm_cache, system, users, args.gen, tmp)
        cold, _ = run_ours(args.model, {"enabled": False}, system, users, args.gen, tmp)
        baseline = run_mlx_lm_server(model_dir, system, users, args.gen, tmp)

    def later_ttft(rs):
        return sum(r["ttft"] for r in rs[1:])

    engine, cache = stats["engine"], stats["cache"]
    restore_s = engine["restore_seconds"] + cache["fetch_seconds"]
    restore_bps = engine["restored_bytes"] / restore_s if restore_s else 0.0
    result = {
        "model": args.model,
        "block_size": cache["block_size"],
        "turns": [{"turn": i + 1, "prompt_tokens": w["prompt_tokens"],
                   "cached_tokens": w["cached_tokens"], "ttft_ours": w["ttft"],
                   "ttft_ours_cold": c["ttft"], "ttft_mlx_lm_server": b["ttft"],
                   "identical_warm_cold": w["text"] == c["text"]}
                  for i, (w, c, b) in enumerate(zip(warm, cold, baseline, strict=True))],
        "ttft_sum_turns_2_on": {"ours": later_ttft(warm), "ours_cold": later_ttft(cold),
                                "mlx_lm_server": later_ttft(baseline)},
        "ratio_vs_mlx_lm_server": later_ttft(warm) / later_ttft(baseline),
        "ratio_vs_ours_cold": later_ttft(warm) / later_ttft(cold),
        "goal_vs_mlx_lm_server": 0.8,
        "all_turns_identical_warm_cold": all(w["text"] == c["text"]
                                             for w, c in zip(warm, cold, strict=True)),
        "hot_restore": {"bytes": engine["restored_bytes"],
                        "copy_seconds": engine["restore_seconds"],
                        "lookup_and_fetch_seconds": cache["fetch_seconds"],
                        "copy_bytes_per_second": engine["restored_bytes"] /
                        max(engine["restore_seconds"], 1e-9),
                        "end_to_end_bytes_per_second": restore_bps,
                        "memcpy_bytes_per_second": memcpy_bytes_per_second(
                            engine["restored_bytes"] // max(1, args.turns - 1))},
        "capture": {"blocks": engine["captured_blocks"], "bytes": engine["captured_bytes"],
                    "seconds": engine["capture_seconds"],
                    "share_of_engine_time": engine["capture_seconds"] /
                    max(engine["step_seconds"], 1e-9)},
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
