"""Agent sessions on two Ray nodes: prefix-affinity routing against Ray's default router.

The agents bench's workload (``bench.agents``: sessions sharing one system prompt, turns
interleaved across sessions, one edit) runs against ``serve run --address`` on a Ray
cluster of simulated nodes on this machine (``ray.cluster_utils.Cluster``, each node
with its own SSD directory, one replica per node), once per arm, side by side in one run:

- ``prefix``: our router (``routing.mode: prefix``) with the block directory and
  cross-node fetch (``configs/qwen-cluster.yaml``'s settings);
- ``default``: Ray Serve's default router, every node's cache on its own (directory
  off): what a conversation gets when it lands on a node without its prefix;
- ``default_fetch``: Ray's default router, but replicas fetch from other nodes;
- ``one_node``: the same workload on one node with one replica.

Goals: total TTFT of ``prefix`` <= 0.6x ``default``; cached fraction (cached prompt
tokens / prompt tokens) of ``prefix`` within 0.02 of ``one_node``. Outputs must be
identical across arms (temperature 0). Also measured on the ``prefix`` cluster: a
4K-token prefix fetched from the node holding it (through the object store, checked
against the layout) against prefilling it cold.

Usage: python -m bench.cluster   (writes bench/results/cluster-<model>.json)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from bench import agents
from bench.common import (
    ServerProcess,
    add_model_option,
    emit,
    model_stats,
    ready,
    stream_chat,
    workdir,
)
from bench.devserver import free_port, write_config
from bench.multiturn import text_of
from serve_app.models.embedded import materialize
from serve_app.store.actor import store_name

GOAL_TTFT_RATIO = 0.6
GOAL_CACHED_FRACTION_GAP = 0.02
ARMS = {
    "prefix": {"nodes": 2, "routing": "prefix", "directory": "on"},
    "default": {"nodes": 2, "routing": "default", "directory": "off"},
    "default_fetch": {"nodes": 2, "routing": "default", "directory": "on"},
    "one_node": {"nodes": 1, "routing": "default", "directory": "off"},
}


def start_cluster(nodes: int, tmp: Path) -> Cluster:
    """``nodes`` Ray nodes here, each with its own SSD directory, and a driver connection."""
    def args(i: int) -> dict:
        return {"num_cpus": 2, "env_vars": {"SERVE_APP_SSD_DIR": str(tmp / f"kv-node{i}")},
                "object_store_memory": 512 << 20}

    cluster = Cluster(initialize_head=True, head_node_args={**args(1),
                                                            "include_dashboard": False})
    for i in range(2, nodes + 1):
        cluster.add_node(**args(i))
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster.wait_for_nodes()
    return cluster


def start_server(cluster: Cluster, tmp: Path, tag: str, model: str, arm: dict,
                 gen: int, block_size: int | None) -> ServerProcess:
    port = free_port()
    profile = {"name": model, "source": f"embedded:{model}", "context_length": 16384,
               "max_tokens": max(gen, 16), "num_replicas": arm["nodes"],
               "max_replicas_per_node": 1, "routing": {"mode": arm["routing"]},
               "cache": {"block_size": block_size} if block_size else {}}
    config = write_config(tmp / f"{tag}.yaml", port, [profile],
                          cache_store={"directory": arm["directory"]})
    server = ServerProcess.serve_run(config, port, tmp / f"{tag}.log",
                                     address=cluster.address)
    server = ready(server, [model])
    wait_replicas(server, model, arm["nodes"])
    return server


def wait_replicas(server: ServerProcess, model: str, n: int, timeout: float = 300.0) -> None:
    """Every replica answering (``ready`` needs only one): ``/v1/stats`` lands on any
    replica, so poll until ``n`` distinct replica processes have answered; then a moment
    for the routers' and replicas' copies of the block directory to connect."""
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(seen)} of {n} replicas answered in {timeout:.0f} s")
        seen.add(model_stats(server, model)["replica"]["pid"])
        time.sleep(0.2)
    time.sleep(2.0)


def cached_fraction(rows: list[dict]) -> float:
    return sum(r["cached_tokens"] or 0 for r in rows) / sum(r["prompt_tokens"] for r in rows)


def measure_fetch(server: ServerProcess, model: str, tokenizer, model_dir: Path,
                  block_size: int, tokens: int) -> dict:
    """A ``tokens``-token prompt prefilled cold on one node, then its blocks fetched by
    the other node from the holder's store (what a replica does when the directory
    says another node holds more), timed; the fetch is checked against the layout."""
    import mlx_lm

    from serve_app.cache import codecs
    from serve_app.cache.client import FetchRequest
    from serve_app.cache.hashing import chain, model_identity, root_id
    from serve_app.cache.layout import probe_layout
    from serve_app.cluster.directory_service import DIRECTORY_NAME, NAMESPACE
    from serve_app.config.paths import default_home

    messages = [{"role": "user", "content": text_of(tokens, 4242)}]
    cold = stream_chat(server.base_url, {"model": model, "messages": messages,
                                         "max_tokens": 1, "temperature": 0})
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True))
    weights, _ = mlx_lm.load(str(model_dir))
    layout = probe_layout(weights)
    identity = model_identity(model_dir, f"embedded:{model}", tokenizer.chat_template,
                              memo=default_home() / "weights-digests.json")
    root = root_id(identity, layout.digest, block_size)
    ids = chain(root, prompt, block_size)[: (len(prompt) - 1) // block_size]
    directory = ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    deadline = time.monotonic() + 60
    while not (holders := ray.get(directory.holders.remote(ids[-1]))):
        if time.monotonic() > deadline:
            return {"error": "the directory never listed the prompt's blocks"}
        time.sleep(0.5)
    holder = next(iter(holders))
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != holder]
    req = FetchRequest(model, ids, layout, block_size,
                       {"model": identity, "layout": layout.digest,
                        "block_size": str(block_size)}, exact=True)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    fetch = ray.remote(num_cpus=0)(_fetch_from).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(others[0], soft=False))
    # The first fetch of a store also pays for its first export (imports, handles): both.
    first = ray.get(fetch.remote(req, holder), timeout=300)
    out = ray.get(fetch.remote(req, holder), timeout=300)
    out["first_fetch_seconds"] = first["seconds"]
    stats = model_stats(server, model)
    return {"prompt_tokens": len(prompt), "fetched_tokens": len(ids) * block_size,
            "cold_ttft_s": cold["ttft"],
            "prefill_tokens_per_s_measured_by_replica":
                stats["cache"]["remote_fetch_policy"]["prefill_tokens_per_s"],
            **out, "codec": codecs.EXACT,
            "fetch_over_cold_ttft": out["seconds"] / cold["ttft"]}


def _fetch_from(req, holder: str) -> dict:
    """On another node: the holder's store exports the chain; check every block."""
    from serve_app.cluster.directory_service import NAMESPACE

    store = ray.get_actor(store_name(holder), namespace=NAMESPACE)
    ray.get(store.protocol.remote())  # the handle is warm before timing
    tic = time.perf_counter()
    found = ray.get(store.export.remote(req))
    seconds = time.perf_counter() - tic
    bad = [i for i, p in enumerate(found.payloads) if req.layout.check(
        p.without_state(), req.block_size, need_state=False) is not None]
    nbytes = sum(p.nbytes for p in found.payloads)
    return {"seconds": seconds, "blocks": len(found.payloads), "bytes": nbytes,
            "bandwidth_bytes_per_s": nbytes / seconds if seconds else None,
            "blocks_not_fitting": bad}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, "tiny-hybrid")
    agents.add_workload_options(parser)
    parser.add_argument("--block-size", type=int, default=None,
                        help="cache.block_size (default: the profile's)")
    parser.add_argument("--fetch-tokens", type=int, default=4096)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    agents.check_workload(parser, args)
    out = args.out or Path("bench/results") / f"cluster-{args.model}.json"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from mlx_lm.utils import load_tokenizer

    system, requests = agents.script(args)
    model_dir = materialize(args.model)
    tokenizer = load_tokenizer(model_dir)
    results: dict[str, dict] = {}
    rows_by_arm: dict[str, list[dict]] = {}
    fetch: dict | None = None
    with workdir() as tmp:
        for name in args.arms.split(","):
            arm = ARMS[name]
            cluster = start_cluster(arm["nodes"], tmp / name)
            try:
                server = start_server(cluster, tmp, name, args.model, arm, args.gen,
                                      args.block_size)
                try:
                    stats = model_stats(server, args.model)
                    block_size = stats["cache"]["block_size"]
                    rows = agents.run(server.base_url, args.model, tokenizer, system,
                                      requests, args.gen)
                    if name == "prefix":
                        fetch = measure_fetch(server, args.model, tokenizer, model_dir,
                                              block_size, args.fetch_tokens)
                finally:
                    server.stop()
            finally:
                ray.shutdown()
                cluster.shutdown()
            rows_by_arm[name] = rows
            results[name] = {"ttft_total_s": sum(r["ttft"] for r in rows),
                             "cached_fraction": cached_fraction(rows),
                             "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                             "cached_tokens": sum(r["cached_tokens"] or 0 for r in rows),
                             "nodes": arm["nodes"], "routing": arm["routing"],
                             "directory": arm["directory"], "block_size": block_size}
            print(f"{name}: TTFT total {results[name]['ttft_total_s']:.2f} s, cached "
                  f"fraction {results[name]['cached_fraction']:.3f}", flush=True)

    labels = [r.label for r in requests]
    texts = {name: [r["text"] for r in rows] for name, rows in rows_by_arm.items()}
    first = next(iter(texts.values()))
    identical = {name: sum(a == b for a, b in zip(t, first, strict=True))
                 for name, t in texts.items()}
    result = {"model": args.model,
              "settings": {k: getattr(args, k) for k in (
                  "sessions", "turns", "system_tokens", "user_tokens", "gen",
                  "fetch_tokens")},
              "arms": results, "identical_outputs": identical, "requests": len(labels),
              "cross_node_fetch": fetch,
              "per_request": {name: [{k: v for k, v in r.items() if k != "text"}
                                     for r in rows] for name, rows in rows_by_arm.items()}}
    if "prefix" in results and "default" in results:
        result["ttft_ratio_prefix_vs_default"] = (results["prefix"]["ttft_total_s"]
                                                  / results["default"]["ttft_total_s"])
        result["goal_ttft_ratio"] = GOAL_TTFT_RATIO
    if "prefix" in results and "default_fetch" in results:
        result["ttft_ratio_prefix_vs_default_fetch"] = (
            results["prefix"]["ttft_total_s"] / results["default_fetch"]["ttft_total_s"])
    if "prefix" in results and "one_node" in results:
        result["cached_fraction_gap_vs_one_node"] = (results["one_node"]["cached_fraction"]
                                                     - results["prefix"]["cached_fraction"])
        result["goal_cached_fraction_gap"] = GOAL_CACHED_FRACTION_GAP
    emit(result, out)
    print(summary(result))
    return 0


