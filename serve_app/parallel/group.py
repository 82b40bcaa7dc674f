"""The ranks' group: addresses, the hostfile ``mx.distributed`` reads, joining it, and
what rank 0 knows of each rank. No Ray here: ``deploy/ranks.py`` places the ranks and
calls these in each."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

from serve_app.config.profile import ParallelProfile


@dataclass(frozen=True)
class RankAddress:
    """Where a rank listens for its ring neighbours, and on which Ray node it runs."""

    rank: int
    node_id: str
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RankStatus:
    """One rank as rank 0 sees it (``/v1/stats``): where it runs and what its engine did.
    Rank 0's ``channel_seconds`` is spent sending commands (waiting for the others to
    take them), the others' waiting for rank 0's next ones."""

    rank: int
    node_id: str
    host: str
    pid: int
    steps: int = 0
    step_seconds: float = 0.0  # in the model's forwards, their collectives included
    channel_seconds: float = 0.0
    # Steps whose command message carried commands (inserts, cancels), and their bytes:
    # every other step costs one collective of a single int.
    command_messages: int = 0
    command_bytes: int = 0
    broken: str | None = None
    # What its engine thread is doing (a rank other than 0): "commands" (waiting for
    # rank 0's next ones), "step" (in one), "asleep" (rank 0 said it is idle), and since
    # how many seconds: a rank stuck in one while rank 0 waits is named by it.
    activity: str = ""
    activity_s: float = 0.0

    def public(self) -> dict:
        return {"rank": self.rank, "node": self.node_id}


def free_port(host: str) -> int:
    """A port free on ``host`` now (the rank binds it a moment later, when it joins)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def hostfile(addresses: list[RankAddress]) -> list[list[str]]:
    """The ring backend's hostfile: each rank's addresses, in rank order."""
    return [[a.endpoint] for a in sorted(addresses, key=lambda a: a.rank)]


def join_group(rank: int, hosts: list[list[str]], parallel: ParallelProfile) -> Any:
    """Join the model's group as ``rank`` (blocks until every rank joined).

    ``ring``: TCP between the ranks' addresses. ``jaccl`` (RDMA over Thunderbolt 5, Macs
    only): rank 0's address coordinates, and each node's ``MLX_IBV_DEVICES`` (as
    ``mlx.distributed_config`` writes it) must be set in its environment.
    """
    import mlx.core as mx

    os.environ["MLX_RANK"] = str(rank)
    if parallel.distributed_backend == "ring":
        fd, path = tempfile.mkstemp(prefix="serve_app_ring_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(hosts, f)
        os.environ["MLX_HOSTFILE"] = path
    else:
        if "MLX_IBV_DEVICES" not in os.environ:
            raise RuntimeError("parallel.distributed_backend jaccl needs MLX_IBV_DEVICES in "
                               "every node's environment (see mlx.distributed_config)")
        os.environ["MLX_JACCL_COORDINATOR"] = hosts[0][0]
    group = mx.distributed.init(backend=parallel.distributed_backend, strict=True)
    if group.size() != parallel.size or group.rank() != rank:
        raise RuntimeError(f"joined as rank {group.rank()} of {group.size()}, expected rank "
                           f"{rank} of {parallel.size}")
    return group
