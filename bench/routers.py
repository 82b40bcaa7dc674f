"""Cluster routing against Ray's own routers, and a node lost mid-run.

The workload is kv-cache-tester's agent traces (``bench.traces``: Claude Code sessions,
each turn the whole conversation so far, one shared system prompt), ``--sessions`` at once
(two load levels), on a Ray cluster of simulated nodes on this machine
(``ray.cluster_utils.Cluster``: 3 and 4 nodes, one replica per node, each node its own
SSD directory), once per router, each on the same deployments, side by side in one run:

- ``pow2``: Ray Serve's default power-of-two-choices router (``routing.mode: default``);
- ``ray_prefix``: Ray's ``PrefixCacheAffinityRouter`` (``ray.serve.llm``), its own
  defaults, reading our requests' messages as the dicts it expects
  (``serve_app.cluster.ray_routers``);
- ``ours``: our block-hash prefix router with the cluster's block directory and
  cross-node fetch (``routing.mode: prefix``).

``KVAwareRouter`` is not an arm: it scores only through the ``KVTokenTracker`` that Ray's
own ``LLMRouter`` ingress builds in its process (anywhere else ``choose_replicas`` picks a
random replica: ``ray/llm/_internal/serve/routing_policies/kv_aware/kv_aware_router.py``),
and that tracker needs ai-dynamo's ``SelectionService`` fed by each engine's vLLM-format KV
events over ZMQ. The report says so.

Per run: TTFT p50/p90/p99 (streamed), cached prompt fraction, output tok/s, requests per
node, identical answers across routers (temperature 0). ``--repeat N`` runs every arm N
times (each repeat all arms in turn, each on a fresh cluster) and reports, per nodes,
sessions and router, the median and min-max range of TTFT p50 over the repeats, and the
ratios ours / Ray's best arm and ours / pow2 of the medians with each repeat's ratio
(``aggregate_repeats``, ``compare_repeats``); the JSON keeps every repeat's rows.

Then ``node_loss``: ours, 3 nodes, the higher load's sessions of the agent traces all
streaming at once (whatever ``--workload``), one worker node killed (raylet and everything
on it) ``--kill-at`` seconds in (about a third of the run): the worker whose replica has
the most requests in flight then (``/v1/stats``). A failed turn is counted and sent again
a second later, as an agent retries. A turn fails when the request raises (an HTTP error
status, a non-streamed error answer, a broken connection), when its stream is cut: it ends
in an SSE error event (``replica_lost``) or without a ``finish_reason``, its text
truncated (``turn_outcome``), and when its text differs from the same turn's in an
undisturbed run of the same sessions (same driver, router and cluster shape, a fresh
cluster, run just before). Counted: turns in flight at the kill and those of them that
failed, failed turns after the kill and, among them, the cut streams; the extra latency
of the turns in flight at the kill (wall time, retries included, less the undisturbed
run's, by session and turn: ``extra_latency``); the ingress's resumed requests and the
tokens prefilled again for them (``/metrics``); seconds from the kill until every new turn
succeeds, hangs, the cached fraction before the kill and over the last third of the run.

``--workload agents`` runs ``bench.agents``' sessions instead (a 1,500-token system prompt
shared by every session, turns interleaved across sessions, one edit; one request at a
time), ``--sessions`` of them per load level.

Where the machine has a core per simulated node or more, each node (its raylet and every
process under it) is pinned to cores of its own (``bench.pinning``); the result's
``cores`` says whether it was, and why not.

Usage: python -m bench.routers  (writes bench/results/routers-<model>.json and a plot)
       python -m bench.routers --workload agents --no-node-loss
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from bench.common import ServerProcess, add_model_option, emit, ready, workdir
from bench.devserver import free_port, write_config
from bench.node_loss import (
    LOSS_METRICS_INTERVAL_MS,
    fmt,
    loss_table,
    per_node,
    run_sessions,
    run_with_loss,
)
from bench.pinning import core_plan, pin_node
from bench.traces import (
    Arm,
    Scale,
    SessionPlan,
    load_traces,
    percentile,
    plan_session,
    run_arm,
    shared_system_blocks,
    summarize,
    system_text,
)

ROUTERS: dict[str, dict] = {
    "pow2": {"mode": "default", "directory": "off"},
    "ray_prefix": {"mode": "ray_prefix", "directory": "off"},
    "ours": {"mode": "prefix", "directory": "on"},
    # ours with a smaller cost per request waiting for a batch slot (load_cost_tokens)
    "ours_lc64": {"mode": "prefix", "directory": "on", "load_cost_tokens": 64},
    # Ray's with a finite imbalanced_threshold (prefix affinity only while queue lengths
    # differ by less): the sweep that finds its best setting (issue 45)
    **{f"ray_prefix_t{t}": {"mode": "ray_prefix", "directory": "off",
                            "ray_imbalanced_threshold": float(t)} for t in (1, 2, 4, 8)},
}
KV_AWARE_WHY = (
    "not run: KVAwareRouter scores only through the KVTokenTracker that Ray's LLMRouter "
    "ingress builds in its own process (elsewhere its choose_replicas picks a random "
    "replica), and that tracker needs ai-dynamo's SelectionService subscribed to every "
    "engine's vLLM-format KV events over ZMQ; our ingress is not Ray's LLMRouter and our "
    "MLX replicas publish to our block directory, not to ZMQ")
GOAL_VS_RAY_PREFIX = 0.9  # issue 45: against Ray's router at its best setting (the sweep)
GOAL_VS_POW2 = 0.6
SLOT = "serve_app_bench_slot"


def start_cluster(nodes: int, tmp: Path,
                  metrics_interval_ms: int | None = None) -> tuple[Cluster, list]:
    """A head and ``nodes - 1`` workers, each a replica slot and its own SSD directory.
    ``metrics_interval_ms``: how often every process exports its metrics (Ray's default,
    10 s, when None): the node-loss run reads the ingress's counters right after it."""
    def args(i: int) -> dict:
        return {"num_cpus": 2, "resources": {SLOT: 1}, "object_store_memory": 256 << 20,
                "env_vars": {"SERVE_APP_SSD_DIR": str(tmp / f"kv-node{i}")}}

    head = {**args(1), "include_dashboard": False}
    if metrics_interval_ms is not None:
        head["_system_config"] = {"metrics_report_interval_ms": metrics_interval_ms}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    workers = [cluster.add_node(**args(i)) for i in range(2, nodes + 1)]
    plan = core_plan(nodes)  # cores of their own, where the machine has enough
    for node, cores in zip([cluster.head_node, *workers], plan.nodes, strict=False):
        pin_node(node, cores)
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    return cluster, workers


