"""Embeddings over HTTP (issue 43): the same model served three ways, each alone on the
machine, each warmed first.

- ``batched``: our server as configured (Ray Serve's @serve.batch, up to 32 requests a model
  call), 32 concurrent clients each sending one sentence at a time: inputs a second.
- ``one_at_a_time``: the same server and model with ``pooling.max_batch_size: 1`` (every
  request its own model call), the same clients.
- ``in_process``: the model called directly at batch 32 (``PoolingModel.embed``, no HTTP).

Every vector the batched server returned is checked against the in-process one (cosine).
Goals (issue 43): batched >= 3x one-at-a-time, and >= 0.8x in process at batch 32.

Usage: python -m bench.embeddings [--model all-minilm-l6-v2] [--requests N] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from bench.common import emit, workdir
from bench.devserver import ServerProcess, free_port, write_config
from serve_app.models.embedded import materialize

GOAL_VS_SERIAL = 3.0
GOAL_VS_IN_PROCESS = 0.8
CLIENTS = 32
WORDS = ("the quick brown fox jumps over a lazy dog while seven bakers sell warm bread "
         "near the old harbour in spring").split()


def sentences(n: int) -> list[str]:
    """``n`` different sentences of 6 to 20 words (the same for every run)."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 21)))) for _ in range(n)]


def serve(tmp: Path, tag: str, model: str, batch: int) -> ServerProcess:
    port = free_port()
    config = write_config(tmp / f"{tag}.yaml", port, [{
        "name": model, "source": f"embedded:{model}",
        "pooling": {"max_batch_size": batch}}])
    server = ServerProcess.serve_run(config, port, tmp / f"{tag}.log")
    try:
        server.wait_ready([model], generate=False)
    except BaseException:
        server.stop()
        raise
    return server


def load(server: ServerProcess, model: str, texts: list[str]) -> tuple[float, list]:
    """Inputs a second with ``CLIENTS`` clients, one sentence a request; the vectors."""
    url = f"{server.base_url}/v1/embeddings"
    with httpx.Client(timeout=120) as client:
        def one(text: str) -> list[float]:
            r = client.post(url, json={"model": model, "input": text})
            r.raise_for_status()
            return r.json()["data"][0]["embedding"]

        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(one, texts[:CLIENTS]))  # warm
            tic = time.perf_counter()
            vectors = list(pool.map(one, texts))
            seconds = time.perf_counter() - tic
    return len(texts) / seconds, vectors


def in_process(model_dir: Path, texts: list[str]) -> tuple[float, np.ndarray]:
    from serve_app.pooling.model import PoolingModel
    from serve_app.pooling.pooler import finish

    model = PoolingModel(model_dir, "embed")
    encoded = [model.encode(t) for t in texts]
    model.embed(encoded[:CLIENTS])  # warm
    tic = time.perf_counter()
    out = [model.embed(encoded[i:i + CLIENTS]) for i in range(0, len(encoded), CLIENTS)]
    seconds = time.perf_counter() - tic
    return len(texts) / seconds, finish(np.concatenate(out), model.pooling, None)


def run(args: argparse.Namespace, tmp: Path) -> dict:
    texts = sentences(args.requests)
    model_dir = materialize(args.model)
    result: dict = {"model": args.model, "backend": "mlx (CPU here; Metal on a Mac)",
                    "settings": {"requests": args.requests, "clients": CLIENTS,
                                 "max_batch_size": 32}}
    rates: dict[str, float] = {}
    vectors: list = []
    for tag, batch in (("batched", 32), ("one_at_a_time", 1)):
        server = serve(tmp, tag, args.model, batch)
        try:
            rates[tag], got = load(server, args.model, texts)
            if tag == "batched":
                vectors = got
        finally:
            server.stop()
    rates["in_process"], reference = in_process(model_dir, texts)
    cosines = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
               for a, b in zip(np.array(vectors, np.float32), reference, strict=True)]
    result["inputs_per_s"] = {k: round(v, 1) for k, v in rates.items()}
    result["ratios"] = {"batched_vs_one_at_a_time": rates["batched"] / rates["one_at_a_time"],
                        "batched_vs_in_process": rates["batched"] / rates["in_process"]}
    result["vectors"] = {"min_cosine_to_in_process": min(cosines)}
    result["goals"] = {
        "vs_one_at_a_time": {"goal": f">= {GOAL_VS_SERIAL}x", "met":
                             result["ratios"]["batched_vs_one_at_a_time"] >= GOAL_VS_SERIAL},
        "vs_in_process": {"goal": f">= {GOAL_VS_IN_PROCESS}x", "met":
                          result["ratios"]["batched_vs_in_process"] >= GOAL_VS_IN_PROCESS},
        "vectors": {"goal": "cosine >= 0.9999", "met": min(cosines) >= 0.9999}}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-minilm-l6-v2",
                        choices=("all-minilm-l6-v2", "all-minilm-l6-v2-bf16", "tiny-bert"))
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with workdir() as tmp:
        emit(run(args, tmp), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
