"""Checkpoint cost of a hybrid model against ``cache.checkpoint_interval`` (in-process).

A cold prefill of one long prompt per interval, several rounds interleaved:
time to first token, recurrent checkpoints captured, and checkpoint bytes per
1K captured tokens. No server: this measures the engine and the cache policy.

    python -m bench.checkpoints --model tiny-hybrid --tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import mlx_lm

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.events import Delta, Finish
from serve_app.serving.request import CompletionRequest
from serve_app.serving.service import ModelService


async def _ttft(service: ModelService, prompt: list[int]) -> float:
    prepared = service.prepare(CompletionRequest(model="m", prompt=prompt, max_tokens=1,
                                                 temperature=0))
    tic = time.perf_counter()
    async for events in service.stream(prepared):
        if any(isinstance(e, (Delta, Finish)) for e in events):
            break
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-hybrid")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--intervals", default="256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    path = materialize(args.model, Path(tempfile.gettempdir()) / "bench-checkpoints")
    model, tokenizer = mlx_lm.load(str(path))
    rows: dict[int, dict] = {}
    for round_ in range(args.rounds):
        for interval in (int(x) for x in args.intervals.split(",")):
            profile = ModelProfile(name="bench", source=f"embedded:{args.model}",
                                   context_length=args.tokens * 2,
                                   cache={"checkpoint_interval": interval})
            service = ModelService(profile, model, tokenizer, path,
                                   LocalCacheClient(TieredStore(1 << 34)))
            prompt = [5 + (i * (31 + round_)) % 240 for i in range(args.tokens + 7)]
            ttft = asyncio.run(_ttft(service, prompt))
            stats = asyncio.run(service.stats())
            row = rows.setdefault(interval, {"ttft_seconds": []})
            row["ttft_seconds"].append(ttft)
            row["checkpoints"] = stats["engine"]["captured_checkpoints"]
            row["checkpoint_bytes_per_1k_tokens"] = stats["cache"][
                "checkpoint_bytes_per_1k_tokens"]
            service.shutdown()
    result = {"model": args.model, "prompt_tokens": args.tokens + 7, "intervals": rows}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(f"{'interval':>8} {'checkpoints':>11} {'bytes/1K':>10} {'cold TTFT (s), each round'}")
    for interval, row in rows.items():
        ttfts = " ".join(f"{t:.3f}" for t in row["ttft_seconds"])
        print(f"{interval:>8} {row['checkpoints']:>11} "
              f"{row['checkpoint_bytes_per_1k_tokens']:>10} {ttfts}")


if __name__ == "__main__":
    main()
