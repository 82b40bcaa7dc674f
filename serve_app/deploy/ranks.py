"""The ranks of a model sharded over several processes, as Ray actors.

The model's Serve replica is rank 0: it holds a placement group of ``size`` bundles
(Serve's ``placement_group_bundles``: one per node with ``placement: spread``), starts
ranks 1.. as ``Rank`` actors in bundles 1.., hands every rank the hostfile built from
their addresses, and joins the group itself. Each rank loads its share of the model and
runs an engine that replays rank 0's (``serve_app.parallel.lockstep``). The actors are
owned by the replica: when Serve replaces it, its ranks go with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.config.profile import CacheStoreProfile, ModelProfile
from serve_app.parallel.group import (
    RankAddress,
    RankStatus,
    free_port,
    hostfile,
    join_group,
)

if TYPE_CHECKING:
    from serve_app.parallel.lockstep import Insert
    from serve_app.serving.engine_events import EngineEvent
    from serve_app.serving.engine_ranks import RankEngine

logger = logging.getLogger("ray.serve")


# A plan rank 0 neither inserts nor forgets (``Forget``) is let go after this long: a
# last resort, far longer than a request waits in rank 0's queue.
PLAN_TTL_S = 3600.0
PLAN_WAIT_S = 60.0  # the longest a rank plans a request (store calls are bounded well below)


def shard_name(profile: ModelProfile, rank: int) -> str:
    """A rank's part of the model, in its cache identity: ``tensor:0/2``."""
    assert profile.parallel is not None
    return f"{profile.parallel.mode}:{rank}/{profile.parallel.size}"


def open_cache(profile: ModelProfile, layout: Any, cache_store: CacheStoreProfile,
               model_dir: Path, chat_template: str | None, rank: int) -> Any:
    """A rank's prefix cache, in its node's store, under its own identity."""
    from serve_app.cache.manager import CacheManager
    from serve_app.store.client import connect_store

    client = connect_store(cache_store, directory=False) if profile.cache.enabled else None
    cache = CacheManager.for_model(profile, layout, client, model_dir, chat_template,
                                   shard=shard_name(profile, rank))
    if client is not None and cache.enabled:
        client.activate(profile.name, cache.identity, layout.digest, timeout=120)
    return cache


def load_shard(profile: ModelProfile, group: Any, home: Path | None = None):
    """This rank's share of the model: (model, tokenizer, model directory). From a hub
    each rank downloads only the weight files of its share (``sharded_load``)."""
    from mlx_lm.utils import sharded_load

    from serve_app.models.compat import TOKENIZER_FILES, download_model
    from serve_app.serving.service import source_path

    assert profile.parallel is not None
    source = source_path(profile.source, home)
    tensor = profile.parallel.mode == "tensor"
    model, tokenizer = sharded_load(source,
                                    pipeline_group=None if tensor else group,
                                    tensor_group=group if tensor else None,
                                    tokenizer_config=profile.tokenizer_config())
    return model, tokenizer, download_model(source, allow_patterns=TOKENIZER_FILES)


def _address(rank: int, pack: bool) -> RankAddress:
    host = "127.0.0.1" if pack else ray.util.get_node_ip_address()
    return RankAddress(rank, ray.get_runtime_context().get_node_id(), host, free_port(host))


