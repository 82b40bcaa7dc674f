"""One model over two ranks: ``serve run`` with ``parallel: {tensor: 2}`` and
``parallel: {pipeline: 2}`` (``placement: pack``: both ranks on this machine, over MLX's
``ring`` backend on loopback), driven by the real ``openai`` client.

- At temperature 0 the sharded model answers as the same model unsharded; a second turn
  restores its prefix (every rank its own share) and answers as a cold prefill does; a
  restart restores it from SSD on every rank; eight concurrent streams each answer as
  they do alone.
- ``/v1/models`` lists the ranks and their nodes, ``/v1/stats`` their steps and their
  time in collectives.
- A rank killed mid-request, or one that hangs (stopped), ends it with 503 ``rank_lost``
  naming the rank, never a hang; Serve replaces the replica and its ranks, and the model
  answers again.
"""

from __future__ import annotations

import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import APIStatusError, OpenAI

from bench.devserver import ServerProcess, free_port, write_config
from tests.support.clients import cached, model_stats, openai_client, text, wait_written
from tests.support.servers import running, wait_for
from tests.support.sharded import ask, conversation
from tests.support.threads import Threads

BS = 16
SHARDED = {"t2": ("tiny-dense", {"tensor": 2, "placement": "pack"}),
           "p2": ("tiny-hybrid", {"pipeline": 2, "placement": "pack", "rank_timeout_s": 3})}
REFERENCE = {"t2": "dense", "p2": "hybrid"}  # the same weights, unsharded
MODELS = [
    *({"name": name, "source": f"embedded:{src}", "context_length": 4096,
       "max_batch_size": 4, "max_queued_requests": 16, "max_tokens": 4096,
       "parallel": parallel, "cache": {"block_size": BS}}
      for name, (src, parallel) in SHARDED.items()),
    *({"name": REFERENCE[name], "source": f"embedded:{src}", "context_length": 4096,
       "max_batch_size": 8, "cache": {"enabled": False}}
      for name, (src, _) in SHARDED.items()),
]
NAMES = [m["name"] for m in MODELS]


class Sharded:
    """The server, which a test may restart on the same SSD directory."""

    def __init__(self, tmp, model_home) -> None:
        self.port = free_port()
        self.tmp = tmp
        self.env = {"SERVE_APP_HOME": str(model_home)}
        self.config = write_config(tmp / "serve.yaml", self.port, MODELS,
                                   cache_store={"ssd_dir": str(tmp / "kv")})
        self.proc: ServerProcess | None = None
        self._ctx = None
        self.starts = 0

    def start(self) -> ServerProcess:
        self.starts += 1
        proc = ServerProcess.serve_run(self.config, self.port,
                                       self.tmp / f"serve-{self.starts}.log", env=self.env)
        self._ctx = running(proc, NAMES, timeout=400)
        self.proc = self._ctx.__enter__()
        return self.proc

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    @property
    def url(self) -> str:
        assert self.proc is not None
        return self.proc.base_url

    def client(self) -> OpenAI:
        assert self.proc is not None
        return openai_client(self.proc, "k")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, model_home):
    server = Sharded(tmp_path_factory.mktemp("sharded"), model_home)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_answers_as_unsharded_and_restores_its_prefix(sharded, name):
    client = sharded.client()
    first = ask(client, name, conversation(name))
    assert text(first) == text(ask(client, REFERENCE[name], conversation(name)))
    turn = [*conversation(name), {"role": "assistant", "content": text(first)},
            {"role": "user", "content": "And then?"}]
    warm = ask(client, name, turn)
    assert cached(warm) >= 4 * BS, warm.usage
    assert text(warm) == text(ask(client, name, turn, salt=uuid.uuid4().hex))  # cold
    assert text(warm) == text(ask(client, REFERENCE[name], turn))


