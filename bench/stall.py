"""A rank whose engine thread is stuck while its process answers every ping: how long
until the model's requests end with 503 ``rank_lost`` (issue 45's goal: within
``rank_timeout_s`` + 5 s, 0 hangs), over several stalls in one run.

One ``serve run`` of ``tiny-dense`` over two ranks (``tensor: 2``, ``placement: pack``),
``SERVE_APP_TEST_STALL_RANK=1:STEPS`` in its environment: rank 1's engine thread blocks
for good before its step STEPS + 1 (a fault nothing outside can cause: a signal stops a
whole process). Each replica Serve starts in place of a stalled one stalls again after as
many steps, so every round is: a long answer, rank 1 seen in one step for over half a
second (``/v1/stats``' ranks, whose ``activity_s`` dates the stall), then the 503 or a
hang (no answer within ``--hang-s``), then Serve's replacement answering.

Usage: python -m bench.stall [--rounds N] [--timeout-s S] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.common import emit, model_stats, workdir
from bench.devserver import ServerProcess, free_port, write_config
from serve_app.serving.engine_ranks import STALL_ENV

MODEL = "t2"
STALL_AFTER = 80  # warm-up and a replacement's readiness take far fewer steps
SLACK_S = 5.0  # the goal: the 503 within rank_timeout_s (or 3 longest steps) + this


def stalled_since(server: ServerProcess) -> float | None:
    """When rank 1 last stepped (monotonic), once it has been in one step a while."""
    ranks = model_stats(server, MODEL).get("replica", {}).get("ranks") or []
    rank1 = ranks[1] if len(ranks) > 1 else {}
    if rank1.get("activity") == "step" and rank1.get("activity_s", 0) > 0.5:
        return time.monotonic() - rank1["activity_s"]
    return None


def one_stall(server: ServerProcess, hang_s: float) -> dict:
    """A long answer into a stall: seconds from the stall to its answer, and what it was."""
    outcome: dict = {}

    def ask() -> None:
        try:
            r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=hang_s, json={
                "model": MODEL, "max_tokens": 3500, "temperature": 0,
                "messages": [{"role": "user", "content": "Write at length."}]})
            outcome["status"] = r.status_code
            outcome["code"] = (r.json().get("error") or {}).get("code")
        except httpx.TimeoutException:
            outcome["status"] = "hang"
        outcome["at"] = time.monotonic()

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    stuck = None
    deadline = time.monotonic() + 120
    while stuck is None and time.monotonic() < deadline and worker.is_alive():
        stuck = stalled_since(server)
        time.sleep(0.2)
    longest = model_stats(server, MODEL)["engine"]["longest_step_seconds"]
    worker.join(hang_s + 5)
    at = outcome.get("at")
    return {"status": outcome.get("status", "hang"), "code": outcome.get("code"),
            "seconds_from_stall": None if stuck is None or at is None else at - stuck,
            "longest_step_s": longest}


def recovered(server: ServerProcess, timeout: float = 240.0) -> float:
    """Seconds until a short answer comes back (Serve's replacement replica)."""
    tic = time.monotonic()
    while time.monotonic() - tic < timeout:
        try:
            r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello."}]})
            if r.status_code == 200:
                return time.monotonic() - tic
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError("the replica was not replaced")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=3.0, help="rank_timeout_s")
    parser.add_argument("--hang-s", type=float, default=120.0,
                        help="no answer this long after the request counts as a hang")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = {"name": MODEL, "source": "embedded:tiny-dense", "context_length": 4096,
             "max_batch_size": 2, "max_tokens": 4096, "cache": {"block_size": 16},
             "parallel": {"tensor": 2, "placement": "pack", "rank_timeout_s": args.timeout_s}}
    tic = time.monotonic()
    rounds = []
    with workdir() as tmp:
        port = free_port()
        config = write_config(tmp / "serve.yaml", port, [model])
        server = ServerProcess.serve_run(config, port, tmp / "serve.log",
                                         env={STALL_ENV: f"1:{STALL_AFTER}"})
        try:
            server.wait_ready([MODEL], timeout=400)
            for _ in range(args.rounds):
                row = one_stall(server, args.hang_s)
                row["recovered_s"] = recovered(server)
                rounds.append(row)
                print(row, flush=True)
        finally:
            server.stop()
    seconds = [r["seconds_from_stall"] for r in rounds if r["seconds_from_stall"] is not None]
    bound = max([args.timeout_s] + [3 * r["longest_step_s"] for r in rounds]) + SLACK_S
    result = {
        "command": "python -m bench.stall " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "model": "embedded:tiny-dense, tensor: 2 (placement: pack)",
        "backend": "MLX CPU", "rank_timeout_s": args.timeout_s, "rounds": rounds,
        "hangs": sum(r["status"] == "hang" for r in rounds),
        "rank_lost_503": sum(r["status"] == 503 and r["code"] == "rank_lost" for r in rounds),
        "seconds_from_stall_p50": statistics.median(seconds) if seconds else None,
        "seconds_from_stall_max": max(seconds) if seconds else None,
        "goal_s": bound,
        "goal_met": bool(seconds) and len(seconds) == len(rounds) and max(seconds) <= bound,
        "wall_s": time.monotonic() - tic,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
