"""Serving throughput, side by side in one run on the same embedded model.

(a) single-stream decode tokens/s through our HTTP API vs in-process
    ``mlx_lm.stream_generate`` (goal >= 0.9x);
(b) aggregate tokens/s of N concurrent streams vs ``mlx_lm.server
    --decode-concurrency N`` (goal >= 1.0x).

Each server runs alone (the other is stopped) so they do not share the CPU.
Outputs (temperature 0) are compared: our single stream with ``stream_generate``'s
text, and each of our concurrent streams with mlx_lm.server's stream of the same index.
Usage: python -m bench.serving --model tiny-dense|tiny-hybrid|tiny-hybrid-bf16|...
       [--tokens 256] [--streams 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import (
    add_model_option,
    compare_outputs,
    emit,
    start_mlx_lm_server,
    start_ours,
    stream_chat,
    workdir,
)
from serve_app.embedded import materialize

PROMPT = "Once upon a time, in a land far away, there lived a"


def in_process_decode_tps(model_dir: Path, tokens: int, repeats: int) -> tuple[float, str]:
    """Best decode tokens/s of ``mlx_lm.stream_generate`` (greedy), and its text."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True)
    best, text = 0.0, ""
    for _ in range(repeats + 1):  # the first run warms up
        responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=tokens))
        best = max(best, responses[-1].generation_tps)
        text = "".join(r.text for r in responses)
    return best, text


def stream_once(base_url: str, model: str, tokens: int) -> dict:
    """One streaming chat request: token count, time to first token, decode time."""
    return stream_chat(base_url, {"model": model, "max_tokens": tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": PROMPT}]})


def http_decode_tps(base_url: str, model: str, tokens: int, repeats: int) -> tuple[float, dict]:
    best, last = 0.0, {}
    for _ in range(repeats + 1):
        last = stream_once(base_url, model, tokens)
        if last["decode_s"] > 0:
            best = max(best, (last["tokens"] - 1) / last["decode_s"])
    return best, last


def aggregate_tps(base_url: str, model: str, tokens: int,
                  streams: int) -> tuple[float, list[dict]]:
    stream_once(base_url, model, 8)  # warm up
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: stream_once(base_url, model, tokens), range(streams)))
    wall = time.perf_counter() - start
    return sum(r["tokens"] for r in results) / wall, results


def run_ours(name: str, tokens: int, streams: int, repeats: int, tmp: Path) -> dict:
    server = start_ours(tmp, "ours", name, cache=None, max_tokens=tokens,
                        context_length=8192, max_batch_size=streams, max_queued_requests=64)
    try:
        single, single_out = http_decode_tps(server.base_url, name, tokens, repeats)
        agg, agg_out = aggregate_tps(server.base_url, name, tokens, streams)
    finally:
        server.stop()
    return {"single_stream_tps": single, "aggregate_tps": agg, "single_output": single_out,
            "aggregate_outputs": agg_out}


def run_mlx_lm_server(model_dir: Path, tokens: int, streams: int,
                      tmp: Path) -> tuple[float, list[dict]]:
    server = start_mlx_lm_server(tmp, "mlx_lm_server", model_dir, tokens,
                                 "--decode-concurrency", str(streams))
    try:
        return aggregate_tps(server.base_url, str(model_dir), tokens, streams)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    add_model_option(parser, "tiny-dense")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model_dir = materialize(args.model)
    with workdir() as tmp:
        baseline_single, baseline_text = in_process_decode_tps(model_dir, args.tokens,
                                                               args.repeats)
        ours = run_ours(args.model, args.tokens, args.streams, args.repeats, tmp)
        baseline_agg, baseline_outs = run_mlx_lm_server(model_dir, args.tokens, args.streams,
                                                        tmp)

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
        "outputs": {
            "single_stream_vs_stream_generate": compare_outputs(
                [ours["single_output"]], [{"text": baseline_text}], ["single stream"]),
            "aggregate_vs_mlx_lm_server": compare_outputs(
                ours["aggregate_outputs"], baseline_outs,
                [f"stream {i}" for i in range(args.streams)]),
        },
    }
    emit(result, args.out)
    o = result["outputs"]
    s, a = o["single_stream_vs_stream_generate"], o["aggregate_vs_mlx_lm_server"]
    print(f"single stream: {result['single_stream']['ratio']:.2f}x stream_generate "
          f"(identical: {s['all_identical']}); {args.streams} streams: "
          f"{result['aggregate']['ratio']:.2f}x mlx_lm.server "
          f"(identical: {a['identical']}/{a['requests']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
