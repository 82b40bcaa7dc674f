"""Prefix-affinity routing: send a request to the replica that has to prefill the least.

The router runs in the caller's process (the ingress). It hashes the prepared
prompt into the same chained block ids the cache uses, reads which node holds
how much of that chain from its own copy of the cluster's block directory, and
ranks the model's replicas by the seconds each would spend before a request's
first token: the tokens it would still prefill (blocks in RAM cost nothing, on
SSD a little, on another node what fetching them costs) at its own prefill rate,
and, only once its batch is full, the wait for a slot. A replica with free batch
slots costs about nothing more per request it runs (one more row of a batch), so
a session's turns stay with the replica that holds its prefix until queueing says
otherwise. A replica whose batch is full is ranked after every one that is not.
The load is the router's own count of what it sent (authoritative where one
ingress routes); where several do, the replicas' reports count too.
No routing decision makes a remote call; the directory copy is kept current by a
background thread (``DirectoryFollower``).

``rank`` is plain (unit-tested without Ray); ``PrefixAffinityRouter`` is the thin
Ray Serve glue (``RequestRouterConfig``).
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.match import Tier
from serve_app.metrics.table import ROUTING_REASONS, RayRecorder, zero_at_start
from serve_app.serving.prepare import PreparedRequest

logger = logging.getLogger("ray.serve")

# What one more request costs a replica with free batch slots, in prompt tokens: a row
# more in each decode step. Enough to split ties between equal replicas, far less than a
# block of prefix.
SLOT_COST_TOKENS = 4.0
# What restoring a block costs, as a fraction of prefilling it.
TIER_COST: dict[str, float] = {Tier.HOT: 0.0, Tier.SSD: 0.1, Tier.REMOTE: 0.3}
REASONS = ROUTING_REASONS  # the decisions counted (``serve_app_routing_decisions``)
DECIDED_MEMORY = 4096
# How long a replica Ray found unreachable is ranked last: until Serve's controller has
# removed a dead one (its health check, seconds) or a reachable one answers again.
SUSPECT_S = 30.0


@dataclass(frozen=True)
class ReplicaInfo:
    """What a model replica reports for routing (its ``record_routing_stats``)."""

    node_id: str
    root: str  # the unsalted chain root: the same on every replica of one model and layout
    block_size: int
    max_batch_size: int
    running: int = 0
    queued: int = 0
    prefill_tokens_per_s: float = 0.0  # as measured by the replica (0: not yet)

    def to_stats(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaInfo | None:
        """None for a replica that has not reported yet (or serves without a cache)."""
        try:
            return cls(**stats) if stats and stats.get("root") else None
        except TypeError:  # a replica of other code
            return None


@dataclass(frozen=True)
class Candidate:
    key: Any  # the replica's id
    node_id: str
    ongoing: int  # requests it is serving now, as this router counts them
    capacity: int  # requests it runs at once (its batch size)
    suspect: bool = False  # Ray found it unreachable or dead a moment ago
    prefill_rate: float = 0.0  # tokens a second it prefills (0: not measured yet)

    @property
    def overloaded(self) -> bool:
        return self.ongoing >= self.capacity


@dataclass(frozen=True)
class Ranking:
    """Replicas best first, and the tokens each would prefill (in prefill-token units)."""

    order: list[Any]
    prefill: dict[Any, float]
    held: dict[Any, int]  # blocks of the prompt each candidate's node holds
    seconds: dict[Any, float] = field(default_factory=dict)  # expected before prefill ends

    def reason(self, key: Any) -> str:
        """Why ``key`` got the request: the replica with the least to prefill (``prefix``,
        when its node holds some of the prompt), another one for load, or none held any."""
        if self.prefill[key] > min(self.prefill.values()):
            return "load_fallback"
        return "prefix" if self.held.get(key) else "no_prefix"


def prefill_cost(node_id: str, runs: dict[str, list[str]], prompt_tokens: int,
                 block_size: int) -> float:
    """Tokens a replica on ``node_id`` would prefill, with cached blocks credited by tier:
    its own node's run, then what another node holds past it (fetched), then the rest."""
    local = runs.get(node_id, [])
    remote = max((len(t) for n, t in runs.items() if n != node_id), default=0)
    cost = sum(TIER_COST.get(tier, 1.0) for tier in local) * block_size
    cost += max(0, remote - len(local)) * TIER_COST[Tier.REMOTE] * block_size
    return cost + max(0, prompt_tokens - max(len(local), remote) * block_size)


