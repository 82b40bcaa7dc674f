"""Grafana dashboards for serve_app, built with grafana-foundation-sdk.

Run ``python -m dashboards.generate`` after changing a panel; it rewrites the
JSON files next to this one, which are committed so users can import them
without Python. A test regenerates them and fails if the committed JSON
differs, and runs every panel's query against a real Prometheus.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

HERE = Path(__file__).parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model=~"$model"'
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    kind: str = "timeseries"  # or "stat"


def rate(metric: str, by: str, selector: str = MODEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}{RATE}))"


def quantiles(metric: str) -> tuple[Query, ...]:
    return tuple(
        Query(f"histogram_quantile({q}, sum by (le, model) "
              f"(rate({metric}_bucket{{{MODEL}}}{RATE})))", f"p{int(q * 100)} {{{{model}}}}")
        for q in (0.5, 0.95))


def ratio(numerator: str, denominator: str) -> str:
    """A ratio of rates that reads 0, not NaN, while there is no traffic."""
    return f"({numerator}) / clamp_min({denominator}, 1e-9)"


HIT = rate("ray_serve_app_prefix_cache_hit_tokens_total", "model")
MISSED = rate("ray_serve_app_prefix_cache_missed_tokens_total", "model")
CHECKPOINT_BYTES = rate("ray_serve_app_prefix_cache_checkpoint_bytes_total", "model")
CAPTURED_TOKENS = rate("ray_serve_app_prefix_cache_captured_tokens_total", "model")

SERVING = (
    PanelSpec("Requests by status", "reqps", (
        Query(rate("ray_serve_app_requests_total", "model, status"),
              "{{model}} {{status}}"),
        Query(rate("ray_serve_app_request_retries_total", "model"),
              "{{model}} sent again (replica lost)"),
        Query(rate("ray_serve_app_resumed_requests_total", "model"),
              "{{model}} continued (replica lost mid-answer)")),
        "Sent again: a request whose replica went away before answering, sent to another. "
        "Continued: one whose replica went away mid-answer, continued on another."),
    PanelSpec("Prefilled again after a lost replica", "short", (
        Query(rate("ray_serve_app_resumed_prefill_tokens_total", "model"), "{{model}}"),),
        "Tokens the replicas continuing requests prefilled again (prompt and tokens so far, "
        "less what their cache restored)."),
    PanelSpec("Time to first token", "s", quantiles("ray_serve_app_time_to_first_token_seconds"),
              "From arrival at the model replica to the first token."),
    PanelSpec("Time to first token by phase (p50)", "s", (
        Query("histogram_quantile(0.5, sum by (le, model, phase) "
              f"(rate(ray_serve_app_request_phase_seconds_bucket{{{MODEL}}}{RATE})))",
              "{{model}} {{phase}}"),),
        "prepare: template and tokenize; plan: cache lookup and fetch; queue: batch slot and "
        "restore; prefill: to the first token."),
    PanelSpec("Inter-token latency", "s",
              quantiles("ray_serve_app_inter_token_latency_seconds")),
    PanelSpec("End-to-end latency", "s", quantiles("ray_serve_app_request_duration_seconds")),
    PanelSpec("Tokens per second", "short", (
        Query(rate("ray_serve_app_prompt_tokens_total", "model"), "prompt {{model}}"),
        Query(rate("ray_serve_app_generation_tokens_total", "model"), "generated {{model}}"))),
    PanelSpec("Speculative decoding: tokens per verify step and acceptance", "short", (
        Query("1 + " + ratio(rate("ray_serve_app_speculative_accepted_tokens_total",
                                  "model, method"),
                             rate("ray_serve_app_speculative_drafting_rows_total",
                                  "model, method")),
              "tokens per step {{model}} {{method}}"),
        Query(ratio(rate("ray_serve_app_speculative_accepted_tokens_total", "model, method"),
                    rate("ray_serve_app_speculative_drafted_tokens_total", "model, method")),
              "acceptance {{model}} {{method}}"),
        Query(rate("ray_serve_app_speculative_verify_steps_total", "model, method"),
              "verify steps/s {{model}} {{method}}"),
        Query(f"sum by (model) (ray_serve_app_speculating_rows{{{MODEL}}})",
              "drafting rows {{model}}")),
        "Per drafting request and verify step: tokens emitted (1 + drafts kept) and the "
        "share of drafted tokens kept; verify steps a second; requests drafting now. "
        "Adaptive depth stops drafting where a verify costs more than it saves."),
    PanelSpec("Thinking models: thought tokens and the next turn's history prefilled ahead",
              "short", (
        Query(rate("ray_serve_app_reasoning_tokens_total", "model"), "thought {{model}}"),
        Query(rate("ray_serve_app_generation_tokens_total", "model"), "generated {{model}}"),
        Query(rate("ray_serve_app_history_ahead_prefilled_tokens_total", "model"),
              "prefilled ahead {{model}}"),
        Query(rate("ray_serve_app_history_ahead_requests_total", "model, outcome"),
              "turns ahead/s {{model}} {{outcome}}")),
        "Tokens a second generated inside thoughts against all generated; tokens a second "
        "prefilled ahead of the next turn (its history without this turn's thought, which "
        "the template drops), and turns a second by outcome."),
    PanelSpec("Vision models: images a second by where their features came from, encoder time",
              "short", (
        Query(rate("ray_serve_app_images_total", "model, source"),
              "images/s {{model}} {{source}}"),
        Query(rate("ray_serve_app_image_encoder_seconds_total", "model"),
              "encoder s/s {{model}}")),
        "Images a second: encoded by the vision tower, taken from its feature cache (the same "
        "image again), or covered by the restored prefix (the prefix cache keys image tokens "
        "by content); seconds a second the tower spent encoding (engine thread)."),
    PanelSpec("Embedding and rerank models: inputs and tokens a second", "short", (
        Query(rate("ray_serve_app_pooling_inputs_total", "model, task"),
              "inputs/s {{model}} {{task}}"),
        Query(rate("ray_serve_app_pooling_tokens_total", "model, task"),
              "tokens/s {{model}} {{task}}")),
        "Texts, token lists or query-document pairs a second that embedding and rerank "
        "models ran, and their tokens (without padding)."),
    PanelSpec("Embedding and rerank models: requests per model call, seconds per call", "s", (
        *quantiles("ray_serve_app_pooling_batch_seconds"),
        Query("histogram_quantile(0.5, sum by (le, model) (rate("
              f"ray_serve_app_pooling_batch_requests_bucket{{{MODEL}}}{RATE})))",
              "p50 requests a call {{model}}")),
        "How long one model call takes (all of its requests' inputs, sorted by length), and "
        "how many requests Ray Serve's @serve.batch gathered into it (median)."),
    PanelSpec("Sharded models: time in steps and on the command channel, by rank", "s", (
        Query(rate("ray_serve_app_rank_step_seconds_total", "model, rank"),
              "steps {{model}} rank {{rank}}"),
        Query(rate("ray_serve_app_rank_collective_seconds_total", "model, rank"),
              "channel {{model}} rank {{rank}}")),
        "Seconds a second each rank of a model sharded over ranks (parallel:) spends in the "
        "model's steps (collectives included) and on the engine's command channel: rank 0 "
        "sending each step's commands, the others waiting for them (a rank that waits "
        "while the others compute shows here)."),
    PanelSpec("Running batch and queue", "short", (
        Query(f"sum by (model) (ray_serve_app_running_requests{{{MODEL}}})",
              "running {{model}}"),
        Query(f"sum by (model) (ray_serve_app_queued_requests{{{MODEL}}})", "queued {{model}}"))),
    PanelSpec("Rejected (queue full, KV budget)", "reqps", (
        Query(rate("ray_serve_app_rejected_requests_total", "model, reason"),
              "{{model}} {{reason}}"),)),
    PanelSpec("Memory by model", "bytes", (
        Query(f"sum by (model, kind) (ray_serve_app_memory_bytes{{{MODEL}}})",
              "{{model}} {{kind}}"),),
        "The memory plan per model: weights, kv (a full batch at full context), hot_share "
        "(its part of the hot tier), kv_budget (what its running requests may reserve), "
        "kv_in_use (what they reserve now); wired_limit and cache_limit as set on Metal; "
        "process_rss (the replica process). Weights and KV are 0 while a model is unloaded."),
    PanelSpec("Model pool: loaded models, loads and unloads", "short", (
        Query(f"max by (model) (ray_serve_app_model_loaded{{{MODEL}}})", "loaded {{model}}"),
        Query(f"sum by (model) (increase(ray_serve_app_model_loads_total{{{MODEL}}}[5m]))",
              "loads {{model}}"),
        Query(f"sum by (model, reason) (increase(ray_serve_app_model_unloads_total"
              f"{{{MODEL}}}[5m]))", "unloads {{model}} {{reason}}")),
        "1 while a model is in memory; loads and unloads by the model pool in the last 5 "
        "minutes (unloads by reason: capacity, idle)."),
    PanelSpec("Model load time (mean)", "s", (
        Query(ratio(f"sum by (model) (increase(ray_serve_app_model_load_seconds_total"
                    f"{{{MODEL}}}[15m]))",
                    f"sum by (model) (increase(ray_serve_app_model_loads_total{{{MODEL}}}"
                    "[15m]))"), "{{model}}"),),
        "What a request that finds its model unloaded waits for it (load and warm-up), "
        "over the last 15 minutes."),
    PanelSpec("Waiting for KV", "short", (
        Query(f"sum by (model) (ray_serve_app_kv_waiting_requests{{{MODEL}}})",
              "{{model}}"),),
        "Admitted requests waiting for running ones to free KV (the model's KV budget)."),
    PanelSpec("K/V bytes a token", "bytes", (
        Query(f"max by (model, format) (ray_serve_app_kv_bytes_per_token{{{MODEL}}})",
              "{{model}} {{format}}"),),
        "What one token's K/V weighs as each model holds it: float, or quantized "
        "(kv_cache.bits; q8g64 is 8 bits in groups of 64), in the batch and on every tier."),
)

PREFIX_CACHE = (
    PanelSpec("Prompt tokens served from cache", "percentunit", (
        Query(ratio(HIT, f"{HIT} + {MISSED}"), "{{model}}"),),
        "Hit tokens / (hit + prefilled) prompt tokens."),
    PanelSpec("Hit tokens by tier", "short", (
        Query(rate("ray_serve_app_prefix_cache_hit_tokens_total", "model, tier"),
              "{{model}} {{tier}}"),)),
    PanelSpec("Misses by reason", "short", (
        Query(rate("ray_serve_app_prefix_cache_misses_total", "model, reason"),
              "{{model}} {{reason}}"),)),
    PanelSpec("Lookups", "short", (
        Query(rate("ray_serve_app_prefix_cache_lookups_total", "model"), "{{model}}"),
        Query(rate("ray_serve_app_prefix_cache_trim_hits_total", "model"),
              "cut to the common prefix {{model}}"))),
    PanelSpec("Cache busters and normalized prompts", "short", (
        Query(rate("ray_serve_app_prefix_cache_busts_total", "model, position"),
              "left a cached prompt early, at {{position}} {{model}}"),
        Query(rate("ray_serve_app_normalized_requests_total", "model, rule"),
              "normalized by {{rule}} {{model}}")),
        "Prompts that left a long cached prompt in its first 10% and rejoined it: something "
        "near the prompt's start changes every request (see the replica's WARNING log and "
        "/v1/stats recent_cache_busts). Normalized: a known client quirk removed instead."),
    PanelSpec("Walkbacks and checkpoint decode failures", "short", (
        Query(rate("ray_serve_app_prefix_cache_walkbacks_total", "model"),
              "walkbacks {{model}}"),
        Query(rate("ray_serve_app_prefix_cache_checkpoint_decode_failures_total", "model"),
              "decode failures {{model}}"))),
    PanelSpec("Checkpoint bytes per 1K cached tokens", "bytes", (
        Query("1000 * " + ratio(CHECKPOINT_BYTES, CAPTURED_TOKENS), "{{model}}"),),
        "Recurrent-state checkpoint bytes captured per 1,000 tokens captured: what caching a "
        "hybrid model costs (0 for attention-only models). cache.checkpoint_interval lowers it."),
    PanelSpec("Rejected payloads and failed restores", "short", (
        Query(rate("ray_serve_app_prefix_cache_incompatible_payloads_total", "model"),
              "incompatible {{model}}"),
        Query(rate("ray_serve_app_prefix_cache_restore_failures_total", "model"),
              "restore failures {{model}}")),
        "Cached data that did not fit the model's layout, and restores that fell back to a "
        "cold prefill. Both should stay at 0."),
    PanelSpec("Waits for in-flight prefills", "short", (
        Query(rate("ray_serve_app_prefix_cache_inflight_waits_total", "model"),
              "waits {{model}}"),
        Query(rate("ray_serve_app_prefix_cache_inflight_wait_seconds_total", "model"),
              "seconds waited/s {{model}}")),
        "Lookups that waited for blocks another request was prefilling, then restored them "
        "instead of computing them again (requests that arrive together with a new shared "
        "prefix)."),
    PanelSpec("Cache-store errors", "short", (
        Query(rate("ray_serve_app_prefix_cache_store_errors_total", "model, kind"),
              "{{model}} {{kind}}"),),
        "Store calls a request waited on that timed out, found the store dead or restarting, "
        "failed, or were skipped while its circuit breaker was open: each such request was "
        "prefilled cold (never failed). Should stay at 0."),
    PanelSpec("GDN checkpoint loads by tier", "short", (
        Query(rate("ray_serve_app_prefix_cache_checkpoint_loads_total", "model, tier"),
              "{{model}} {{tier}}"),)),
    PanelSpec("Hot tier bytes", "bytes", (
        Query(f'sum by (model) (ray_serve_app_cache_bytes{{tier="hot", {MODEL}}})',
              "{{model}}"),
        Query('sum(ray_serve_app_cache_budget_bytes{tier="hot"})', "budget"))),
    PanelSpec("Hot tier blocks", "short", (
        Query(f'sum by (model) (ray_serve_app_cache_entries{{tier="hot", {MODEL}}})',
              "{{model}}"),)),
    PanelSpec("Evictions by tier", "short", (
        Query(rate("ray_serve_app_cache_evictions_total", "model, tier"),
              "{{model}} {{tier}}"),)),
    PanelSpec("Routing decisions by reason", "short", (
        Query(rate("ray_serve_app_routing_decisions_total", "model, reason"),
              "{{model}} {{reason}}"),),
        "Prefix-affinity routing (several replicas): to the replica with the least to "
        "prefill (`prefix`), elsewhere for load (`load_fallback`), no node held any of the "
        "prompt (`no_prefix`), or ranking failed and the least loaded got it (`router_error`)."),
    PanelSpec("Blocks fetched from other nodes", "short", (
        Query(rate("ray_serve_app_remote_fetch_blocks_total", "model"), "blocks {{model}}"),
        Query(rate("ray_serve_app_remote_fetch_failures_total", "model"),
              "failed fetches {{model}}"),
        Query(rate("ray_serve_app_remote_fetch_skipped_total", "model"),
              "skipped (prefill cheaper) {{model}}"))),
    PanelSpec("Cross-node fetch bandwidth", "Bps", (
        Query(ratio(rate("ray_serve_app_remote_fetch_bytes_total", "model"),
                    rate("ray_serve_app_remote_fetch_seconds_total", "model")), "{{model}}"),),
        "Bytes per second of fetch time: what the replicas weigh against their prefill rate."),
)

STAGING_SSD = (
    PanelSpec("SSD bytes", "bytes", (
        Query('sum by (kind) (ray_serve_app_cache_bytes{tier="ssd"})', "{{kind}}"),
        Query('sum(ray_serve_app_cache_budget_bytes{tier="ssd"})', "budget"))),
    PanelSpec("SSD files", "short", (
        Query('sum by (kind) (ray_serve_app_cache_entries{tier="ssd"})', "{{kind}}s"),)),
    PanelSpec("Staging pending bytes", "bytes", (
        Query("sum(ray_serve_app_cache_staging_pending_bytes)", "pending"),
        Query("max(ray_serve_app_cache_staging_peak_pending_bytes)", "peak"),
        Query('sum(ray_serve_app_cache_budget_bytes{tier="staging"})', "budget"))),
    PanelSpec("SSD writes by result", "short", (
        Query('sum by (result) (rate(ray_serve_app_cache_staging_writes_total[$__rate_interval]))',
              "{{result}}"),)),
    PanelSpec("Dropped blocks by reason", "short", (
        Query('sum by (reason) (rate(ray_serve_app_cache_dropped_blocks_total'
              '[$__rate_interval]))', "{{reason}}"),),
        "Blocks or sidecars dropped instead of stored: a replica could not publish, the hot "
        "tier was full of pinned blocks with no SSD tier, or an SSD write was skipped (free-space "
        "floor, budget full of pinned files, hourly write budget spent)."),
    PanelSpec("SSD bytes written per hour (wear)", "bytes", (
        Query("sum(increase(ray_serve_app_cache_ssd_written_bytes_total[1h]))",
              "written in the last hour"),
        Query("sum(ray_serve_app_cache_ssd_write_budget_bytes)", "budget per hour")),
        "What the SSD tier wrote in the last hour against cache_store.ssd_write_budget_per_hour; "
        "writes over the budget are dropped (reason ssd_write_budget)."),
    PanelSpec("Staging backpressure", "short", (
        Query("sum(rate(ray_serve_app_cache_staging_backpressure_seconds_total"
              "[$__rate_interval]))", "seconds waited per second"),
        Query("sum(rate(ray_serve_app_cache_staging_inline_writes_total[$__rate_interval]))",
              "inline writes per second"),
        Query("sum(rate(ray_serve_app_cache_oversized_snapshot_blocks_total"
              "[$__rate_interval]))", "blocks kept out of RAM (oversized) per second"))),
    PanelSpec("SSD restore reads", "Bps", (
        Query(rate("ray_serve_app_prefix_cache_ssd_read_bytes_total", "model"), "{{model}}"),)),
    PanelSpec("SSD restore read time", "percentunit", (
        Query(rate("ray_serve_app_prefix_cache_ssd_read_seconds_total", "model"),
              "{{model}} (seconds per second)"),)),
)

DASHBOARDS = {
    "serving": ("serve_app / Serving", SERVING),
    "prefix-cache": ("serve_app / Prefix cache and tiers", PREFIX_CACHE),
    "staging-ssd": ("serve_app / Staging and SSD", STAGING_SSD),
}


def _panel(spec: PanelSpec, index: int):
    if spec.kind == "stat":
        builder = (stat.Panel().graph_mode(BigValueGraphMode.NONE)
                   .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"])))
    else:
        builder = (timeseries.Panel()
                   .legend(common.VizLegendOptions().show_legend(True)
                           .display_mode(LegendDisplayMode.LIST)
                           .placement(LegendPlacement.BOTTOM).calcs([]))
                   .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI)
                            .sort(SortOrder.DESCENDING)))
    builder = (builder.title(spec.title).unit(spec.unit).datasource(DATASOURCE)
               .grid_pos(GridPos(h=8, w=12, x=(index % 2) * 12, y=(index // 2) * 8)))
    if spec.description:
        builder = builder.description(spec.description)
    for i, q in enumerate(spec.queries):
        builder = builder.with_target(
            prometheus.Dataquery().expr(q.expr).legend_format(q.legend)
            .ref_id(chr(ord("A") + i)).datasource(DATASOURCE))
    return builder


def build(key: str) -> dict:
    title, panels = DASHBOARDS[key]
    board = (
        dashboard.Dashboard(title)
        .uid(f"serve-app-{key}")
        .tags(["serve_app", "generated"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus")
                       .type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model").label("Model").datasource(DATASOURCE)
            .query("label_values(ray_serve_app_prompt_tokens_total, model)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True).include_all(True).all_value(".*"))
    )
    for i, spec in enumerate(panels):
        board = board.with_panel(_panel(spec, i))
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def render(key: str) -> str:
    return json.dumps(build(key), indent=2, sort_keys=True) + "\n"


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a dashboard's JSON."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def concrete(expr: str, rate_interval: str = "1m") -> str:
    """A panel query as Prometheus runs it with every model selected."""
    return re.sub(r"\$__rate_interval", rate_interval, expr).replace("$model", ".*")


def main() -> None:
    for key in DASHBOARDS:
        (HERE / f"{key}.json").write_text(render(key))
        print(f"wrote {HERE / f'{key}.json'}")


if __name__ == "__main__":
    main()