def start_server(cluster: Cluster, tmp: Path, tag: str, model: str, nodes: int,
                 router: dict, scale: Scale) -> ServerProcess:
    port = free_port()
    profile = {"name": model, "source": f"embedded:{model}", "context_length": scale.context,
               "max_tokens": scale.max_output, "num_replicas": nodes,
               "max_replicas_per_node": 1, "resources": {SLOT: 1},
               "routing": {k: v for k, v in router.items() if k != "directory"},
               "cache": {"block_size": 16}}
    config = write_config(tmp / f"{tag}.yaml", port, [profile],
                          cache_store={"directory": router["directory"]})
    server = ServerProcess.serve_run(config, port, tmp / f"{tag}.log",
                                     address=cluster.address)
    server = ready(server, [model])
    deadline = time.monotonic() + 300
    while len(per_node(server, model)) < nodes:  # every replica reporting
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tag}: not every replica came up")
        time.sleep(0.5)
    time.sleep(2.0)  # the routers' copies of the directory connect
    return server


@contextmanager
def serving_cluster(nodes: int, tmp: Path, tag: str, model: str, router: dict, scale: Scale,
                    metrics_interval_ms: int | None = None,
                    ) -> Iterator[tuple[Cluster, list, ServerProcess]]:
    """A fresh cluster (its own SSD directories) and the server on it; both gone after."""
    cluster, workers = start_cluster(nodes, tmp / tag, metrics_interval_ms)
    try:
        server = start_server(cluster, tmp, tag, model, nodes, router, scale)
        try:
            yield cluster, workers, server
        finally:
            server.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()


