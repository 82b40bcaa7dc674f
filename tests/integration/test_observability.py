"""Metrics through a real Prometheus: a multi-turn workload, a restart, every dashboard query.

Prometheus scrapes ``GET /metrics`` on the API port with the committed
single-machine config (target and interval adjusted). The workload's own
numbers (usage from the API, files on disk) say what each metric must read.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml
from openai.types.chat import ChatCompletion

from bench.devserver import ServerProcess, free_port, write_config
from dashboards.generate import DASHBOARDS, build, concrete, panel_queries
from serve_app.cache.ssd_format import read_header
from serve_app.cache.ssd_fs import FORMAT_VERSION
from serve_app.metrics.table import METRICS
from tests.support import REPO
from tests.support.clients import chat, openai_client, wait_written
from tests.support.servers import running, wait_for
from tests.support.threads import Threads

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    not (PROMETHEUS and PROMTOOL),
    reason="Prometheus is not installed (Debian: apt-get install prometheus; the README's "
           "test command installs it where it can)")


BS = 16
HYBRID = "obs-hybrid"
DENSE = "obs-dense"
LIMITED = "obs-limited"
EMBED = "obs-embed"
MODELS = [
    # Routed by the prefix-affinity router even with one replica: its decisions reach
    # Prometheus like every other metric.
    {"name": HYBRID, "source": "embedded:tiny-hybrid", "context_length": 1024,
     "cache": {"block_size": BS}, "routing": {"mode": "prefix"}},
    {"name": DENSE, "source": "embedded:tiny-dense", "context_length": 1024,
     "cache": {"block_size": BS}},
    {"name": LIMITED, "source": "embedded:tiny-dense", "context_length": 4096,
     "max_batch_size": 1, "max_queued_requests": 1, "max_tokens": 4000,
     "cache": {"enabled": False}},
    # An embedding model: its counters and model-call histograms reach Prometheus too.
    {"name": EMBED, "source": "embedded:tiny-bert"},
]
# Ray pushes worker metrics to the node's exporter every 10 s by default.
SERVER_ENV = {"RAY_metrics_report_interval_ms": "500"}


class Prometheus:
    """A real Prometheus on loopback, scraping the server's /metrics every second."""

    def __init__(self, tmp: Path, target_port: int) -> None:
        config = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "1s"
        config["global"]["evaluation_interval"] = "1s"
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [
            f"127.0.0.1:{target_port}"]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self.ready, "Prometheus ready", 60, interval=0.2)

    def ready(self) -> bool:
        assert self.proc.poll() is None, "Prometheus exited"
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float, timeout: float = 60.0) -> None:
        """Until ``expr`` reads ``expected`` (a scrape and Ray's export behind the event)."""
        got: list[float | None] = [None]

        def reads() -> bool:
            got[0] = self.value(expr)
            return got[0] == expected

        wait_for(reads, lambda: f"{expr} = {got[0]}, expected {expected}", timeout, 0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def stack(tmp_path, model_home):
    port = free_port()
    prometheus = Prometheus(tmp_path, port)
    started: list[ServerProcess] = []
    with ExitStack() as servers:
        servers.callback(prometheus.stop)

        def start() -> ServerProcess:
            n = len(started)
            config = write_config(tmp_path / f"serve{n}.yaml", port, MODELS,
                                  cache_store={"ssd_dir": str(tmp_path / "kv")})
            server = ServerProcess.serve_run(config, port, tmp_path / f"serve{n}.log",
                                             env={"SERVE_APP_HOME": str(model_home),
                                                  **SERVER_ENV})
            started.append(server)
            return servers.enter_context(
                running(server, [m["name"] for m in MODELS], generate=False))

        yield start, prometheus, tmp_path / "kv"


def ask(server: ServerProcess, model: str, messages: list[dict]) -> ChatCompletion:
    return chat(openai_client(server, "k"), model, messages)


def conversation(server: ServerProcess, model: str, turns: int) -> tuple[list[dict], list]:
    messages = [{"role": "system", "content": f"You are the {model} observability test."}]
    replies = []
    for turn in range(turns):
        messages.append({"role": "user",
                         "content": f"Turn {turn}: please describe the weather in detail, "
                                    f"then the tides, then the moon phase {turn}."})
        reply = ask(server, model, messages)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return messages[:-1], replies


def reject_one(server: ServerProcess) -> None:
    """Fill LIMITED's batch slot and queue with two held streams; a third request gets 429."""
    body = {"model": LIMITED, "prompt": "x" * 8, "max_tokens": 4000, "stream": True,
            "temperature": 0}
    started = threading.Barrier(3)
    stop = threading.Event()

    def hold() -> None:
        # Headers arrive once the replica has admitted the request (running or queued).
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=120) as r:
            assert r.status_code == 200, r.read()
            started.wait(60)
            stop.wait(60)

    holders = Threads()
    holders.on_error.append(started.abort)  # a failed hold wakes the others at once
    try:
        for _ in range(2):
            holders.start(hold)
        started.wait(60)
        r = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False},
                       timeout=60)
    finally:
        stop.set()
        holders.join(120)  # a holder's failure is raised here, before the barrier's
    assert r.status_code == 429, r.text


