"""A node lost mid-run, for real: one of three Ray nodes (``ray.cluster_utils.Cluster``) is
killed, raylet and everything on it, while streams and whole answers are in flight on it.

- a whole answer (not streamed) in flight on it is sent once more to the other replica and
  answered: the client sees no error;
- a stream already started on it goes on from the other replica after the tokens it had
  sent: the client reads the undisturbed answer, no error; nothing hangs;
- every turn after the kill is answered; the block directory forgets the node's blocks;
- the node comes back (its SSD directory with it): Serve places the replacement replica
  there, its store announces the blocks on its SSD, and a conversation whose prefix is
  there is restored from it, with the tokens it had before.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from bench.devserver import ServerProcess, free_port, write_config
from bench.node_loss import RESUMED_REQUESTS, metric_sum
from serve_app.cluster.directory_service import DIRECTORY_NAME, NAMESPACE
from tests.support.servers import running, wait_for
from tests.support.threads import Threads

MODEL = "tiny-hybrid"
SLOT = "serve_app_test_node_loss_slot"  # only the workers have it: one replica each
SESSIONS = 4


def add_worker(cluster: Cluster, ssd: Path):
    return cluster.add_node(num_cpus=1, resources={SLOT: 1},
                            env_vars={"SERVE_APP_SSD_DIR": str(ssd)})


@pytest.fixture(scope="module")
def lossy(tmp_path_factory, model_home):
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray_node_loss")
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_factory.mktemp("node-loss")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False})
    workers = [add_worker(cluster, tmp / f"kv{i}") for i in (1, 2)]
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        cluster.wait_for_nodes()
        port = free_port()
        model = {"name": MODEL, "source": "embedded:tiny-hybrid", "context_length": 4096,
                 "max_batch_size": 2, "max_queued_requests": 16, "max_tokens": 2000,
                 "num_replicas": 2, "max_replicas_per_node": 1, "resources": {SLOT: 1},
                 "routing": {"mode": "prefix"}, "cache": {"block_size": 16}}
        config = write_config(tmp / "serve.yaml", port, [model],
                              cache_store={"directory": "on"})
        proc = ServerProcess.serve_run(config, port, tmp / "serve.log",
                                       env={"SERVE_APP_HOME": str(model_home)},
                                       address=cluster.address)
        with running(proc, [MODEL], timeout=400):
            yield cluster, workers, proc, tmp
    finally:
        ray.shutdown()
        cluster.shutdown()


def messages(session: int, turns: int) -> list[dict]:
    out = [{"role": "system", "content": f"Session {session}: a careful assistant. " * 6}]
    for t in range(turns):
        out.append({"role": "user", "content": f"Question {t} of session {session}. " * 3})
        if t < turns - 1:
            out.append({"role": "assistant", "content": f"Answer {t}."})
    return out


def whole(server: ServerProcess, msgs: list[dict], n: int = 16) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": msgs, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


class Stream(threading.Thread):
    """A long stream read to its end: its text, whether it ended with [DONE], its error
    event if any; ``started`` is set at its first content chunk."""

    def __init__(self, server: ServerProcess, session: int) -> None:
        super().__init__(daemon=True)
        self.server, self.session = server, session
        self.started = threading.Event()
        self.text, self.error, self.done, self.status = "", None, False, None
        self.broken: str | None = None

    def run(self) -> None:
        body = {"model": MODEL, "messages": messages(self.session, 1), "max_tokens": 2000,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.server.base_url}/v1/chat/completions",
                              json=body, timeout=240) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = event["error"]
                        elif event.get("choices"):
                            self.text += event["choices"][0]["delta"].get("content") or ""
                            self.started.set()
        except httpx.HTTPError as exc:  # the connection broke: no clear end
            self.broken = repr(exc)
        finally:
            self.started.set()


class Whole(threading.Thread):
    def __init__(self, server: ServerProcess, session: int) -> None:
        super().__init__(daemon=True)
        self.server, self.session = server, session
        self.status, self.body, self.seconds = None, None, 0.0

    def run(self) -> None:
        tic = time.monotonic()
        try:
            r = httpx.post(f"{self.server.base_url}/v1/chat/completions", timeout=240, json={
                "model": MODEL, "messages": messages(self.session, 2), "max_tokens": 400,
                "temperature": 0})
            self.status, self.body = r.status_code, r.json()
        finally:
            self.seconds = time.monotonic() - tic


def node_of(server: ServerProcess, counter: str = "finished") -> dict[str, int]:
    """Requests each node's replica finished (or has in flight: ``counter``), from
    ``/v1/stats``' replicas."""
    stats = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"][MODEL]
    return {r["node_id"]: r["stats"]["engine"][counter] for r in stats["replicas"]}


def resumed(server: ServerProcess) -> float:
    """Requests continued after their replica was lost (``/metrics``, every node)."""
    return metric_sum(httpx.get(f"{server.base_url}/metrics", timeout=60).text,
                      RESUMED_REQUESTS)


