"""Serving throughput, side by side in one run on the same embedded model.

(a) single-stream decode tokens/s through our HTTP API vs in-process
    ``mlx_lm.stream_generate`` (goal >= 0.9x);
(b) aggregate tokens/s of N concurrent streams vs ``mlx_lm.server
    --decode-concurrency N`` (goal >= 1.0x).

Each server runs alone (the other is stopped) so they do not share the CPU.
Usage: python -m bench.serving --model tiny-dense [--tokens 256] [--streams 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import emit, stream_chat
from serve_app.devserver import ServerProcess, free_port, write_config
from serve_app.embedded import materialize

PROMPT = "Once upon a time, in a land far away, there lived a"


def in_process_decode_tps(model_dir: Path, tokens: int, repeats: int) -> float:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True)
    best = 0.0
    for _ in range(repeats + 1):  # the first run warms up
        responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=tokens))
        best = max(best, responses[-1].generation_tps)
    return best


def stream_once(base_url: str, model: str, tokens: int) -> dict:
    """One streaming chat request: token count, time to first token, decode time."""
    return stream_chat(base_url, {"model": model, "max_tokens": tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": PROMPT}]})


def http_decode_tps(base_url: str, model: str, tokens: int, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats + 1):
        r = stream_once(base_url, model, tokens)
        if r["decode_s"] > 0:
            best = max(best, (r["tokens"] - 1) / r["decode_s"])
    return best


def aggregate_tps(base_url: str, model: str, tokens: int, streams: int) -> float:
    stream_once(base_url, model, 8)  # warm up
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: stream_once(base_url, model, tokens), range(streams)))
    wall = time.perf_counter() - start
    return sum(r["tokens"] for r in results) / wall


def run_ours(name: str, tokens: int, streams: int, repeats: int, tmp: Path) -> dict:
    port = free_port()
    config = write_config(tmp / "serve.yaml", port, [{
        "name": name, "source": f"embedded:{name}", "context_length": 8192,
        "max_batch_size": streams, "max_queued_requests": 64, "max_tokens": tokens,
    }], cache_store={"ssd_dir": str(tmp / "kv")})
    server = ServerProcess.serve_run(config, port, tmp / "serve.log")
    try:
        server.wait_ready([name])
        single = http_decode_tps(server.base_url, name, tokens, repeats)
        agg = aggregate_tps(server.base_url, name, tokens, streams)
    finally:
        server.stop()
    return {"single_stream_tps": single, "aggregate_tps": agg}


def run_mlx_lm_server(model_dir: Path, tokens: int, streams: int, tmp: Path) -> float:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port",
            str(port), "--decode-concurrency", str(streams), "--max-tokens", str(tokens)]
    server = ServerProcess(argv, port, tmp / "mlx_lm_server.log")
    try:
        server.wait_ready([str(model_dir)])
        return aggregate_tps(server.base_url, str(model_dir), tokens, streams)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-dense", choices=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model_dir = materialize(args.model)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        baseline_single = in_process_decode_tps(model_dir, args.tokens, args.repeats)
        ours = run_ours(args.model, args.tokens, args.streams, args.repeats, tmp)
        baseline_agg = run_mlx_lm_server(model_dir, args.tokens, args.streams, tmp)

    result = {
        "model": args.model,
        "tokens": args.tokens,
        "streams": args.streams,
        "single_stream": {"ours_http_tps": ours["single_stream_tps"],
                          "mlx_lm_generate_tps": baseline_single,
                          "ratio": ours["single_stream_tps"] / baseline_single,
                          "goal": 0.9},
        "aggregate": {"ours_tps": ours["aggregate_tps"], "mlx_lm_server_tps": baseline_agg,
                      "ratio": ours["aggregate_tps"] / baseline_agg, "goal": 1.0},
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