def rank(candidates: list[Candidate], runs: dict[str, list[str]], prompt_tokens: int,
         block_size: int, queue_cost_tokens: float,
         slot_cost_tokens: float = SLOT_COST_TOKENS) -> Ranking:
    """Candidates by the seconds before the request's prefill would end there: its
    prefill cost at the replica's own rate (the median of the measured ones where a
    replica has none yet, or where its own is within a factor of two of the median:
    measurement noise between alike machines must not pin every cold session to the one
    that measured a little faster), plus ``slot_cost_tokens`` per request it runs and, once its
    batch is full, ``queue_cost_tokens`` per request waiting ahead (this one included).
    Those with a full batch rank last, and after them those Ray just found unreachable (a
    dead node's replica holds the prefix until Serve removes it: asked first, it would
    hold a request up). Ties are broken at random, so equal replicas share work."""
    prefill = {c.key: prefill_cost(c.node_id, runs, prompt_tokens, block_size)
               for c in candidates}
    rates = [c.prefill_rate for c in candidates if c.prefill_rate > 0]
    default_rate = median(rates) if rates else 1.0

    def rate(c: Candidate) -> float:
        own = c.prefill_rate
        return own if own > 2 * default_rate or 0 < own < default_rate / 2 else default_rate

    def seconds(c: Candidate) -> float:
        waiting = max(0, c.ongoing - c.capacity + 1)
        tokens = (prefill[c.key] + slot_cost_tokens * min(c.ongoing, c.capacity)
                  + queue_cost_tokens * waiting)
        return tokens / rate(c)

    cost = {c.key: seconds(c) for c in candidates}
    order = sorted(candidates, key=lambda c: (c.suspect, c.overloaded, cost[c.key],
                                              c.ongoing, random.random()))
    held = {c.key: len(runs.get(c.node_id, ())) for c in candidates}
    return Ranking([c.key for c in order], prefill, held, cost)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router for the model deployments (see the module docstring)."""

    # Ray calls this with the deployment's request_router_kwargs as keywords; its base
    # declares them as **kwargs, so any named parameters "break" the override.
    def initialize_state(self, model: str = "",  # type: ignore[override]
                         load_cost_tokens: float = 512.0, follow_s: float = 0.25,
                         routers: int = 1) -> None:
        from serve_app.cluster.directory_service import DirectoryFollower

        self.model = model
        self.load_cost_tokens = load_cost_tokens  # a request waiting for a batch slot
        # How many ingresses route this model: with one, this router's count of what it
        # sent is the whole load; with several, the replicas' reports count too.
        self.routers = routers
        self.follower = DirectoryFollower(follow_s).start()
        self.recorder = RayRecorder("router", serve=False)
        zero_at_start(self.recorder, "router", model)
        self.ongoing: dict[ReplicaID, int] = {}
        self.decided: OrderedDict[str, None] = OrderedDict()  # requests counted already
        self.error_logged = False
        # The model's layout as a replica last reported it (the same on all of them): a
        # router keeps ranking when Serve's copy of a replica's stats is missing or late.
        self.layout: ReplicaInfo | None = None
        # Replicas Ray found unreachable or dead, until when (monotonic): ranked last.
        self.suspects: dict[ReplicaID, float] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """The candidates best first; should ranking fail, the least loaded first (Ray
        would otherwise never resolve the request): counted as ``router_error``, logged
        once per router."""
        try:
            return self._choose(candidate_replicas, pending_request)
        except Exception:  # any bug or bad input here would leave the request hanging
            if not self.error_logged:
                self.error_logged = True
                logger.exception("prefix routing failed for model %s; routing to the least "
                                 "loaded replica (logged once)", self.model)
            if pending_request is not None:
                self._count(pending_request.metadata.internal_request_id, "router_error")
            return self._least_loaded(candidate_replicas)

    def _least_loaded(self, candidate_replicas: list[RunningReplica]
                      ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas,
                         key=lambda r: (self.ongoing.get(r.replica_id, 0), random.random()))
        return [[r] for r in ordered]

    def _choose(self, candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        prepared = _prepared(pending_request)
        if prepared is None or pending_request is None:  # not a generation
            return self._least_loaded(candidate_replicas)
        by_key = {r.replica_id: r for r in candidate_replicas}
        reported = {r.replica_id: ReplicaInfo.from_stats(r.routing_stats)
                    for r in candidate_replicas}
        self.layout = next((i for i in reported.values() if i is not None), self.layout)
        info = self.layout
        request_id = pending_request.metadata.internal_request_id
        if info is None:  # no replica of this model has reported its layout yet
            self._count(request_id, "unranked")
            return self._least_loaded(candidate_replicas)
        bs = info.block_size
        root = salted_root(info.root, prepared.salt, prepared.api_key_digest)
        restorable = (len(prepared.prompt) - 1) // bs
        runs = self.follower.prefix_by_node(chain(root, prepared.prompt[:restorable * bs], bs))
        now = time.monotonic()
        candidates = [Candidate(r.replica_id, _node_of(r, reported[r.replica_id]),
                                self._load(r.replica_id, reported[r.replica_id]),
                                (reported[r.replica_id] or info).max_batch_size,
                                self.suspects.get(r.replica_id, 0.0) > now,
                                _rate(reported[r.replica_id]))
                      for r in candidate_replicas]
        ranking = rank(candidates, runs, len(prepared.prompt), bs, self.load_cost_tokens)
        self._count(request_id, ranking.reason(ranking.order[0]))
        return [[by_key[key]] for key in ranking.order]

    def _load(self, replica_id: ReplicaID, reported: ReplicaInfo | None) -> int:
        """Requests a replica serves: what this router sent it and has not seen end. Where
        other ingresses route too, what the replica last reported, if more (theirs
        included, but up to a couple of seconds old: a replica that just finished a
        request would look busy, so one router never reads it)."""
        own = self.ongoing.get(replica_id, 0)
        if self.routers <= 1 or reported is None:
            return own
        return max(own, reported.running + reported.queued)

    def _count(self, request_id: str, reason: str) -> None:
        """One decision per request (a request Ray routes again after a refusal, or after
        its replica died, is not counted twice)."""
        if request_id in self.decided:
            return
        self.decided[request_id] = None
        if len(self.decided) > DECIDED_MEMORY:
            self.decided.popitem(last=False)
        self.recorder.inc("serve_app_routing_decisions", 1, {"model": self.model, "reason": reason})

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.ongoing[replica_id] = self.ongoing.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.ongoing.get(replica_id, 0) > 0:
            self.ongoing[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.ongoing.pop(replica_id, None)
        self.suspects[replica_id] = time.monotonic() + SUSPECT_S

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self.suspects[replica_id] = time.monotonic() + SUSPECT_S


def _rate(reported: ReplicaInfo | None) -> float:
    return reported.prefill_tokens_per_s if reported is not None else 0.0


def _node_of(replica: RunningReplica, reported: ReplicaInfo | None) -> str:
    """The node a replica runs on: as it reported, else as Serve placed it."""
    return reported.node_id if reported is not None else (replica.node_id or "")


def _prepared(pending_request: PendingRequest | None) -> PreparedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, PreparedRequest) else None

