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
node, identical answers across routers (temperature 0). Then ``node_loss``: ours, 3 nodes,
the higher load, one worker node killed (raylet and everything on it) ``--kill-at``
seconds in (about a third of the run); a failed turn is counted and sent again a second
later, as an agent retries. A turn fails when the request raises (an HTTP error status, a
non-streamed error answer, a broken connection) and also when its stream is cut: it ends
in an SSE error event (``replica_lost``) or without a ``finish_reason``, its text
truncated (``turn_outcome``). Counted: failed turns after the kill and, among them, the
cut streams; seconds from the kill until every new turn succeeds, hangs, the cached
fraction before the kill and over the last third of the run.

``--workload agents`` runs ``bench.agents``' sessions instead (a 1,500-token system prompt
shared by every session, turns interleaved across sessions, one edit; one request at a
time), ``--sessions`` of them per load level.

Usage: python -m bench.routers  (writes bench/results/routers-<model>.json and a plot)
       python -m bench.routers --workload agents --no-node-loss
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray
from ray.cluster_utils import Cluster

from bench.common import ServerProcess, add_model_option, emit, ready, workdir
from bench.devserver import free_port, write_config
from bench.traces import (
    Arm,
    Scale,
    SessionPlan,
    load_traces,
    percentile,
    plan_session,
    run_arm,
    send,
    shared_system_blocks,
    summarize,
    system_text,
)

