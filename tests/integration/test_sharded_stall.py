"""A rank whose engine thread is stuck while its process answers every ping (issue 45):
the replica's progress watchdog (steps completed, not pings) ends the model's requests
with 503 ``rank_lost`` naming the rank, never a hang, and Serve replaces the replica (how
soon: ``bench/stall.py`` measures it, nothing here asserts a time).

The stuck thread is a fault a test cannot cause for real (a signal stops a whole
process): ``SERVE_APP_TEST_STALL_RANK=1:STEPS`` blocks rank 1's engine thread for good
before its step STEPS + 1, every other thread of the rank answering as before."""

from __future__ import annotations

import time

from openai import APIStatusError

from serve_app.serving.engine_ranks import STALL_ENV
from tests.support.clients import model_stats, openai_client
from tests.support.servers import serving, wait_for
from tests.support.sharded import ask, conversation
from tests.support.threads import Threads

TIMEOUT_S = 3
STALL_AFTER = 80  # warm-up, readiness and the recovery's answer take far fewer steps
MODELS = [{"name": "t2", "source": "embedded:tiny-dense", "context_length": 4096,
           "max_batch_size": 2, "max_tokens": 4096,
           "parallel": {"tensor": 2, "placement": "pack", "rank_timeout_s": TIMEOUT_S},
           "cache": {"block_size": 16}}]


def test_a_rank_whose_engine_thread_is_stuck_ends_its_requests_with_503(tmp_path,
                                                                        model_home):
    env = {STALL_ENV: f"1:{STALL_AFTER}"}
    with serving(tmp_path, MODELS, model_home, env=env, timeout=400) as server:
        client = openai_client(server, "k")
        rank1 = model_stats(server, "t2")["replica"]["ranks"][1]
        outcome: dict = {}

        def long_answer() -> None:
            try:
                ask(client, "t2", [{"role": "user", "content": "Write at length."}], n=3500)
                outcome["error"] = None
            except APIStatusError as exc:
                outcome["error"] = exc

        worker = Threads()
        worker.start(long_answer)
        # The stall: rank 1's steps stop while it still answers (its status says so).
        wait_for(lambda: _stuck(server), "rank 1 to stop stepping", 120, interval=0.2)
        longest = model_stats(server, "t2")["engine"]["longest_step_seconds"]
        worker.join(TIMEOUT_S + 3 * longest + 30)  # a hang fails here
        error = outcome.get("error")
        assert error is not None and error.status_code == 503, outcome
        body = error.response.json()["error"]
        assert body["code"] == "rank_lost", body
        assert "no step completed" in body["message"] and "rank 1" in body["message"], body
        # How soon after the stall (goal: rank_timeout_s + 5 s) is bench/stall.py's to say.

        def answered():
            try:
                return ask(client, "t2", conversation("after the stall"))
            except APIStatusError as exc:
                assert exc.status_code == 503, exc
                return None

        wait_for(answered, "Serve to replace the replica", 240, interval=2)
        assert model_stats(server, "t2")["replica"]["ranks"][1]["pid"] != rank1["pid"]


def _stuck(server) -> float | None:
    """When rank 1 was last seen stepping (monotonic), once it has been in one step for a
    while; None before."""
    ranks = model_stats(server, "t2")["replica"]["ranks"]
    rank1 = ranks[1] if len(ranks) > 1 else {}
    if rank1.get("activity") == "step" and rank1.get("activity_s", 0) > 0.5:
        return time.monotonic() - rank1["activity_s"]
    return None