def files(kv: Path, kind: str) -> list[Path]:
    return sorted((kv / f"v{FORMAT_VERSION}" / f"{kind}s").rglob("*.safetensors"))


def depth_of(blocks: dict[str, str], block_id: str) -> int:
    depth = 0
    while block_id in blocks:
        depth += 1
        block_id = blocks[block_id]
    return depth


def m(name: str, **labels: str) -> str:
    """``sum(ray_serve_app_<name>{labels})``."""
    selector = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return f"sum(ray_serve_app_{name}{{{selector}}})"


def promtool_check(text: str) -> None:
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(),
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_metrics_follow_a_workload_across_a_restart(stack):
    start, prom, kv = stack
    first = start()
    ray_service_discovery_is_current()
    every_metric_is_scraped_before_any_request(prom)

    # ---- session 1: two conversations, a few bad requests, a queue-full rejection
    hybrid_messages, hybrid = conversation(first, HYBRID, 3)
    _, dense = conversation(first, DENSE, 2)
    assert httpx.post(f"{first.base_url}/v1/chat/completions", timeout=30,
                      json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
                      ).status_code == 404
    assert httpx.post(f"{first.base_url}/v1/chat/completions", timeout=30,
                      json={"model": HYBRID, "messages": [], "temperature": -1}
                      ).status_code == 400
    reject_one(first)
    store = wait_written(first, HYBRID)

    for model, replies in ((HYBRID, hybrid), (DENSE, dense)):
        cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
        prompt = sum(r.usage.prompt_tokens for r in replies)
        prom.wait_for(m("requests_total", model=model, status="200"), len(replies))
        prom.wait_for(m("prompt_tokens_total", model=model), prompt)
        prom.wait_for(m("generation_tokens_total", model=model),
                      sum(r.usage.completion_tokens for r in replies))
        prom.wait_for(m("prefix_cache_lookups_total", model=model), len(replies))
        prom.wait_for(m("prefix_cache_hit_tokens_total", model=model), cached)
        prom.wait_for(m("prefix_cache_missed_tokens_total", model=model), prompt - cached)
        prom.wait_for(m("prefix_cache_misses_total", model=model, reason="new_prefix"), 1)
        prom.wait_for(m("prefix_cache_walkbacks_total", model=model), 0)
        assert cached > 0
    prom.wait_for(m("requests_total", model="unknown", status="404"), 1)
    prom.wait_for(m("requests_total", model="unknown", status="400"), 1)
    prom.wait_for(m("requests_total", model=LIMITED, status="429"), 1)
    prom.wait_for(m("rejected_requests_total", model=LIMITED, reason="queue_full"), 1)
    prom.wait_for(m("prefix_cache_misses_total", model=LIMITED, reason="disabled"), 2)
    prom.wait_for(m("time_to_first_token_seconds_count", model=HYBRID), len(hybrid))
    prom.wait_for(m("inter_token_latency_seconds_count", model=HYBRID),
                  sum(r.usage.completion_tokens - 1 for r in hybrid))
    prom.wait_for(m("request_duration_seconds_count", model=HYBRID), len(hybrid))
    for phase in ("prepare", "plan", "queue", "prefill"):
        prom.wait_for(m("request_phase_seconds_count", model=HYBRID, phase=phase), len(hybrid))

    # Staging and SSD: what the writer did is what is on disk.
    blocks, sidecars = files(kv, "block"), files(kv, "sidecar")
    assert blocks and sidecars
    prom.wait_for(m("cache_staging_writes_total", result="done"),
                  store["staging"]["writes_done"])
    prom.wait_for(m("cache_staging_writes_total", result="failed"), 0)
    prom.wait_for(m("cache_staging_writes_total", result="dropped"), 0)
    prom.wait_for(m("cache_staging_pending_bytes"), 0)
    assert prom.value(m("cache_staging_peak_pending_bytes")) > 0
    prom.wait_for(m("cache_entries", tier="ssd", kind="block"), len(blocks))
    prom.wait_for(m("cache_entries", tier="ssd", kind="sidecar"), len(sidecars))
    prom.wait_for(m("cache_bytes", tier="ssd", kind="block"),
                  sum(p.stat().st_size for p in blocks))
    prom.wait_for(m("cache_bytes", tier="ssd", kind="sidecar"),
                  sum(p.stat().st_size for p in sidecars))
    prom.wait_for(m("cache_entries", tier="hot", kind="block"), store["blocks"])
    promtool_check(httpx.get(f"{first.base_url}/metrics", timeout=30).text)
    first.stop()

    # ---- force a walkback: the sidecar of the last hybrid prompt's deepest block goes
    last = hybrid[-1]
    restorable = (last.usage.prompt_tokens - 1) // BS
    hybrid_ids = {p.stem for p in sidecars}
    headers = {p.stem: read_header(p)[1] for p in blocks}
    parents = {b: h["parent_id"] for b, h in headers.items()  # full blocks, not tails
               if b in hybrid_ids and int(h["tokens"]) == BS}
    deepest = [b for b in parents if depth_of(parents, b) == restorable]
    assert len(deepest) == 1, deepest
    (victim,) = [p for p in sidecars if p.stem == deepest[0]]
    victim.unlink()
    # ... and the tails (partial blocks) under it and under its parent, with their
    # sidecars: the replay must walk back exactly one block, to a full block's end.
    under = {deepest[0], parents[deepest[0]]}
    for path in blocks:
        meta = headers[path.stem]
        if int(meta["tokens"]) < BS and meta["parent_id"] in under:
            for same in [path, *(p for p in sidecars if p.stem == path.stem)]:
                same.unlink()

    # ---- session 2: the same request again, restored from SSD a block and a tail short
    second = start()
    prom.wait_for(m("prefix_cache_walkbacks_total", model=HYBRID), 0)  # the new series
    again = ask(second, HYBRID, hybrid_messages)
    assert again.choices[0].message.content == last.choices[0].message.content
    expected = (restorable - 1) * BS
    assert again.usage.prompt_tokens_details.cached_tokens == expected
    prom.wait_for(m("prefix_cache_walkbacks_total", model=HYBRID), 1)
    prom.wait_for(m("prefix_cache_hit_tokens_total", model=HYBRID, tier="ssd"), expected)
    prom.wait_for(m("prefix_cache_checkpoint_loads_total", model=HYBRID, tier="ssd"), 1)
    prom.wait_for(m("prefix_cache_misses_total", model=HYBRID, reason="no_checkpoint"), 1)
    assert prom.value(m("prefix_cache_ssd_read_bytes_total", model=HYBRID)) > 0

    # One more turn: now from the hot tier (SSD blocks were promoted on restore).
    more = ask(second, HYBRID, [*hybrid_messages,
                                 {"role": "assistant",
                                  "content": again.choices[0].message.content},
                                 {"role": "user", "content": "And tomorrow?"}])
    hot = more.usage.prompt_tokens_details.cached_tokens
    assert hot >= restorable * BS
    prom.wait_for(m("prefix_cache_hit_tokens_total", model=HYBRID), expected + hot)
    assert prom.value(m("prefix_cache_hit_tokens_total", model=HYBRID, tier="hot")) > 0
    prom.wait_for(m("prefix_cache_walkbacks_total", model=HYBRID), 1)  # still exactly one

    # ---- an embedding model's work: inputs and tokens counted, its model calls timed
    embedded = openai_client(second, "k").embeddings.create(model=EMBED, input=["a", "bc"])
    prom.wait_for(m("pooling_inputs_total", model=EMBED, task="embed"), 2)
    prom.wait_for(m("pooling_tokens_total", model=EMBED, task="embed"),
                  embedded.usage.prompt_tokens)
    prom.wait_for(m("requests_total", model=EMBED, status="200"), 1)
    assert prom.value(m("pooling_batch_seconds_count", model=EMBED)) >= 1

    # ---- every panel of every dashboard has data (rate() needs a few samples of the new
    # series: until then a panel may be empty); the scraped text is valid
    empty: list[str] = []

    def every_panel_has_data() -> bool:
        empty[:] = [f"{key} / {title}: {expr}" for key in DASHBOARDS
                    for title, expr in panel_queries(build(key))
                    if not prom.query(concrete(expr))]
        return not empty

    wait_for(every_panel_has_data, lambda: "data in every panel; empty:\n" + "\n".join(empty),
             60, interval=1)
    promtool_check(httpx.get(f"{second.base_url}/metrics", timeout=30).text)