ROUTERS = {
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
RETRY_AFTER_S = 1.0
FAILED_MEANS = ("a request that raised (HTTP error status, broken connection) or a stream "
                "cut: ended by an SSE error event (replica_lost) or without a finish_reason")
HANG_S = 120.0


def start_cluster(nodes: int, tmp: Path) -> tuple[Cluster, list]:
    """A head and ``nodes - 1`` workers, each a replica slot and its own SSD directory."""
    def args(i: int) -> dict:
        return {"num_cpus": 2, "resources": {SLOT: 1}, "object_store_memory": 256 << 20,
                "env_vars": {"SERVE_APP_SSD_DIR": str(tmp / f"kv-node{i}")}}

    cluster = Cluster(initialize_head=True, head_node_args={**args(1),
                                                            "include_dashboard": False})
    workers = [cluster.add_node(**args(i)) for i in range(2, nodes + 1)]
    ray.init(address=cluster.address, logging_level="ERROR")
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


def per_node(server: ServerProcess, model: str) -> dict[str, int]:
    """Requests finished by the replica on each node (``/v1/stats``' replicas)."""
    stats = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"][model]
    return {r["node_id"]: (r["stats"].get("engine") or {}).get("finished", 0)
            for r in stats.get("replicas", [])}


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


@dataclass(frozen=True)
class TurnOutcome:
    """How one sent turn ended: ``error`` None for a whole answer; ``cut`` when the answer
    had started streaming and then ended in an error event or without a finish."""

    error: str | None = None
    cut: bool = False


def turn_outcome(result: dict | None, exc: BaseException | None) -> TurnOutcome:
    """A turn's outcome from ``send``'s result (``stream_chat``'s fields) or what it
    raised. An HTTP error status (a non-streamed error answer among them) raises; a stream
    already started ends with an ``{"error": ...}`` event instead, which ``stream_chat``
    reports as ``error``: a failure too, never a success with truncated text."""
    if exc is not None:
        return TurnOutcome(f"{type(exc).__name__}: {exc}"[:300])
    if result is None:
        return TurnOutcome("no answer")
    if result.get("error") is not None:
        return TurnOutcome(f"stream cut by an error event: {result['error']}"[:300], cut=True)
    if result.get("finish_reason") is None:
        return TurnOutcome("stream ended without a finish_reason", cut=True)
    return TurnOutcome()


def loss_report(rows: list[dict], kill_at_s: float, wall_s: float,
                reference: dict[str, str] | None = None) -> dict:
    """The node-loss figures from every attempt's row (``error``, ``cut``, times, usage).
    ``reference``: each turn's text in an undisturbed run of the same sessions (the
    routing run of the same bench): an answer that differs from it counts as failed too."""
    reference = reference or {}
    for r in rows:  # a whole answer other than the undisturbed run's is no success either
        want = reference.get(r.get("request", ""))
        if not r["error"] and want is not None and r.get("text") != want:
            r["error"], r["differs"] = "differs from the undisturbed run's answer", True
    failed = [r for r in rows if r["error"] and r["end_s"] >= kill_at_s]
    ok = [r for r in rows if not r["error"]]

    def fraction(part: list[dict]) -> float | None:
        prompt = sum(r["prompt_tokens"] or 0 for r in part)
        return sum(r["cached_tokens"] or 0 for r in part) / prompt if prompt else None

    last_third = [r for r in ok if r["start_s"] >= wall_s * 2 / 3]
    return {"kill_at_s": kill_at_s, "wall_s": wall_s, "failed_means": FAILED_MEANS,
            "turns": len(ok),
            "failed_turns_after_kill": len(failed),
            "cut_streams_after_kill": sum(1 for r in failed if r.get("cut")),
            "differing_answers": sum(1 for r in rows if r.get("differs")),
            "compared_with_reference": sum(1 for r in rows
                                           if r.get("request") in reference),
            # the turns in flight when the victim was killed (started before, ended after)
            "in_flight_at_kill": sum(1 for r in rows
                                     if r["start_s"] < kill_at_s <= r["end_s"]),
            "failed_turns_before_kill": sum(1 for r in rows
                                            if r["error"] and r["end_s"] < kill_at_s),
            # From the kill until the last failed turn sent after it (0: none failed): a
            # stream cut by the kill started before it.
            "recovery_s": max((r["start_s"] - kill_at_s for r in failed
                               if r["start_s"] >= kill_at_s), default=0.0),
            "hangs": sum(1 for r in rows if r["end_s"] - r["start_s"] > HANG_S),
            "cached_fraction_before_kill": fraction([r for r in ok if r["end_s"] < kill_at_s]),
            "cached_fraction_last_third": fraction(last_third),
            "ttft_p50_s": percentile([r["ttft"] for r in ok], 50),
            "errors": [r["error"] for r in rows if r["error"]][:5]}


def run_with_loss(server: ServerProcess, cluster: Cluster, victim, model: str,
                  system: str, plans: list[SessionPlan], scale: Scale,
                  kill_at_s: float, reference: dict[str, str] | None = None) -> dict:
    """Every session at once; a failed turn (``turn_outcome``: a cut stream too) is
    counted and sent again after ``RETRY_AFTER_S``; ``victim`` is killed ``kill_at_s``
    into the run."""
    rows: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    arm = Arm("ours", "openai", server.base_url, model)

    def session(plan: SessionPlan) -> None:
        import random

        history: list[tuple[str, str]] = []
        rng = random.Random(plan.session)
        for turn in plan.turns:
            time.sleep(turn.think_s)
            while True:
                start = time.perf_counter() - t0
                r: dict | None = None
                try:
                    r = send(arm, system, history, turn.user, rng, scale.max_output)
                    outcome = turn_outcome(r, None)
                except Exception as e:  # noqa: BLE001 (counted)
                    outcome = turn_outcome(None, e)
                end = time.perf_counter() - t0
                with lock:
                    rows.append({"session": plan.session, "turn": turn.index,
                                 "request": f"s{plan.session}t{turn.index + 1}",
                                 "text": r.get("text") if r else None, "start_s": start,
                                 "end_s": end, "error": outcome.error, "cut": outcome.cut,
                                 "ttft": r["ttft"] if r else None,
                                 "prompt_tokens": r["prompt_tokens"] if r else None,
                                 "cached_tokens": r["cached_tokens"] if r else None})
                if r is not None and outcome.error is None:
                    history.append((turn.user, r["text"]))
                    break
                time.sleep(RETRY_AFTER_S)

    threads = [threading.Thread(target=session, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    killer = threading.Timer(kill_at_s, cluster.remove_node, args=(victim,),
                             kwargs={"allow_graceful": False})
    killer.start()
    for t in threads:
        t.join()
    killer.join()
    report = loss_report(rows, kill_at_s, time.perf_counter() - t0, reference)
    report["victim_node"] = victim.node_id
    return report


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
    runs = result["runs"]
    if not runs:  # --only-node-loss: nothing to plot
        return
    labels = [f"{r['router']}\n{r['nodes']}n/{r['sessions']}s" for r in runs]
    fig, ax = plt.subplots(figsize=(max(8, len(runs) * 0.9), 4))
    x = range(len(runs))
    for i, (q, key) in enumerate((("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"),
                                  ("p99", "ttft_p99_s"))):
        ax.bar([v + (i - 1) * 0.27 for v in x], [r[key] or 0 for r in runs], 0.27, label=q)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{result['model']}: agent traces by router, nodes and load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, "tiny-hybrid")
    parser.add_argument("--nodes", default="3,4")
    parser.add_argument("--sessions", default="4,8", help="the load levels")
    parser.add_argument("--routers", default="pow2,ray_prefix,ours")
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
    suffix = "" if args.workload == "traces" else "-agents"
    out = args.out or Path("bench/results") / f"routers{suffix}-{args.model}.json"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    scale = Scale(args.tokens_per_block, args.max_output, args.context, 0.02, 1.0,
                  args.max_turns)
    traces = load_traces()
    loads = [int(s) for s in args.sessions.split(",")]
    runs: list[dict] = []
    loss: dict | None = None
    with workdir() as tmp:
        for nodes in ([] if args.only_node_loss else [int(n) for n in args.nodes.split(",")]):
            for name in args.routers.split(","):
                cluster, _ = start_cluster(nodes, tmp / f"{name}-{nodes}")
                try:
                    server = start_server(cluster, tmp, f"{name}-{nodes}", args.model, nodes,
                                          ROUTERS[name], scale)
                    try:
                        for sessions in loads:
                            if args.workload == "agents":
                                r = run_agents(server, args.model, tokenizer(args.model),
                                               sessions)
                            else:
                                system, plans = load_plans(traces, sessions, scale)
                                r = run_routed(server, args.model, system, plans, scale)
                            r.update(router=name, nodes=nodes, sessions=sessions)
                            runs.append(r)
                            print(f"[routers] {name} {nodes} nodes {sessions} sessions: TTFT "
                                  f"p50 {r['ttft_p50_s']:.3f} s, cached "
                                  f"{r['cached_fraction']:.3f}, errors {r['errors']}",
                                  flush=True)
                    finally:
                        server.stop()
                finally:
                    ray.shutdown()
                    cluster.shutdown()
        if not args.no_node_loss:
            cluster, workers = start_cluster(3, tmp / "loss")
            try:
                server = start_server(cluster, tmp, "loss", args.model, 3, ROUTERS["ours"],
                                      scale)
                try:
                    system, plans = load_plans(traces, max(loads), scale)
                    # the undisturbed run of the same sessions, from this bench's routing runs
                    reference = next((r["texts"] for r in runs if r["router"] == "ours"
                                      and r["nodes"] == 3 and r["sessions"] == max(loads)
                                      and args.workload == "traces"), None)
                    loss = run_with_loss(server, cluster, workers[-1], args.model, system,
                                         plans, scale, kill_at_s=args.kill_at,
                                         reference=reference)
                    print(f"[routers] node loss: {loss}", flush=True)
                finally:
                    server.stop()
            finally:
                ray.shutdown()
                cluster.shutdown()

    result = {"model": args.model, "workload": args.workload, "settings": {
        "nodes": args.nodes, "sessions": loads, "max_turns": args.max_turns,
        "tokens_per_block": args.tokens_per_block, "max_output": args.max_output},
        "kv_aware": KV_AWARE_WHY, "runs": [], "identical_answers": {}, "node_loss": loss}
    for r in runs:
        result["runs"].append({k: v for k, v in r.items() if k != "texts"})
    for nodes in {r["nodes"] for r in runs}:
        for sessions in loads:
            group = [r for r in runs if r["nodes"] == nodes and r["sessions"] == sessions]
            by = {r["router"]: r for r in group}
            key = f"{nodes}n/{sessions}s"
            first = group[0]["texts"] if group else {}
            result["identical_answers"][key] = {
                r["router"]: sum(r["texts"].get(k) == v for k, v in first.items())
                for r in group}
            # Ray's router at its best setting: the lowest TTFT p50 of its arms (the sweep)
            rays = [r for r in group if r["router"].startswith("ray_prefix")]
            if rays:
                by["ray_prefix_best"] = min(rays, key=lambda r: r["ttft_p50_s"] or 1e9)
                result.setdefault("ray_prefix_best", {})[key] = by["ray_prefix_best"]["router"]
            if "ours" in by:
                for base, goal in (("ray_prefix_best", GOAL_VS_RAY_PREFIX),
                                   ("pow2", GOAL_VS_POW2)):
                    if base in by and by[base]["ttft_p50_s"]:
                        ratio = by["ours"]["ttft_p50_s"] / by[base]["ttft_p50_s"]
                        result.setdefault("ttft_p50_ratios", {})[f"{key} ours/{base}"] = {
                            "ratio": round(ratio, 3), "goal": goal, "met": ratio <= goal}
    emit(result, out)
    plot(result, out.with_suffix(".png"))
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = ["| router | nodes | sessions | TTFT p50 | p90 | p99 | cached | out tok/s | "
             "per node | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['router']} | {r['nodes']} | {r['sessions']} | "
                     f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['cached_fraction']:.3f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['requests_per_node']} | {r['errors']} |")
    lines.append(f"KVAwareRouter: {result['kv_aware']}")
    for k, v in (result.get("ttft_p50_ratios") or {}).items():
        lines.append(f"{k}: {v['ratio']}x (goal <= {v['goal']}x: "
                     f"{'met' if v['met'] else 'missed'})")
    if result.get("node_loss"):
        lines.append(f"node loss: {result['node_loss']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