def load_plans(traces: list, sessions: int, scale: Scale) -> tuple[str, list[SessionPlan]]:
    """``sessions`` sessions of their own: conversations of one load level share nothing
    with another's on the same server but the system prompt (every session's, as Claude
    Code sends the same one)."""
    blocks = shared_system_blocks(traces)
    plans = [plan_session(traces[s % len(traces)], s, blocks, scale,
                          f"{traces[s % len(traces)].id}@{sessions}#{s // len(traces)}")
             for s in range(sessions)]
    return system_text(blocks, scale.tokens_per_block), plans


def run_routed(server: ServerProcess, model: str, system: str,
               plans: list[SessionPlan], scale: Scale) -> dict:
    before = per_node(server, model)
    run = run_arm(Arm("ours", "openai", server.base_url, model), system, plans,
                  scale.max_output)
    after = per_node(server, model)
    out = summarize(run, sum(len(p.turns) for p in plans))
    out["output_tokens_per_s"] = out["completion_tokens"] / run.wall_s
    out["requests_per_node"] = sorted((after.get(n, 0) - before.get(n, 0) for n in after),
                                      reverse=True)
    out["texts"] = {r["request"]: r.get("text") for r in run.records}
    return out


def run_agents(server: ServerProcess, model: str, tokenizer, sessions: int) -> dict:
    """``bench.agents``' workload (sessions sharing a 1,500-token system prompt, turns
    interleaved across sessions, one edit), one request at a time: where each turn lands
    decides what it restores."""
    from bench import agents

    args = argparse.Namespace(sessions=sessions, turns=3, system_tokens=1500,
                              user_tokens=150, gen=16, edit_session=0, edit_turn=2)
    system, requests = agents.script(args)
    before = per_node(server, model)
    tic = time.perf_counter()
    rows = agents.run(server.base_url, model, tokenizer, system, requests, args.gen)
    wall = time.perf_counter() - tic
    after = per_node(server, model)
    ttfts = [r["ttft"] for r in rows]
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    return {"requests_sent": len(rows), "errors": 0, "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "ttft_p99_s": percentile(ttfts, 99), "ttft_sum_s": sum(ttfts),
            "cached_fraction": sum(r["cached_tokens"] or 0 for r in rows) / prompt,
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in rows),
            "output_tokens_per_s": sum(r["completion_tokens"] or 0 for r in rows) / wall,
            "requests_per_node": sorted((after.get(n, 0) - before.get(n, 0) for n in after),
                                        reverse=True),
            "texts": {r["request"]: r["text"] for r in rows}}


def spread(values: list) -> dict:
    """Median, min and max of the values that are not None (None each when none is)."""
    got = [v for v in values if v is not None]
    return {"median": statistics.median(got) if got else None,
            "min": min(got, default=None), "max": max(got, default=None)}


def aggregate_repeats(runs: list[dict]) -> list[dict]:
    """Per (nodes, sessions, router): how many repeats, TTFT p50's median and min-max
    range over them (and each repeat's), the medians of p90, p99, cached fraction and
    output tok/s, errors summed, requests per node of each repeat; in the order the rows
    first came (nodes, then sessions, then router)."""
    groups: dict[tuple[int, int, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["nodes"], r["sessions"], r["router"]), []).append(r)
    order = {name: i for i, name in enumerate(dict.fromkeys(r["router"] for r in runs))}
    out = []
    for (nodes, sessions, router), rs in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order[kv[0][2]])):
        rs = sorted(rs, key=lambda r: r.get("repeat", 0))
        p50 = spread([r["ttft_p50_s"] for r in rs])
        cached = spread([r["cached_fraction"] for r in rs])
        out.append({"nodes": nodes, "sessions": sessions, "router": router,
                    "repeats": len(rs),
                    "ttft_p50_s_median": p50["median"], "ttft_p50_s_min": p50["min"],
                    "ttft_p50_s_max": p50["max"],
                    "ttft_p50_s_each": [r["ttft_p50_s"] for r in rs],
                    "ttft_p90_s_median": spread([r["ttft_p90_s"] for r in rs])["median"],
                    "ttft_p99_s_median": spread([r["ttft_p99_s"] for r in rs])["median"],
                    "cached_fraction_median": cached["median"],
                    "cached_fraction_min": cached["min"], "cached_fraction_max": cached["max"],
                    "output_tokens_per_s_median": spread(
                        [r["output_tokens_per_s"] for r in rs])["median"],
                    "errors": sum(r["errors"] or 0 for r in rs),
                    "requests_per_node": [r["requests_per_node"] for r in rs]})
    return out


