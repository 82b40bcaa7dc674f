"""Short requests through Serve's proxy, through Ray's direct ingress, and to mlx_lm.server.

Issue 21's question: what would skipping Ray Serve's Python proxy give a short request?
Ray 2.60's ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` (set for the whole cluster before it
starts) makes the ingress replica serve HTTP itself, on a port of its own from 30000 up,
while the proxy keeps the configured port: both paths to the same server can be measured
in one run. Rounds interleave the three targets (ours direct, ours through the proxy,
``mlx_lm.server`` on the same weights), each a non-streamed request with ``max_tokens`` 1
(wall time) and a streamed one with ``max_tokens`` 8 (first SSE event, first content chunk,
end), every prompt its own (no prefix cache hit), one keep-alive client per target.

    python -m bench.direct_ingress --rounds 40 --out bench/results/<dir>/direct-ingress.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.common import (
    ServerProcess,
    add_model_option,
    emit,
    free_port,
    ready,
    start_mlx_lm_server,
    workdir,
    write_config,
)
from serve_app.models.embedded import materialize

DIRECT_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
DIRECT_FIRST_PORT = 30000  # RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT's default
KINDS = ("plain", "first_event", "first_content", "end")


def prompt(i: int, tag: str) -> str:
    """About 70 tokens of the embedded byte-level tokenizer, different for every request."""
    return f"Question {i} {tag}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(10))


def plain(client: httpx.Client, url: str, model: str, text: str) -> float:
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}
    tic = time.perf_counter()
    client.post(f"{url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    return time.perf_counter() - tic


def streamed(client: httpx.Client, url: str, model: str, text: str) -> tuple[float, ...]:
    """(first SSE event, first content chunk, end), seconds from the request."""
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": text}]}
    tic = time.perf_counter()
    event = content = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = event or now
            for choice in json.loads(line[6:]).get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    content = content or now
    end = time.perf_counter()
    return (event or end) - tic, (content or end) - tic, end - tic


def wait_for(url: str, timeout: float = 120.0) -> None:
    """The direct port answers once the controller gave the ingress its port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5).raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser, "tiny-hybrid")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_dir = materialize(args.model)
    with workdir() as tmp:
        port = free_port()
        config = write_config(tmp / "ours.yaml", port, [{
            "name": args.model, "source": f"embedded:{args.model}", "context_length": 8192,
            "max_tokens": 64}], cache_store={"ssd_dir": str(tmp / "kv")})
        ours = ready(ServerProcess.serve_run(config, port, tmp / "ours.log", env=DIRECT_ENV),
                     [args.model])
        theirs = start_mlx_lm_server(tmp, "mlx_lm_server", model_dir, 64)
        try:
            direct = f"http://127.0.0.1:{DIRECT_FIRST_PORT}"
            wait_for(direct)
            targets = {"direct": (direct, args.model), "proxy": (ours.base_url, args.model),
                       "mlx_lm_server": (theirs.base_url, str(model_dir))}
            clients = {name: httpx.Client() for name in targets}
            runs: dict[str, dict[str, list[float]]] = {
                name: {k: [] for k in KINDS} for name in targets}
            for i in range(args.rounds + 3):  # the first three rounds warm up
                for name, (url, model) in targets.items():
                    wall = plain(clients[name], url, model, prompt(i, f"a {name}"))
                    times = streamed(clients[name], url, model, prompt(i, f"b {name}"))
                    if i >= 3:
                        for kind, value in zip(KINDS, (wall, *times), strict=True):
                            runs[name][kind].append(value)
        finally:
            ours.stop()
            theirs.stop()
    medians = {name: {k: statistics.median(v) for k, v in kinds.items()}
               for name, kinds in runs.items()}
    ratios = {name: {k: medians[name][k] / medians["mlx_lm_server"][k] for k in KINDS}
              for name in ("direct", "proxy")}
    emit({"bench": "direct_ingress", "model": args.model, "rounds": args.rounds,
          "median_s": medians, "ratio_to_mlx_lm_server": ratios, "runs_s": runs}, args.out)
    for name in ("direct", "proxy"):
        print(name, {k: f"{medians[name][k] * 1000:.1f} ms ({ratios[name][k]:.2f}x)"
                     for k in KINDS}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