def test_a_node_lost_mid_run_then_back(lossy):
    cluster, workers, server, tmp = lossy
    directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    wait_for(lambda: len(node_of(server)) == 2, "both replicas to report", 240)
    # Warm both replicas: sessions' second turns, answered before any loss, sent together
    # until both nodes hold some. One at a time they would all go to the replica holding
    # their common first block (the template's opening): a replica with free batch slots
    # keeps its prefix; a full batch (max_batch_size 2) sends the next one to the other.
    before: dict[int, dict] = {}
    for wave in range(4):
        sessions = range(wave * SESSIONS, (wave + 1) * SESSIONS)
        with ThreadPoolExecutor(SESSIONS) as pool:
            answers = list(pool.map(lambda s: whole(server, messages(s, 2)), sessions))
        before.update(zip(sessions, answers, strict=True))
        if min(node_of(server).values()) > 0:
            break

    # What each worker's store announced (read now: nothing slow between the streams'
    # start and the kill).
    def announced() -> dict[str, int] | None:
        nodes = ray.get(directory.nodes.remote())
        return nodes if all(nodes.get(w.node_id) for w in workers) else None

    held = wait_for(announced, "both workers' blocks in the directory", 60)

    # In flight at the kill: a stream per session (all running: two per replica, the batch
    # size), then two whole answers per session, spread by load over both replicas. The node
    # killed is one holding streams and at least one whole answer.
    streams = [Stream(server, s) for s in range(SESSIONS)]
    for t in streams:
        t.start()
    for t in streams:
        assert t.started.wait(60)
    def every_stream() -> dict[str, int] | None:
        # Replicas report their stats every second or so: read once every stream shows.
        busy = node_of(server, "in_flight")
        return busy if sum(busy.values()) == SESSIONS else None

    streaming = wait_for(every_stream, "the streams in the replicas' stats", 30)
    wholes = [Whole(server, 100 + s) for s in range(2 * SESSIONS)]
    for t in wholes:
        t.start()

    seen: list[dict] = []

    def with_both() -> list[int]:
        busy = node_of(server, "in_flight")
        seen[:] = [busy]
        return [i for i in (0, 1) if streaming.get(workers[i].node_id, 0)
                and busy.get(workers[i].node_id, 0) > streaming[workers[i].node_id]]

    try:
        index = wait_for(with_both, "a whole answer beside the streams", 30)[0]
    except AssertionError as exc:
        raise AssertionError(f"{exc}: streams {streaming}, in flight {seen}, workers "
                             f"{[w.node_id for w in workers]}") from None
    victim = workers[index].node_id
    assert not any(t.done for t in streams), "a stream ended before the kill"
    incarnation = ray.get(directory.incarnation.remote())
    cluster.remove_node(workers[index], allow_graceful=False)
    unreachable: list[str] = []  # the directory lives on the head: never expected

    def forgot() -> bool:
        """Whether the directory no longer lists the dead node."""
        try:
            return victim not in ray.get(directory.nodes.remote(), timeout=10)
        except ray.exceptions.RayError as exc:
            unreachable.append(repr(exc))
            return False

    # Ray declares a node dead once it missed its heartbeats (~15 s here), the directory
    # looks every NODE_CHECK_S: watched from the kill on, while the requests end.
    watcher = Threads()
    watcher.start(wait_for, forgot, lambda: f"the directory to forget the dead node "
                  f"(unreachable: {unreachable})", 120, 0.25)
    for t in [*streams, *wholes]:
        t.join(timeout=300)
        assert not t.is_alive(), "a request hung after the node died"

    # Streams on the lost node went on from the other replica: every one ended cleanly,
    # none with an error event (their text is checked against undisturbed runs below).
    assert all(t.done and t.broken is None and t.error is None for t in streams), [
        (t.error, len(t.text), t.done, t.broken) for t in streams]
    assert resumed(server) >= 1  # the streams on the victim were continued, not resent
    # Whole answers in flight there were sent again to the other replica: all answered.
    assert [t.status for t in wholes] == [200] * len(wholes), [
        (t.status, round(t.seconds, 1), t.body) for t in wholes]

    # Every turn from now on is answered; the directory forgets the node's blocks. The
    # streams again, undisturbed: the answers the resumed ones gave, token for token.
    for s in before:
        assert whole(server, messages(s, 3))["text"]
    again = [Stream(server, t.session) for t in streams]
    for t in again:
        t.start()
    for t in again:
        t.join(timeout=300)
        assert t.done and t.error is None
    assert [t.text for t in streams] == [t.text for t in again]
    watcher.join(150)  # the directory forgot the dead node (or the wait's error is raised)
    # The directory runs on the head node: the worker's loss did not restart it.
    assert not unreachable and ray.get(directory.incarnation.remote()) == incarnation

    # The node comes back with its SSD directory: the replacement replica lands there,
    # its store announces what that directory holds.
    back = add_worker(cluster, tmp / f"kv{index + 1}")
    wait_for(lambda: ray.get(directory.nodes.remote()).get(back.node_id, 0)
             >= held[victim] // 2,
             "the returned node's SSD blocks in the directory", 240)
    wait_for(lambda: back.node_id in node_of(server), "a replica on the returned node", 240)
    # The conversations from before the loss are restored (from the RAM of the node that
    # served their next turn, or the returned node's SSD), with the tokens they had.
    again = {s: whole(server, messages(s, 2)) for s in before}
    assert {s: a["text"] for s, a in again.items()} == {s: b["text"] for s, b in
                                                         before.items()}
    assert all(a["cached"] > 0 for a in again.values())
    # New conversations, several at once, go to the returned node too (a moment apart:
    # a router ranks by the requests it has routed, and ones decided in the same instant
    # do not see each other).
    served_before = node_of(server).get(back.node_id, 0)
    fresh = [Whole(server, 200 + s) for s in range(SESSIONS)]
    for t in fresh:
        t.start()
        time.sleep(0.5)
    for t in fresh:
        t.join(timeout=300)
        assert not t.is_alive(), "a new conversation hung"
    assert [t.status for t in fresh] == [200] * len(fresh)
    wait_for(lambda: node_of(server).get(back.node_id, 0) > served_before,
             "traffic on the returned node", 30)