def compare_repeats(runs: list[dict], rows: list[dict]) -> dict:
    """Ours against Ray's router at its best arm (the ``ray_prefix*`` arm of lowest median
    TTFT p50, the same arm in every repeat) and against pow2, per nodes/sessions: the ratio
    of the medians against its goal, each repeat's ratio (ours and the base of the same
    repeat) and their range, and the median cached fractions (the goal: ours at least
    Ray's)."""
    out: dict = {"ray_prefix_best": {}, "ttft_p50_ratios": {}, "cached_fraction": {}}
    for nodes, sessions in dict.fromkeys((r["nodes"], r["sessions"]) for r in rows):
        key = f"{nodes}n/{sessions}s"
        by = {r["router"]: r for r in rows if r["nodes"] == nodes and r["sessions"] == sessions}
        rays = [r for name, r in by.items()
                if name.startswith("ray_prefix") and r["ttft_p50_s_median"] is not None]
        bases = {}
        if rays:
            best = min(rays, key=lambda r: r["ttft_p50_s_median"])
            out["ray_prefix_best"][key] = best["router"]
            bases["ray_prefix_best"] = (best, GOAL_VS_RAY_PREFIX)
        if "pow2" in by:
            bases["pow2"] = (by["pow2"], GOAL_VS_POW2)
        ours = by.get("ours")
        if ours is None:
            continue
        out["cached_fraction"][key] = {
            "ours": ours["cached_fraction_median"],
            **{name: base["cached_fraction_median"] for name, (base, _) in bases.items()}}
        if "ray_prefix_best" in bases and ours["cached_fraction_median"] is not None:
            theirs = bases["ray_prefix_best"][0]["cached_fraction_median"]
            out["cached_fraction"][key]["met"] = (
                theirs is None or ours["cached_fraction_median"] >= theirs - 1e-9)

        p50 = {(r["router"], r.get("repeat", 0)): r["ttft_p50_s"] for r in runs
               if r["nodes"] == nodes and r["sessions"] == sessions}

        for name, (base, goal) in bases.items():
            if not base["ttft_p50_s_median"] or ours["ttft_p50_s_median"] is None:
                continue
            ratio = ours["ttft_p50_s_median"] / base["ttft_p50_s_median"]
            each = []
            for repeat in sorted({r.get("repeat", 0) for r in runs}):
                a, b = p50.get(("ours", repeat)), p50.get((base["router"], repeat))
                each.append(round(a / b, 3) if a is not None and b else None)
            known = [v for v in each if v is not None]
            out["ttft_p50_ratios"][f"{key} ours/{name}"] = {
                "base": base["router"], "ratio": round(ratio, 3), "goal": goal,
                "met": ratio <= goal, "per_repeat": each,
                "range": [min(known), max(known)] if known else None,
                "met_in_every_repeat": bool(known) and all(v <= goal for v in known)}
    return out


def identical_answers(runs: list[dict]) -> dict:
    """Per nodes/sessions: how many of the first run's answers (the first router of the
    first repeat) each router's run gave again, one count per repeat, of how many."""
    out: dict = {}
    for nodes, sessions in dict.fromkeys((r["nodes"], r["sessions"]) for r in runs):
        group = [r for r in runs if r["nodes"] == nodes and r["sessions"] == sessions]
        first = group[0]["texts"]
        counts: dict[str, list[int]] = {}
        for r in sorted(group, key=lambda r: r.get("repeat", 0)):
            counts.setdefault(r["router"], []).append(
                sum(r["texts"].get(k) == v for k, v in first.items()))
        out[f"{nodes}n/{sessions}s"] = {"of": len(first), **counts}
    return out


