"""Prometheus metrics: one table of definitions, how values reach Ray, /metrics text.

Every metric is declared once, in ``METRICS``. Deployments record through
``ray.serve.metrics`` and the cache-store actor through ``ray.util.metrics``;
Ray exports them on each node's metrics export port as ``ray_<name>``
(``_total`` added to counters). ``GET /metrics`` on the API port serves the
same families gathered from every node's export, so one set of dashboards
works with either scrape.

Latency histograms are observed where the event happens. Everything else is
already counted in plain stats dataclasses (engine, prefix cache, tiers); a
``MetricsPump`` thread reads those every second and turns them into samples,
so the engine and the cache store stay free of Ray and of metric code.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from serve_app.cache.match import Tier
from serve_app.models.compat import record_metric_zero

if TYPE_CHECKING:  # the engine imports MLX; the store and the ingress load this module
    pass

logger = logging.getLogger(__name__)

EXPORT_PREFIX = "ray_"  # what Ray's exporter puts in front of every name
PUMP_INTERVAL_S = 1.0

TIERS = tuple(Tier)
MISS_REASONS = ("new_prefix", "diverged", "evicted", "no_checkpoint", "incompatible",
                "restore_failed", "disabled", "store_unavailable", "oversized_snapshot_skipped")
WRITE_RESULTS = ("done", "failed", "dropped")
PHASES = ("prepare", "plan", "queue", "prefill")
DROP_REASONS = ("publish", "hot_full", "ssd_low_space", "ssd_budget", "ssd_write_budget")
ROUTING_REASONS = ("prefix", "load_fallback", "no_prefix", "unranked", "router_error")

Kind = Literal["counter", "gauge", "histogram"]
Where = Literal["ingress", "router", "replica", "store"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric: its Ray name (without prefix or ``_total``), kind, help and labels."""

    name: str
    kind: Kind
    where: Where
    help: str
    labels: tuple[str, ...] = ("model",)
    buckets: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name Prometheus sees (``_bucket``/``_sum``/``_count`` for histograms)."""
        return EXPORT_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


def _c(name: str, where: Where, help: str, labels: tuple[str, ...] = ("model",)) -> MetricDef:
    return MetricDef(name, "counter", where, help, labels)


def _g(name: str, where: Where, help: str, labels: tuple[str, ...] = ("model",)) -> MetricDef:
    return MetricDef(name, "gauge", where, help, labels)


def _h(name: str, help: str, buckets: tuple[float, ...],
       labels: tuple[str, ...] = ("model",)) -> MetricDef:
    return MetricDef(name, "histogram", "replica", help, labels, buckets)


METRICS: tuple[MetricDef, ...] = (
    # ---- serving
    _c("serve_app_requests", "ingress",
       "Completion requests answered, by HTTP status (`unknown` model for requests naming none "
       "we serve).", ("model", "status")),
    _c("serve_app_request_retries", "ingress",
       "Requests sent again to another replica because theirs went away (its node died) "
       "before answering anything.", ("model",)),
    _c("serve_app_resumed_requests", "ingress",
       "Requests whose replica went away mid-answer, continued on another after the tokens "
       "already sent (the client sees one answer).", ("model",)),
    _c("serve_app_resumed_prefill_tokens", "ingress",
       "Tokens the replicas continuing requests had to prefill again (the prompt and tokens "
       "so far, less what their cache tiers restored): what losing a node costs.",
       ("model",)),
    _h("serve_app_time_to_first_token_seconds",
       "From arrival at the model replica to the first generated token.", TTFT_BUCKETS),
    _h("serve_app_request_phase_seconds",
       "Where the time to first token goes, by phase: `prepare` (templating, tokenizing), "
       "`plan` (prefix-cache lookup and fetch), `queue` (waiting for a batch slot, building "
       "the restored cache), `prefill` (from joining the batch to the first token).",
       TTFT_BUCKETS, ("model", "phase")),
    _h("serve_app_inter_token_latency_seconds",
       "Between consecutive generated tokens of a request, as the engine produced them.",
       ITL_BUCKETS),
    _h("serve_app_request_duration_seconds",
       "From arrival at the model replica to the request's end (finished, stopped, cancelled).",
       E2E_BUCKETS),
    _c("serve_app_prompt_tokens", "replica", "Prompt tokens of admitted requests."),
    _c("serve_app_generation_tokens", "replica", "Tokens generated."),
    _g("serve_app_running_requests", "replica", "Requests in the running batch."),
    _g("serve_app_queued_requests", "replica", "Admitted requests waiting for a batch slot."),
    _c("serve_app_rejected_requests", "replica",
       "Requests refused with 429, by reason: `queue_full` (the model's queue was full), "
       "`kv_budget` (the request's KV alone is over the model's KV budget in the memory "
       "plan).", ("model", "reason")),
    _c("serve_app_reasoning_tokens", "replica",
       "Tokens a thinking model generated inside its thoughts (their markers included); "
       "part of `serve_app_generation_tokens`."),
    _c("serve_app_history_ahead_requests", "replica",
       "Turns of a thinking model after which the next turn's prefix (the history as the "
       "template renders it next time, without this turn's thought) was prefilled ahead, by "
       "outcome: `done`, `not_needed` (the template keeps the turn as generated), `busy` "
       "(no free batch slot: skipped), `failed`.", ("model", "outcome")),
    _c("serve_app_history_ahead_prefilled_tokens", "replica",
       "Tokens prefilled ahead of a thinking model's next turn (the part of its history the "
       "cache did not hold): what keeping the next turn's prefix cached costs."),
    _c("serve_app_images", "replica",
       "Images served to a vision model, by where their features came from: `encoded` (the "
       "vision tower ran), `feature_cache` (the tower's cached output for the same image), "
       "`prefix_cache` (the restored prefix held the image's tokens: no features needed).",
       ("model", "source")),
    _c("serve_app_image_encoder_seconds", "replica",
       "Seconds the vision tower spent encoding images (on the engine thread, between decode "
       "steps)."),
    _c("serve_app_pooling_inputs", "replica",
       "Inputs an embedding or rerank model ran (texts, token lists or query-document pairs), "
       "by task (`embed`, `rerank`).", ("model", "task")),
    _c("serve_app_pooling_tokens", "replica",
       "Tokens an embedding or rerank model ran (without padding).", ("model", "task")),
    _h("serve_app_pooling_batch_requests",
       "Requests one model call of an embedding or rerank model took together (Ray Serve's "
       "@serve.batch gathers those that arrive together).", (1, 2, 4, 8, 16, 32, 64, 128)),
    _h("serve_app_pooling_batch_seconds",
       "Seconds one model call of an embedding or rerank model took (every input of its "
       "requests, sorted by length, on the model's one MLX thread).", ITL_BUCKETS),
    _c("serve_app_speculative_verify_steps", "replica",
       "Decode steps that verified drafted tokens (speculative decoding), by draft method "
       "(`off` for a model without speculation).", ("model", "method")),
    _c("serve_app_speculative_drafting_rows", "replica",
       "Requests that drafted in a verify step, one per request per step: accepted tokens "
       "over this is the accepted length per step.", ("model", "method")),
    _c("serve_app_speculative_drafted_tokens", "replica",
       "Tokens drafted for verification.", ("model", "method")),
    _c("serve_app_speculative_accepted_tokens", "replica",
       "Drafted tokens the model agreed with (each saved one decode step).",
       ("model", "method")),
    _g("serve_app_speculating_rows", "replica",
       "Requests that drafted in the last decode step."),
    _c("serve_app_rank_step_seconds", "replica",
       "Seconds each rank of a model spent in its steps, collectives included (a model in "
       "one process is its own rank 0; one sharded over ranks, `parallel:`, has several).",
       ("model", "rank")),
    _c("serve_app_rank_collective_seconds", "replica",
       "A model sharded over ranks: seconds each rank spent on the engine's command "
       "channel (rank 0 sending each step's commands, the others waiting for them).",
       ("model", "rank")),
    _g("serve_app_kv_bytes_per_token", "replica",
       "Bytes one token's K/V takes in the model's attention layers as the model holds it "
       "(in the running batch and on every tier of the prefix cache), by `format`: `float`, "
       "or quantized (`kv_cache.bits`: `q8g64` is 8 bits in groups of 64).",
       ("model", "format")),
    _g("serve_app_kv_waiting_requests", "replica",
       "Admitted requests waiting for the running requests to free KV (the model's KV "
       "budget in the memory plan)."),
    _g("serve_app_memory_bytes", "replica",
       "A model's memory by kind: the plan's `weights`, `kv` (a full batch at full context) "
       "and `hot_share` (its share of the hot tier), its `kv_budget` (what its running "
       "requests may reserve), `kv_in_use` (what they reserve now), and MLX's `wired_limit` "
       "and `cache_limit` as set on Metal (absent where the plan is advisory), and the "
       "replica process's resident memory `process_rss` (Linux). `weights`, `kv` and "
       "`kv_budget` are 0 while the model pool has the model unloaded.",
       ("model", "kind")),
    # ---- the model pool (serve_app/deploy/pool.py): what each model's replica did for it
    _g("serve_app_model_loaded", "replica",
       "1 while a model is loaded in its replica, 0 while the model pool has it unloaded."),
    _c("serve_app_model_loads", "replica",
       "Times the model pool loaded a model after start (on a request for it)."),
    _c("serve_app_model_load_seconds", "replica",
       "Seconds the model pool's loads took (load and warm-up; with `model_loads`, the "
       "mean)."),
    _c("serve_app_model_unloads", "replica",
       "Times the model pool unloaded a model, by reason: `capacity` (to make room for "
       "another), `idle` (its `idle_unload_s` passed without requests).",
       ("model", "reason")),
    _c("serve_app_normalized_requests", "replica",
       "Requests whose prompt a normalization rule changed before templating (a client quirk "
       "that would defeat the prefix cache, such as Claude Code's rotating billing header), "
       "by rule.", ("model", "rule")),
    # ---- prefix cache (as seen by the replicas)
    _c("serve_app_prefix_cache_lookups", "replica", "Prefix-cache lookups (one per request)."),
    _c("serve_app_prefix_cache_hit_tokens", "replica",
       "Prompt tokens restored from the cache, by the tier each block came from.",
       ("model", "tier")),
    _c("serve_app_prefix_cache_missed_tokens", "replica", "Prompt tokens that were prefilled."),
    _c("serve_app_prefix_cache_trim_hits", "replica",
       "Restores that cut a stored block or tail to the tokens it shares with the prompt "
       "(attention-only models: a request that diverges inside a block)."),
    _c("serve_app_prefix_cache_misses", "replica",
       "Lookups that restored less than the prompt's full blocks, by reason.",
       ("model", "reason")),
    _c("serve_app_prefix_cache_busts", "replica",
       "Prompts that left a long cached prompt within its first 10% and rejoined it a few "
       "tokens later (a timestamp or counter near the start of the prompt defeats the cache), "
       "by the token position bucket where they left it.", ("model", "position")),
    _c("serve_app_prefix_cache_walkbacks", "replica",
       "Blocks a hybrid-model restore stepped back over for lack of a valid recurrent "
       "checkpoint."),
    _c("serve_app_prefix_cache_checkpoint_loads", "replica",
       "Recurrent-state (GDN) checkpoints restored, by the tier they came from.",
       ("model", "tier")),
    _c("serve_app_prefix_cache_checkpoint_decode_failures", "replica",
       "Checkpoints rejected on restore (unreadable, undecodable or not finite)."),
    _c("serve_app_prefix_cache_captured_tokens", "replica",
       "Tokens of the blocks captured into the cache."),
    _c("serve_app_prefix_cache_checkpoint_bytes", "replica",
       "Bytes of recurrent-state (GDN) checkpoints captured; per captured token, the cost of "
       "caching a hybrid model."),
    _c("serve_app_prefix_cache_incompatible_payloads", "replica",
       "Cached blocks or checkpoints rejected because their shapes or dtypes did not fit the "
       "model's layout (dropped, never restored)."),
    _c("serve_app_prefix_cache_restore_failures", "replica",
       "Restores that failed while building the cache; the request was prefilled cold."),
    _c("serve_app_prefix_cache_inflight_waits", "replica",
       "Lookups that first waited for blocks another request was prefilling (requests that "
       "arrive together with a new shared prefix compute it once, then restore it)."),
    _c("serve_app_prefix_cache_inflight_wait_seconds", "replica",
       "Seconds those lookups waited."),
    _c("serve_app_prefix_cache_store_errors", "replica",
       "Cache-store calls a request waited on (lookup, release) that did not answer in time "
       "(`timeout`), found the store actor dead or restarting (`unavailable`), failed otherwise "
       "(`error`), or were not made because the store's circuit breaker was open (`skipped`). "
       "A failed lookup is a cold prefill (miss reason `store_unavailable`), never a failed "
       "request.", ("model", "kind")),
    _c("serve_app_prefix_cache_ssd_read_bytes", "replica",
       "Bytes of SSD block files read for restores."),
    _c("serve_app_prefix_cache_ssd_read_seconds", "replica",
       "Seconds spent reading SSD block files for restores."),
    # ---- the cluster: routing on cached prefixes, blocks fetched from other nodes
    _c("serve_app_routing_decisions", "router",
       "Requests routed by the prefix-affinity router, by reason: `prefix` (to the replica with "
       "the least to prefill, whose node holds part of the prompt), `load_fallback` (another "
       "replica, for load), `no_prefix` (no node holds any of the prompt: least loaded), "
       "`unranked` (no replica has reported its cache layout yet: least loaded), "
       "`router_error` (ranking failed: the least loaded replica; logged once). Each reason "
       "is 0 from the router's start (a model's first request); a model not routed on "
       "prefixes (one replica, or `routing.mode: default`) has no such router: no series.",
       ("model", "reason")),
    _c("serve_app_remote_fetch_blocks", "replica",
       "Blocks fetched from another node's cache store instead of prefilled."),
    _c("serve_app_remote_fetch_bytes", "replica", "Bytes of blocks fetched from other nodes."),
    _c("serve_app_remote_fetch_seconds", "replica",
       "Seconds spent fetching blocks from other nodes."),
    _c("serve_app_remote_fetch_failures", "replica",
       "Fetches from another node that brought nothing usable (the node died, answered late, "
       "or sent blocks that did not fit): the request prefilled those tokens instead."),
    _c("serve_app_remote_fetch_skipped", "replica",
       "Times another node held more of a prompt but prefilling was cheaper than fetching, by "
       "measured bandwidth and prefill rate."),
    # ---- capacity (the node's cache store)
    _g("serve_app_cache_bytes", "store",
       "Bytes held, by tier and kind (`block`: KV, with the recurrent state in the hot tier; "
       "`sidecar`: GDN state files on SSD).", ("model", "tier", "kind")),
    _g("serve_app_cache_entries", "store", "Blocks or sidecar files held, by tier and kind.",
       ("model", "tier", "kind")),
    _g("serve_app_cache_budget_bytes", "store",
       "Byte budget of each tier (`staging` is the write-behind buffer).", ("tier",)),
    _c("serve_app_cache_evictions", "store", "Entries evicted to stay within budget, by tier.",
       ("model", "tier")),
    # ---- staging (write-behind to SSD)
    _g("serve_app_cache_staging_pending_bytes", "store", "Bytes waiting to be written to SSD.",
       ()),
    _g("serve_app_cache_staging_peak_pending_bytes", "store",
       "Highest pending bytes since the store started.", ()),
    _c("serve_app_cache_staging_backpressure_seconds", "store",
       "Seconds producers waited because staging was full.", ()),
    _c("serve_app_cache_staging_inline_writes", "store",
       "Writes done by the producer itself because staging stayed full.", ()),
    _c("serve_app_cache_oversized_snapshot_blocks", "store",
       "Blocks kept out of RAM because their conversation is larger than its model's share "
       "of the hot tier (`oversized_snapshot_skipped`): written to SSD only, or dropped "
       "without an SSD tier.", ()),
    _c("serve_app_cache_staging_writes", "store",
       "SSD writes by result (`dropped`: skipped for the free-space floor, a budget full of "
       "pinned files or the hourly write budget; a full staging buffer waits, never drops).",
       ("result",)),
    _c("serve_app_cache_dropped_blocks", "store",
       "Blocks or sidecars dropped instead of stored, by reason: `publish` (a replica could not "
       "hand it to the store), `hot_full` (pinned blocks fill the hot tier and no SSD tier), "
       "`ssd_low_space` (free-space floor), `ssd_budget` (SSD budget full of pinned files), "
       "`ssd_write_budget` (`cache_store.ssd_write_budget_per_hour` spent: SSD wear).",
       ("reason",)),
    _c("serve_app_cache_ssd_written_bytes", "store",
       "Bytes of block and sidecar files written to SSD (what wears the drive).", ()),
    _g("serve_app_cache_ssd_write_budget_bytes", "store",
       "Bytes the SSD tier may write in any rolling hour "
       "(`cache_store.ssd_write_budget_per_hour`).", ()),
)

DEFS: dict[str, MetricDef] = {d.name: d for d in METRICS}

# Labelled counters recorded at events, not pumped from stats (those are sampled at 0
# from fresh stats): the label sets the recording process exports at 0 when it starts,
# so a dashboard shows 0 before the first event, not "no data".
# The label sets beyond ``model`` of each histogram, filled in at zero in ``/metrics``
# until observed (``metrics/exposition.py``); a histogram not named here has ``model`` only.
HISTOGRAM_SERIES: dict[str, tuple[dict[str, str], ...]] = {
    "serve_app_request_phase_seconds": tuple({"phase": p} for p in PHASES),
}
ZERO_AT_START: dict[str, tuple[dict[str, str], ...]] = {
    "serve_app_requests": ({"status": "200"},),
    "serve_app_request_retries": ({},),
    "serve_app_resumed_requests": ({},),
    "serve_app_resumed_prefill_tokens": ({},),
    "serve_app_routing_decisions": tuple({"reason": r} for r in ROUTING_REASONS),
}


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


# ---- where values go ----------------------------------------------------------------------


class Recorder:
    """Where metric values go. This base drops them (no Ray: tests, benchmarks)."""

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None:
        pass

    def zero(self, name: str, labels: dict[str, str]) -> None:
        """Export a counter at 0, so a label set we know exists before its first event."""

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        pass

    def observe(self, name: str, value: float, labels: dict[str, str]) -> None:
        pass


def zero_at_start(recorder: Recorder, where: Where, model: str) -> None:
    """Export at 0 the known series of ``model`` that a process of kind ``where``
    records at events (``ZERO_AT_START``)."""
    for name, label_sets in ZERO_AT_START.items():
        if DEFS[name].where == where:
            for labels in label_sets:
                recorder.zero(name, {"model": model, **labels})


class RayRecorder(Recorder):
    """Ray metric objects for the definitions recorded in one kind of process.

    ``serve=True`` uses ``ray.serve.metrics``, which adds the deployment,
    replica and application labels; the cache-store actor uses plain
    ``ray.util.metrics``.
    """

    def __init__(self, where: Where, serve: bool) -> None:
        # Two modules with the same three classes, so typed as a module (ray.serve.metrics
        # also types tag_keys as a 1-tuple where ray.util.metrics takes any tuple).
        mod = importlib.import_module("ray.serve.metrics" if serve else "ray.util.metrics")
        self._metrics: dict[str, Any] = {}
        for d in METRICS:
            if d.where != where:
                continue
            if d.kind == "counter":
                m = mod.Counter(d.name, description=d.help, tag_keys=d.labels)
            elif d.kind == "gauge":
                m = mod.Gauge(d.name, description=d.help, tag_keys=d.labels)
            else:
                m = mod.Histogram(d.name, description=d.help, boundaries=list(d.buckets),
                                  tag_keys=d.labels)
            self._metrics[d.name] = m

    def inc(self, name: str, value: float, labels: dict[str, str]) -> None:
        if value > 0:
            self._metrics[name].inc(value, labels)

    def zero(self, name: str, labels: dict[str, str]) -> None:
        # Ray's public ``inc`` refuses 0; recording 0 is how Prometheus clients
        # initialize a known series (a Ray internal: see serve_app.models.compat).
        try:
            record_metric_zero(self._metrics[name], labels)
        except Exception:  # a Ray without it: the series appears at its first event
            logger.debug("cannot initialize %s at 0", name, exc_info=True)

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metrics[name].set(value, labels)

    def observe(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metrics[name].observe(value, labels)


class MetricsPump:
    """Publishes samples read from stats every ``interval`` seconds, on its own thread.

    Stats hold cumulative totals; a counter is incremented by the difference
    since the last reading (a total that went down means the stats restarted).
    """

    def __init__(self, recorder: Recorder, read: Callable[[], Iterable[Sample]],
                 interval: float = PUMP_INTERVAL_S, name: str = "metrics-pump",
                 also: Callable[[], None] | None = None) -> None:
        self.recorder = recorder
        self.read = read
        self.also = also  # run after each publish, on this thread (a replica's report)
        self.interval = interval
        self._last: dict[tuple, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> MetricsPump:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def publish(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            if DEFS[s.name].kind == "gauge":
                self.recorder.set(s.name, s.value, s.labels)
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            last = self._last.get(key)
            if last is None and s.value == 0:
                self.recorder.zero(s.name, s.labels)
            elif last is None or s.value < last:
                self.recorder.inc(s.name, s.value, s.labels)
            elif s.value > last:
                self.recorder.inc(s.name, s.value - last, s.labels)
            self._last[key] = s.value

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish(self.read())
            except Exception:
                logger.exception("publishing metrics failed")
            if self.also is not None:
                try:
                    self.also()
                except Exception:
                    logger.exception("%s failed", getattr(self.also, "__name__", "a step"))
            self._stop.wait(self.interval)


# ---- stats to samples ---------------------------------------------------------------------


# ---- /metrics on the API port -------------------------------------------------------------


# ---- documentation ------------------------------------------------------------------------


def markdown_table() -> str:
    """The metrics table of docs/metrics.md; a test keeps the page equal to this."""
    rows = ["| Metric (as Prometheus sees it) | Type | Labels | Recorded by | Meaning |",
            "|---|---|---|---|---|"]
    for d in METRICS:
        labels = ", ".join(f"`{label}`" for label in d.labels) or "-"
        rows.append(f"| `{d.exported}` | {d.kind} | {labels} | {d.where} | {d.help} |")
    return "\n".join(rows) + "\n"
