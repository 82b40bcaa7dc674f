"""The model pool: what an unload frees, what a load costs.

Three embedded models behind ``memory.max_loaded_models: 2``, one pinned (as in
``tests/integration/test_model_pool.py``): the two unpinned ones take turns in the second slot, each
turn unloading the other. For each unload, the unloaded replica's resident memory before
and after (``/v1/stats``' ``replica.memory.process_rss_bytes``, read right after two
requests and right after the unload) against its weights; for each load, the pool's own
load time (load and warm-up) and what the request that needed it waited.

    python -m bench.pool --cycles 6 --out bench/results/<dir>/pool.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.common import ServerProcess, emit, free_port, workdir, write_config

MIB = 1 << 20
PINNED, FP32, Q4 = "pool-pinned", "pool-hybrid-fp32", "pool-hybrid-q4"
MODELS = [
    {"name": PINNED, "source": "embedded:tiny-dense", "pinned": True, "context_length": 1024},
    {"name": FP32, "source": "embedded:tiny-hybrid", "context_length": 1024},
    {"name": Q4, "source": "embedded:tiny-hybrid-q4", "context_length": 1024},
]


def ask(url: str, model: str) -> float:
    """One short chat request; its wall time."""
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": f"Hello {model}."}]}
    tic = time.perf_counter()
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    return time.perf_counter() - tic


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=60).json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    freed: dict[str, list[float]] = {FP32: [], Q4: []}
    waits: dict[str, list[float]] = {FP32: [], Q4: []}
    loads: dict[str, list[float]] = {FP32: [], Q4: []}
    weights: dict[str, float] = {}
    with workdir() as tmp:
        port = free_port()
        config = write_config(tmp / "pool.yaml", port, MODELS,
                              cache_store={"ssd_dir": str(tmp / "kv")},
                              memory={"max_loaded_models": 2})
        server = ServerProcess.serve_run(config, port, tmp / "pool.log")
        try:
            server.wait_ready([m["name"] for m in MODELS], generate=False)
            url = server.base_url
            for _ in range(args.cycles):
                for model, other in ((Q4, FP32), (FP32, Q4)):
                    ask(url, model)  # loads it when it is not (the other makes room)
                    ask(url, model)
                    before = stats(url)["models"][model]["replica"]
                    waited = ask(url, other)  # unloads ``model`` to load ``other``
                    after = stats(url)
                    replica = after["models"][model]["replica"]
                    assert replica["status"] == "unloaded", replica
                    freed[model].append((before["memory"]["process_rss_bytes"]
                                         - replica["memory"]["process_rss_bytes"]) / MIB)
                    weights[model] = before["memory"]["planned"]["weights_bytes"] / MIB
                    waits[other].append(waited)
                    loads[other].append(after["pool"]["models"][other]["last_load_seconds"])
        finally:
            server.stop()
    result = {"bench": "pool", "cycles": args.cycles, "weights_mib": weights,
              "rss_freed_mib": freed, "load_seconds": loads,
              "request_that_loaded_s": waits,
              "summary": {m: {"weights_mib": round(weights[m], 2),
                              "rss_freed_mib_min": round(min(v), 2),
                              "rss_freed_mib_median": round(statistics.median(v), 2),
                              "load_s_median": round(statistics.median(loads[m]), 3),
                              "request_that_loaded_s_median":
                                  round(statistics.median(waits[m]), 3)}
                          for m, v in freed.items()}}
    emit(result, args.out)
    for model, line in result["summary"].items():
        print(model, line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