def tokenizer(model: str):
    from mlx_lm.utils import load_tokenizer

    from serve_app.models.embedded import materialize

    return load_tokenizer(materialize(model))


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result.get("repeats") or []
    if not rows:  # --only-node-loss: nothing to plot
        return
    labels = [f"{r['router']}\n{r['nodes']}n/{r['sessions']}s" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4))
    x = list(range(len(rows)))
    p50 = [r["ttft_p50_s_median"] or 0 for r in rows]
    below = [v - (r["ttft_p50_s_min"] or v) for v, r in zip(p50, rows, strict=True)]
    above = [(r["ttft_p50_s_max"] or v) - v for v, r in zip(p50, rows, strict=True)]
    ax.bar([v - 0.27 for v in x], p50, 0.27, yerr=[below, above], capsize=2,
           label="p50 (median, min-max)")
    ax.bar(x, [r["ttft_p90_s_median"] or 0 for r in rows], 0.27, label="p90 (median)")
    ax.bar([v + 0.27 for v in x], [r["ttft_p99_s_median"] or 0 for r in rows], 0.27,
           label="p99 (median)")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("TTFT (s)")
    repeats = max(r["repeats"] for r in rows)
    ax.set_title(f"{result['model']}: {result['workload']} by router, nodes and load "
                 f"({repeats} repeat{'s' if repeats > 1 else ''})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, "tiny-hybrid")
    parser.add_argument("--nodes", default="3,4")
    parser.add_argument("--sessions", default="4,8", help="the load levels")
    parser.add_argument("--routers", default="pow2,ray_prefix,ours")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the routing arms this many times (each repeat every arm "
                             "in turn, on fresh clusters): medians and min-max ranges")
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--tokens-per-block", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--workload", choices=("traces", "agents"), default="traces",
                        help="kv-cache-tester's agent traces (sessions at once), or "
                             "bench.agents' shared-system-prompt sessions (one at a time)")
    parser.add_argument("--no-node-loss", action="store_true")
    parser.add_argument("--only-node-loss", action="store_true")
    parser.add_argument("--kill-at", type=float, default=8.0,
                        help="seconds into the node-loss run when a worker node is killed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    suffix = "" if args.workload == "traces" else "-agents"
    out = args.out or Path("bench/results") / f"routers{suffix}-{args.model}.json"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    scale = Scale(args.tokens_per_block, args.max_output, args.context, 0.02, 1.0,
                  args.max_turns)
    traces = load_traces()
    loads = [int(s) for s in args.sessions.split(",")]
    runs: list[dict] = []
    loss: dict | None = None
    tic = time.perf_counter()
    with workdir() as tmp:
        for repeat in range(0 if args.only_node_loss else args.repeat):
            for nodes in [int(n) for n in args.nodes.split(",")]:
                for name in args.routers.split(","):
                    tag = f"{name}-{nodes}-r{repeat}"
                    with serving_cluster(nodes, tmp, tag, args.model, ROUTERS[name],
                                         scale) as (_, _, server):
                        for sessions in loads:
                            if args.workload == "agents":
                                r = run_agents(server, args.model, tokenizer(args.model),
                                               sessions)
                            else:
                                system, plans = load_plans(traces, sessions, scale)
                                r = run_routed(server, args.model, system, plans, scale)
                            r.update(router=name, nodes=nodes, sessions=sessions,
                                     repeat=repeat)
                            runs.append(r)
                            print(f"[routers] repeat {repeat + 1}/{args.repeat} {name} "
                                  f"{nodes} nodes {sessions} sessions: TTFT p50 "
                                  f"{r['ttft_p50_s']:.3f} s, cached "
                                  f"{r['cached_fraction']:.3f}, errors {r['errors']}",
                                  flush=True)
        if not args.no_node_loss:
            # kv-cache-tester's traces, the higher load's sessions all at once, streamed
            # (bench.agents' workload sends one request at a time: one would be in flight)
            system, plans = load_plans(traces, max(loads), scale)
            # the undisturbed run of the same sessions: the same driver, router and
            # cluster shape, a cluster of its own (nothing cached from the other)
            with serving_cluster(3, tmp, "loss-reference", args.model, ROUTERS["ours"],
                                 scale, LOSS_METRICS_INTERVAL_MS) as (_, _, server):
                reference_rows, reference_wall = run_sessions(server, args.model, system,
                                                              plans, scale)
            print(f"[routers] node loss: undisturbed reference run {reference_wall:.1f} s, "
                  f"{sum(1 for r in reference_rows if r['error'])} failed attempts",
                  flush=True)
            with serving_cluster(3, tmp, "loss", args.model, ROUTERS["ours"], scale,
                                 LOSS_METRICS_INTERVAL_MS) as (cluster, workers, server):
                loss = run_with_loss(server, cluster, workers, args.model, system, plans,
                                     scale, kill_at_s=args.kill_at,
                                     reference_rows=reference_rows)
            loss.update(sessions=max(loads), workload="traces", reference_wall_s=reference_wall,
                        reference="an undisturbed run of the same sessions, same router, "
                                  "driver and cluster shape, on a fresh cluster just before")
            print("[routers] node loss: " + str({k: v for k, v in loss.items()
                                                  if k != "rows"}), flush=True)

    rows = aggregate_repeats(runs)
    compared = compare_repeats(runs, rows)
    result = {"model": args.model, "workload": args.workload, "settings": {
        "nodes": args.nodes, "sessions": loads, "max_turns": args.max_turns,
        "tokens_per_block": args.tokens_per_block, "max_output": args.max_output,
        "repeat": args.repeat, "kill_at_s": args.kill_at}, "wall_s": time.perf_counter() - tic,
        "cores": {n: core_plan(int(n)).to_json() for n in args.nodes.split(",")},
        "kv_aware": KV_AWARE_WHY, "runs": [{k: v for k, v in r.items() if k != "texts"}
                                           for r in runs],
        "repeats": rows, **compared, "identical_answers": identical_answers(runs),
        "node_loss": loss}
    emit(result, out)
    plot(result, out.with_suffix(".png"))
    print(table(result))
    return 0


def table(result: dict) -> str:
    """The result in markdown: the routing rows over the repeats, the ratios against the
    goals, the node loss."""
    lines = ["| nodes | sessions | router | repeats | TTFT p50 median | p50 min-max | "
             "p90 median | p99 median | cached median | out tok/s median | "
             "requests per node (each repeat) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("repeats") or []:
        lines.append(
            f"| {r['nodes']} | {r['sessions']} | {r['router']} | {r['repeats']} | "
            f"{fmt(r['ttft_p50_s_median'])} | {fmt(r['ttft_p50_s_min'])}-"
            f"{fmt(r['ttft_p50_s_max'])} | {fmt(r['ttft_p90_s_median'])} | "
            f"{fmt(r['ttft_p99_s_median'])} | {fmt(r['cached_fraction_median'])} | "
            f"{fmt(r['output_tokens_per_s_median'], 1)} | "
            f"{'; '.join(', '.join(map(str, n)) for n in r['requests_per_node'])} | "
            f"{r['errors']} |")
    lines.append("")
    lines.append(f"KVAwareRouter: {result['kv_aware']}")
    ratios = result.get("ttft_p50_ratios") or {}
    if ratios:
        lines += ["", "| nodes / sessions | ours against | base arm | ratio of medians | "
                      "each repeat | goal | met (medians) | met in every repeat |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in ratios.items():
            key, against = k.split(" ours/")
            lines.append(f"| {key} | {against} | {v['base']} | {v['ratio']:.3f}x | "
                         f"{', '.join(fmt(x, 2) for x in v['per_repeat'])} | "
                         f"<= {v['goal']}x | {'yes' if v['met'] else 'no'} | "
                         f"{'yes' if v['met_in_every_repeat'] else 'no'} |")
    cached = result.get("cached_fraction") or {}
    if cached:
        lines += ["", "| nodes / sessions | cached ours | Ray's best arm | pow2 | "
                      "ours >= Ray's |", "|---|---|---|---|---|"]
        for k, v in cached.items():
            met = v.get("met")
            lines.append(f"| {k} | {fmt(v.get('ours'))} | {fmt(v.get('ray_prefix_best'))} | "
                         f"{fmt(v.get('pow2'))} | "
                         f"{'-' if met is None else 'yes' if met else 'no'} |")
    loss = result.get("node_loss")
    if loss:
        lines += ["", loss_table(loss)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