class RankProcess:
    """Rank ``rank`` (>= 1) of a sharded model: its share of the weights and an engine
    that follows rank 0's."""

    def __init__(self, profile: ModelProfile, model_home: str | None, rank: int,
                 cache_store: CacheStoreProfile) -> None:
        self.profile, self.rank = profile, rank
        self.home = Path(model_home).expanduser() if model_home else None
        assert profile.parallel is not None
        self.where = _address(rank, profile.parallel.placement == "pack")
        self.engine: Any = None
        self.cache_store = cache_store
        self.cache: Any = None  # this rank's prefix cache (its share of every block)
        # Cache plans rank 0 asked for, by request key, with when they were made.
        self.plans: dict[str, tuple[Any, float]] = {}
        self._plans_lock = threading.Lock()
        # The cache's lookups are coroutines: they run on this loop's thread.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rank-cache", daemon=True).start()

    def address(self) -> RankAddress:
        return self.where

    def start(self, hosts: list[list[str]]) -> RankStatus:
        """Join the group, load this rank's share, start the following engine; returns
        once it probed the model with rank 0 (a forward of every rank together)."""
        from serve_app.kvquant.format import quant_of
        from serve_app.parallel.lockstep import Channel
        from serve_app.serving.engine_ranks import RankEngine

        profile = self.profile
        assert profile.parallel is not None
        group = join_group(self.rank, hosts, profile.parallel)
        model, tokenizer, model_dir = load_shard(profile, group, self.home)
        self.engine = RankEngine(model, channel=Channel(group), follower_plan=self._plan_for,
                                 stop_tokens=set(tokenizer.eos_token_ids),
                                 max_batch_size=profile.max_batch_size,
                                 max_queued_requests=profile.max_queued_requests,
                                 prefill_step_size=profile.prefill_step_size,
                                 kv_quant=quant_of(profile.kv_cache),
                                 name=f"{profile.name}-rank{self.rank}")
        layout = self.engine.wait_ready(600)
        self.cache = open_cache(profile, layout, self.cache_store, model_dir,
                                tokenizer.chat_template, self.rank)
        return self._status()

    # ---- this rank's prefix cache ----------------------------------------------------------

    @ray.method(concurrency_group="plans")
    def plan(self, key: str, prompt: list[int], limit: int, salt: str | None,
             api_key_digest: str | None, branch_points: tuple[int, ...]) -> int:
        """Plan a request's restore here (at most ``limit`` tokens) under ``key``; how
        many tokens this rank can restore. Asked again, the plan before is let go."""
        self._drop(key)
        now = time.monotonic()
        with self._plans_lock:
            stale = [k for k, (_, at) in self.plans.items() if now - at > PLAN_TTL_S]
        for k in stale:  # planned, then neither inserted nor forgotten by rank 0
            self._drop(k)
        future = asyncio.run_coroutine_threadsafe(
            self.cache.plan(prompt, salt=salt, api_key_digest=api_key_digest,
                            branch_points=branch_points, limit=limit, wait_inflight=False),
            self.loop)
        try:
            plan = future.result(timeout=PLAN_WAIT_S)
        except BaseException:
            future.add_done_callback(self._let_go_late)  # rank 0 gave up on it
            raise
        with self._plans_lock:
            self.plans[key] = (plan, now)
        return plan.restore_tokens if plan is not None else 0

    @ray.method(concurrency_group="plans")
    def drop(self, key: str) -> None:
        self._drop(key)

    def _let_go_late(self, future: Any) -> None:
        """A plan made after rank 0 stopped waiting for it: its claims and pins go."""
        if not future.cancelled() and future.exception() is None \
                and future.result() is not None:
            self._let_go(future.result(), lease=True)

    def _drop(self, key: str) -> None:
        with self._plans_lock:
            entry = self.plans.pop(key, None)
        if entry is not None and entry[0] is not None:
            self._let_go(entry[0], lease=True)

    def _let_go(self, plan: Any, lease: bool) -> None:
        """On the cache's loop: the plan's claims (and its pins, with ``lease``)."""
        cache = self.cache

        def settle() -> None:
            cache.settle(plan)
            if lease:
                asyncio.ensure_future(cache.release(plan.lease))

        self.loop.call_soon_threadsafe(settle)

    def _plan_for(self, command: Insert) -> tuple[Any, Callable]:
        """The engine thread: the plan rank 0's request was planned with here, and what
        lets its pins go once restored and its claims once it ends."""
        with self._plans_lock:
            entry = self.plans.pop(command.plan_key, None) if command.plan_key else None
        plan = entry[0] if entry is not None else None
        if plan is None:
            return None, lambda event: None
        cache, loop = self.cache, self.loop

        def sink(event: EngineEvent) -> None:
            if event.restored is not None:  # the engine copied the restored blocks
                lease = plan.lease
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(cache.release(lease)))
            if event.finish_reason is not None or event.error is not None:
                self._let_go(plan, lease=False)

        return plan, sink

    @ray.method(concurrency_group="control")
    def wake(self, number: int) -> None:
        """Rank 0 has work again (its engine sleeps outside the group meanwhile)."""
        if self.engine is not None:
            self.engine.ranks.wake(number)

    @ray.method(concurrency_group="control")
    def status(self) -> RankStatus:
        return self._status()

    def _status(self) -> RankStatus:
        engine = self.engine
        stats = engine.snapshot() if engine is not None else None
        return RankStatus(
            self.rank, self.where.node_id, self.where.host, os.getpid(),
            steps=stats.steps if stats else 0,
            step_seconds=stats.step_seconds if stats else 0.0,
            channel_seconds=engine.ranks.channel.seconds if engine is not None else 0.0,
            command_messages=engine.ranks.channel.messages if engine is not None else 0,
            command_bytes=engine.ranks.channel.message_bytes if engine is not None else 0,
            broken=engine.broken if engine is not None else None,
            **(engine.ranks.activity() if engine is not None else {}))


# Threaded, in groups: rank 0's pings and wake-ups (``control``) are never queued behind
# cache plans (``plans``) or the load (the default group). (Ray's typed overloads of
# ray.remote omit actor-only options such as concurrency_groups.)
Rank = ray.remote(num_cpus=0, max_concurrency=2,  # type: ignore[call-overload]
                  concurrency_groups={"control": 2, "plans": 8})(RankProcess)