@pytest.mark.parametrize("name", list(SHARDED))
def test_models_and_stats_show_the_ranks(sharded, name):
    entry = httpx.get(f"{sharded.url}/v1/models/{name}", timeout=30).json()
    mode = "tensor" if name == "t2" else "pipeline"
    parallel = entry["parallel"]
    assert parallel["mode"] == mode and parallel["size"] == 2
    assert [r["rank"] for r in parallel["ranks"]] == [0, 1]
    assert all(r["node"] for r in parallel["ranks"])
    stats = model_stats(sharded.proc, name)
    ranks = stats["replica"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["steps"] > 0 and ranks[0]["channel_seconds"] > 0
    assert "parallel" not in httpx.get(f"{sharded.url}/v1/models/dense", timeout=30).json()


def test_eight_concurrent_streams_each_answer_as_alone(sharded):
    """Eight requests at once on the tensor-parallel model (a batch of four, four
    queued): each stream's text is what the unsharded model gives it alone."""
    client = sharded.client()
    prompts = [[{"role": "user", "content": f"Stream {i}: " + "tell me more. " * (i + 1)}]
               for i in range(8)]
    alone = [text(ask(client, "dense", p, n=24)) for p in prompts]

    def streamed(p) -> str:
        out = client.chat.completions.create(model="t2", messages=p, max_tokens=24,
                                             temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(streamed, prompts, timeout=300))
    assert together == alone


def test_a_restart_restores_every_ranks_share_from_ssd(sharded):
    """Stopped and started again on the same SSD directory: the second turn restores its
    prefix from SSD (both ranks) and answers as before."""
    client = sharded.client()
    turns = {}
    for name in SHARDED:
        first = ask(client, name, conversation(f"restart {name}"))
        turns[name] = [*conversation(f"restart {name}"),
                       {"role": "assistant", "content": text(first)},
                       {"role": "user", "content": "Go on."}]
        turns[name] = (turns[name], text(ask(client, name, turns[name])))
    for name in SHARDED:  # the store writes its blocks to SSD behind the requests
        wait_written(sharded.proc, name)
    sharded.stop()
    sharded.start()
    client = sharded.client()
    for name, (turn, before) in turns.items():
        again = ask(client, name, turn)
        assert text(again) == before
        assert cached(again) >= 4 * BS, (name, again.usage)
        tiers = model_stats(sharded.proc, name)["cache"]["hit_tokens_by_tier"]
        assert tiers.get("ssd", 0) >= 4 * BS, (name, tiers)


def lose_a_rank_mid_answer(sharded, name: str, fault: signal.Signals) -> tuple[dict, dict]:
    """Send ``fault`` to rank 1 of ``name`` while a long answer decodes; the request's
    outcome (its error) and rank 1 as it was. The request must end within 60 s of the
    fault (a hang fails here)."""
    client = sharded.client()
    rank1 = model_stats(sharded.proc, name)["replica"]["ranks"][1]
    outcome: dict = {}

    def long_answer() -> None:
        try:
            ask(client, name, [{"role": "user", "content": "Write at length."}], n=3500)
            outcome["error"] = None
        except APIStatusError as exc:
            outcome["error"] = exc

    worker = Threads()
    worker.start(long_answer)
    wait_for(lambda: model_stats(sharded.proc, name)["engine"]["running_batch_size"] > 0,
             "the long request to start decoding", 60, interval=0.1)
    os.kill(rank1["pid"], fault)
    worker.join(60)  # "the request hung after its rank was lost" otherwise
    return outcome, rank1


def answers_again(sharded, name: str, expected: str, lost: dict) -> None:
    """Serve replaces the replica and its ranks; the model then answers, exactly."""
    client = sharded.client()

    def answered():
        try:
            return ask(client, name, conversation("after recovery"))
        except APIStatusError as exc:
            assert exc.status_code == 503, exc
            return None

    again = wait_for(answered, "Serve to replace the replica", 240, interval=2)
    assert text(again) == expected
    assert model_stats(sharded.proc, name)["replica"]["ranks"][1]["pid"] != lost["pid"]


def rank_lost(outcome: dict) -> dict:
    error = outcome["error"]
    assert error is not None and error.status_code == 503, outcome
    body = error.response.json()["error"]
    assert body["code"] == "rank_lost", body
    return body


def test_a_killed_rank_ends_its_requests_with_503_and_serve_recovers(sharded):
    """Rank 1 of the tensor-parallel model is killed while a long answer is decoding: the
    request ends with 503 ``rank_lost`` naming rank 1 and its node (never a hang); once
    Serve has replaced the replica and its ranks, the model answers again, exactly."""
    expected = text(ask(sharded.client(), "t2", conversation("after recovery")))
    outcome, rank1 = lose_a_rank_mid_answer(sharded, "t2", signal.SIGKILL)
    body = rank_lost(outcome)
    assert "rank 1" in body["message"] and rank1["node_id"] in body["message"], body
    answers_again(sharded, "t2", expected, rank1)


def test_a_hung_rank_ends_its_requests_with_503_within_its_timeout(sharded):
    """Rank 1 of the pipeline-parallel model stops (SIGSTOP: alive, answering nothing)
    mid-answer: rank 0 waits in a collective that never completes, its ping times out
    after ``rank_timeout_s`` (3 s here), and the request ends with 503 naming the rank;
    Serve replaces the replica (the stopped rank with it)."""
    expected = text(ask(sharded.client(), "p2", conversation("after recovery")))
    outcome, rank1 = lose_a_rank_mid_answer(sharded, "p2", signal.SIGSTOP)
    try:
        body = rank_lost(outcome)
        assert "rank 1" in body["message"] and "did not answer within 3 s" in body["message"]
        answers_again(sharded, "p2", expected, rank1)
    finally:
        if stopped(rank1["pid"]):  # never leave it stopped (Serve's kill reaped it, else)
            os.kill(rank1["pid"], signal.SIGKILL)


def stopped(pid: int) -> bool:
    """Whether ``pid`` is a stopped process (the one this test stopped, not a reused pid)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"
