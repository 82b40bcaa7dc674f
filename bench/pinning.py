"""Simulated Ray nodes with cores of their own, where the machine has them.

``ray.cluster_utils.Cluster`` starts every "node" on this machine, all sharing its cores, so
one node's prefill slows every other's: a cluster of Macs does not work like that. Where
there are enough cores, each node's raylet (and every process under it: its workers, our
replicas) is pinned to cores of its own; processes started later inherit the raylet's
affinity. Where there are not, nothing is pinned and the report says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bench.devserver import descendants


@dataclass(frozen=True)
class CorePlan:
    """Each node's cores (``nodes[i]`` for node i, the head first), or why there are none."""

    nodes: tuple[tuple[int, ...], ...] = ()
    why_not: str | None = None

    def to_json(self) -> dict:
        return {"pinned": bool(self.nodes), "cores_per_node": [list(c) for c in self.nodes],
                "why_not": self.why_not}


def core_plan(nodes: int, cores: list[int] | None = None) -> CorePlan:
    """An equal share of ``cores`` (this process's allowed cores) for each of ``nodes``
    nodes, at least one each; none when there are fewer cores than nodes."""
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(allowed) < nodes:
        return CorePlan(why_not=f"{len(allowed)} cores for {nodes} simulated nodes: every "
                                "node shares every core (a cluster of Macs does not)")
    share = len(allowed) // nodes
    return CorePlan(tuple(tuple(allowed[i * share:(i + 1) * share]) for i in range(nodes)))


def pin_node(node: Any, cores: tuple[int, ...]) -> int:
    """Pin ``node``'s raylet (a ``ray._private.node.Node`` of ``Cluster``) and every process
    under it to ``cores``; the processes pinned."""
    raylets = node.all_processes.get("raylet") or []
    pinned = 0
    for info in raylets:
        for pid in (info.process.pid, *descendants(info.process.pid)):
            try:
                os.sched_setaffinity(pid, cores)
                pinned += 1
            except OSError:  # gone meanwhile
                pass
    return pinned