class Ranks:
    """Rank 0's view of the other ranks: started, pinged, described."""

    def __init__(self, profile: ModelProfile, model_home: str | None,
                 cache_store: CacheStoreProfile) -> None:
        parallel = profile.parallel
        assert parallel is not None
        self.profile = profile
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError(f"model {profile.name!r} is sharded (parallel) but its replica "
                               "has no placement group (deploy it with build_app)")
        self.actors = [
            Rank.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get(
                    "OMP_NUM_THREADS", "1")}},
            ).remote(profile, model_home, rank, cache_store)
            for rank in range(1, parallel.size)]
        self.me = _address(0, parallel.placement == "pack")
        others: list[RankAddress] = ray.get([a.address.remote() for a in self.actors],
                                            timeout=600)
        self.addresses = [self.me, *others]
        self.hosts = hostfile(self.addresses)
        self._starting: list = []
        self.statuses: list[RankStatus] = [RankStatus(0, self.me.node_id, self.me.host,
                                                      os.getpid())]
        # ``ShardPlanner``: a planning round longer than this fails (a rank is lost).
        self.timeout_s = PLAN_WAIT_S + parallel.rank_timeout_s
        self.lost: str | None = None

    def start_others(self) -> None:
        """Ranks 1..: join and load (they wait for rank 0 to join)."""
        self._starting = [a.start.remote(self.hosts) for a in self.actors]

    def join(self) -> Any:
        """Rank 0 joins the group (blocks until the others did)."""
        assert self.profile.parallel is not None
        return join_group(0, self.hosts, self.profile.parallel)

    def wait_started(self, timeout: float = 600) -> None:
        self.statuses[1:] = ray.get(self._starting, timeout=timeout)

    def ping(self) -> str | None:
        """Why a rank is lost (named, with its node), or None when every rank answers."""
        assert self.profile.parallel is not None
        timeout = self.profile.parallel.rank_timeout_s
        refs = [a.status.remote() for a in self.actors]
        for rank, ref in enumerate(refs, start=1):
            node = self.addresses[rank].node_id
            try:
                status = ray.get(ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                return f"rank {rank} on node {node} did not answer within {timeout:g} s"
            except ray.exceptions.RayError as exc:
                return f"rank {rank} on node {node} was lost ({type(exc).__name__})"
            if status.broken:
                return f"rank {rank} on node {node} stopped: {status.broken}"
            self.statuses[rank] = status
        return None

    def describe_stall(self, seconds: float) -> str:
        """Why no step completed for ``seconds`` while requests were in flight: the rank
        (as of the last ping) that is in a step, or asleep, the longest; rank 0 then
        waits for it in a collective."""
        others = [s for s in self.statuses[1:] if s.activity not in ("", "commands")]
        stuck = max(others, key=lambda s: s.activity_s, default=None)
        where = ("no rank said why" if stuck is None else
                 f"rank {stuck.rank} on node {stuck.node_id} has been "
                 f"{'in a step' if stuck.activity == 'step' else stuck.activity} for "
                 f"{stuck.activity_s:.0f} s")
        return f"no step completed in {seconds:.0f} s with requests in flight: {where}"

    def describe_loss(self, error: BaseException) -> str:
        """The message a lost rank's requests end with: which rank, on which node."""
        tic = time.monotonic()
        why = self.ping()
        while why is None and time.monotonic() - tic < 5:  # a dying rank: give it a moment
            time.sleep(0.2)
            why = self.ping()
        return f"model {self.profile.name!r}: {why or f'a rank failed ({error})'}"

    async def plan(self, key: str, prompt: list[int], limit: int, *, salt: str | None,
                   api_key_digest: str | None, branch_points: tuple[int, ...]
                   ) -> list[int]:
        """``ShardPlanner``: every other rank plans the request; what each can restore."""
        return list(await asyncio.gather(*(
            a.plan.remote(key, prompt, limit, salt, api_key_digest, branch_points)
            for a in self.actors)))

    def drop(self, key: str) -> None:
        for a in self.actors:
            a.drop.remote(key)

    def wake(self, number: int) -> None:
        """Wake the other ranks after rank 0's ``Idle(number)`` (never waits)."""
        for a in self.actors:
            a.wake.remote(number)

    def parallel_entry(self) -> dict:
        """What ``/v1/models`` shows of the ranks."""
        parallel = self.profile.parallel
        assert parallel is not None
        return {"mode": parallel.mode, "size": parallel.size,
                "ranks": [s.public() for s in self.statuses]}

    def stats(self, engine: RankEngine) -> tuple[RankStatus, ...]:
        """Every rank's status: rank 0's from its own ``engine``, the others' as of the
        last ping."""
        snap = engine.snapshot()
        channel = engine.ranks.channel
        own = RankStatus(0, self.me.node_id, self.me.host, os.getpid(), snap.steps,
                         snap.step_seconds, channel.seconds, channel.messages,
                         channel.message_bytes, engine.broken)
        return (own, *self.statuses[1:])