def every_metric_is_scraped_before_any_request(prom: Prometheus) -> None:
    """Each metric of the table has a series in Prometheus from the server's first
    scrapes, before any request: a panel or an alert on it never sees "no data". The
    histograms of every model are there at zero (nothing observed yet)."""
    for d in METRICS:
        pattern = f"ray_{d.name}" + {"counter": "_total", "gauge": "",
                                     "histogram": "_count"}[d.kind]
        wait_for(lambda p=pattern: prom.query(f'count({{__name__="{p}"}})'),
                 f"a series of {pattern} before any request", 60, interval=0.5)
        if d.kind == "histogram":
            for model in MODELS:
                prom.wait_for(f'count({pattern}{{model="{model["name"]}"}}) > bool 0', 1)
                prom.wait_for(f'sum({pattern}{{model="{model["name"]}"}})', 0)


def ray_service_discovery_is_current() -> None:
    """prometheus-ray-cluster.yml reads Ray's discovery file: a running Ray head writes it.

    (Other tests' servers may run their own Ray at the same time, so which
    session's file the link points to is not checked.)
    """
    config = yaml.safe_load((REPO / "dashboards" / "prometheus-ray-cluster.yml").read_text())
    (path,) = config["scrape_configs"][0]["file_sd_configs"][0]["files"]
    wait_for(Path(path).exists, f"Ray to write {path}", 60, interval=0.5)
    assert Path(path).resolve().parent.name.startswith("session_")
    assert yaml.safe_load(Path(path).read_text())[0]["targets"]