def summary(result: dict) -> str:
    lines = [f"cluster bench: {result['model']}, {result['settings']['sessions']} sessions x "
             f"{result['settings']['turns']} turns + edit, one replica per node"]
    for name, arm in result["arms"].items():
        lines.append(f"  {name:<14} nodes {arm['nodes']} routing {arm['routing']:<8} "
                     f"directory {arm['directory']:<4} TTFT {arm['ttft_total_s']:7.2f} s  "
                     f"cached {arm['cached_fraction']:.3f}  identical "
                     f"{result['identical_outputs'][name]}/{result['requests']}")
    if "ttft_ratio_prefix_vs_default" in result:
        lines.append(f"TTFT prefix / default router: {result['ttft_ratio_prefix_vs_default']:.2f}x"
                     f" (goal <= {GOAL_TTFT_RATIO}x)")
    if "ttft_ratio_prefix_vs_default_fetch" in result:
        lines.append("TTFT prefix / default router with cross-node fetch: "
                     f"{result['ttft_ratio_prefix_vs_default_fetch']:.2f}x")
    if "cached_fraction_gap_vs_one_node" in result:
        lines.append(f"cached fraction, one node minus prefix: "
                     f"{result['cached_fraction_gap_vs_one_node']:+.3f} "
                     f"(goal within {GOAL_CACHED_FRACTION_GAP})")
    f = result.get("cross_node_fetch")
    if f and "seconds" in f:
        lines.append(f"{f['fetched_tokens']}-token prefix: fetched from the other node in "
                     f"{f['seconds'] * 1000:.1f} ms ({f['bytes'] / 1e6:.1f} MB), cold prefill "
                     f"TTFT {f['cold_ttft_s'] * 1000:.0f} ms -> {f['fetch_over_cold_ttft']:.3f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
