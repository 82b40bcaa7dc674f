"""The model replica deployment: one model's engine and cache client in a Ray Serve
replica. It takes prepared requests (or prepares them itself), streams event batches
back, reports routing stats and its node's stats. The serving logic lives in
``serve_app.serving.service``; this is the Ray glue around it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from serve_app.cluster.replicas import ReplicaReport
from serve_app.config.profile import (
    CacheStoreProfile,
    ModelProfile,
)
from serve_app.deploy.pool import UNLOAD_REASONS
from serve_app.deploy.stage import PrepareStage
from serve_app.memory.machine import probe_machine, process_rss_bytes, trim_malloc
from serve_app.memory.plan import ModelMemory, PlannedMemory, ReplicaMemory
from serve_app.metrics.samples import memory_samples, pool_samples, rank_samples
from serve_app.metrics.table import MetricsPump, RayRecorder
from serve_app.models.compat import TOKENIZER_FILES, download_model
from serve_app.models.phase import (
    ModelLoadError,
    PhaseBoard,
    load_failure_reason,
    replica_identity,
)
from serve_app.parallel.group import RankStatus
from serve_app.serving.errors import (
    model_load_failed_error,
)
from serve_app.serving.events import Event, Tokens
from serve_app.serving.replica_stats import ReplicaProcess, ReplicaStats
from serve_app.serving.request import ApiError, Caller, OpenAIRequest

if TYPE_CHECKING:  # MLX and the grammar library load in replicas only (and where needed)
    from serve_app.deploy.ranks import Ranks
    from serve_app.serving.engine_ranks import RankEngine
    from serve_app.serving.prepare import PreparedRequest, Preparer
    from serve_app.serving.selfbench import SelfBenchmark
    from serve_app.serving.service import ModelService
    from serve_app.store.client import RayCacheClient

logger = logging.getLogger("ray.serve")

ROUTING_STATS_PERIOD_S = 2.0  # how often Serve polls a replica's record_routing_stats
UNLOAD_WAIT_S = 5.0  # an unload waits this long for requests closing in the replica
DEMOTE_WAIT_S = 10.0  # ... and this long for its blocks to reach SSD (then they stay hot)


class ModelReplica:
    """Serves one model through a ``ModelService``; the model pool (``serve_app.deploy.pool``,
    run by the ingress) loads and unloads the model inside this process, which keeps its
    cache client (the SSD tier's conversations come back after a reload)."""

    def __init__(self, profile: ModelProfile, model_home: str | None,
                 cache_store: CacheStoreProfile, memory: ModelMemory | None = None,
                 load_at_start: bool = True) -> None:
        from serve_app.store.client import connect_store

        self.profile = profile  # validated by the builder, pickled to this replica as is
        self.model_home = Path(model_home).expanduser() if model_home else None
        client = None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.loop_thread: str | None = None  # where Serve runs our async code (stats)
        if self.profile.cache.enabled:
            # Waits for the store (here, not in the first request); one that never starts
            # fails this replica with a reason. A sharded model's ranks (one model, one
            # replica) fetch nothing from other nodes: each holds its own share.
            client = connect_store(cache_store, directory=self.profile.parallel is None)
        self.client = client
        self.cache_store = cache_store
        self.recorder = RayRecorder("replica", serve=True)
        # This model's part of the memory plan: MLX's limits (on Metal; advisory elsewhere)
        # and its KV budget, applied at every load.
        self.memory = memory
        self.machine = probe_machine()
        # The model, while loaded (None: unloaded by the pool, or not loaded yet).
        self.service: ModelService | None = None
        # The pool's doings here (the metrics pump exports them): loads after start, their
        # seconds, unloads by the ingress's reason.
        self.loads = 0
        self.load_seconds = 0.0
        self.unloads = dict.fromkeys(UNLOAD_REASONS, 0)
        self.demoted = (0, 0)  # blocks, bytes of the last unload taken out of the hot tier
        self.active = 0  # generate / count_tokens calls here now (unload waits for none)
        self._transition: asyncio.Lock | None = None
        # Templating and tokenizing a long prompt must not stall other streams.
        self.stage = PrepareStage()
        self.prepare_pool = self.stage.pool
        # What this replica is doing, for the ingress's /health and /v1/models (it answers
        # no call before __init__ returns).
        self.board = PhaseBoard(*replica_identity(profile.name))
        self.load_error: str | None = None
        # A model sharded over ranks: the other ranks, and why one was lost (if it was).
        self.ranks: Ranks | None = None
        self.lost: str | None = None
        self.identities: frozenset[str] = frozenset()  # its blocks' (cache_identities)
        if load_at_start:
            # Serve routes nothing here before __init__ returns: loading and warming up
            # now keeps MLX's first-use cost out of the first user request. A failed load
            # leaves the replica up, ``failed`` with its reason; a request tries again.
            try:
                self._load(at_start=True)
            except ModelLoadError:
                pass
        else:
            self.board.set("unloaded")
        # Every second: the metrics, then this replica's stats to its node's store, so
        # /v1/stats answered by another replica shows this one too (serve_app.cluster.replicas).
        self.pump = MetricsPump(self.recorder, self.metric_samples,
                                also=self.report if client is not None else None).start()

    # ---- the model pool: load and unload inside this process ------------------------------

    def _load(self, at_start: bool = False) -> ModelService:
        """Load the model and warm it up (blocking: ``__init__``, or a worker thread)."""
        from serve_app.serving.service import ModelService, load_model

        tic = time.perf_counter()
        try:
            if self.profile.parallel is not None:
                service = self._load_sharded()
            else:
                model, tokenizer, model_dir = load_model(self.profile, self.model_home,
                                                         self._progress())
                self.board.set("loading")
                service = ModelService(self.profile, model, tokenizer, model_dir,
                                       self.client, self.recorder)
        except Exception as exc:
            raise self._failed(exc) from exc
        try:
            self.board.set("warming")
            seconds = self._prepare(service)
        except BaseException as exc:  # a failed load holds nothing: the pool may load others
            _free(service, None)
            if isinstance(exc, Exception):
                raise self._failed(exc) from exc
            raise
        self.service = service
        self.identities = self._identities(service)
        self.load_error = None
        self.board.inputs = ["text", "image"] if service.engine.vision is not None else None
        self.board.set("ready")
        took = time.perf_counter() - tic
        if not at_start:
            self.loads += 1
            self.load_seconds += took
        logger.info("model %s ready (source %s; loaded in %.2f s, warm-up %.2f s)",
                    self.profile.name, self.profile.source, took, seconds)
        return service

    def _identities(self, service: ModelService) -> frozenset[str]:
        cache = service.cache
        if not cache.enabled:
            return frozenset()
        if self.profile.parallel is None:
            return frozenset({cache.identity})
        from serve_app.cache.hashing import shard_identity
        from serve_app.deploy.ranks import shard_name

        return frozenset(shard_identity(cache.model_identity, shard_name(self.profile, r))
                         for r in range(self.profile.parallel.size))

    def _load_sharded(self) -> ModelService:
        """Rank 0 of a model sharded over ranks: start the others (``deploy/ranks.py``),
        join their group, load this rank's share; a watchdog then pings them."""
        from serve_app.deploy.ranks import Ranks, load_shard, shard_name
        from serve_app.parallel.lockstep import Channel
        from serve_app.serving.engine_ranks import RankEngine
        from serve_app.serving.service import ModelService, source_path

        source_path(self.profile.source, self.model_home, self._progress())  # materialize
        self.board.set("loading")
        home = str(self.model_home) if self.model_home else None
        ranks = self.ranks = Ranks(self.profile, home, self.cache_store)
        ranks.start_others()
        group = ranks.join()
        model, tokenizer, model_dir = load_shard(self.profile, group, self.model_home)
        service = ModelService(self.profile, model, tokenizer, model_dir, self.client,
                               self.recorder, lockstep=Channel(group),
                               shard=shard_name(self.profile, 0), wake_others=ranks.wake)
        try:
            ranks.wait_started()
        except BaseException:
            service.shutdown()
            raise
        service.shards = ranks  # requests restore what every rank holds
        engine = service.engine
        assert isinstance(engine, RankEngine)
        engine.ranks.describe_loss = ranks.describe_loss
        self.board.parallel = ranks.parallel_entry()
        threading.Thread(target=self._watch_ranks, args=(engine,), name="rank-watchdog",
                         daemon=True).start()
        return service

    def _watch_ranks(self, engine: RankEngine) -> None:
        """Ping the other ranks and watch the steps: a rank that is lost or does not answer
        in time, or no step completing for ``rank_timeout_s`` (or three times the longest
        step yet, if more) while requests are in flight (a rank whose engine thread is
        stuck still answers pings), ends every request of the model with 503 naming it,
        and fails the health check (Serve then replaces this replica, its ranks with it)."""
        ranks = self.ranks
        assert ranks is not None and self.profile.parallel is not None
        timeout = self.profile.parallel.rank_timeout_s
        steps, since = -1, time.monotonic()
        while self.lost is None:
            why = ranks.ping()
            snap, now = engine.snapshot(), time.monotonic()
            if snap.steps != steps or snap.in_flight == 0:
                steps, since = snap.steps, now
            if why is None and now - since > max(timeout, 3 * snap.longest_step_seconds):
                why = ranks.describe_stall(now - since)
            broken = engine.broken
            if why is not None or broken is not None:
                self.lost = (f"model {self.profile.name!r}: {why}" if why is not None
                             else str(broken))
                logger.error("%s; the replica is unhealthy until Serve replaces it",
                             self.lost)
                engine.abandon(self.lost)
                return
            time.sleep(1.0)

    def check_health(self) -> None:
        """Serve's health check: a sharded model that lost a rank is unhealthy."""
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def _progress(self):
        """Download and materialize progress: to the console and to the phase board."""
        from serve_app.models.wheels import console_progress

        console = console_progress(self.profile.name)

        def report(p) -> None:
            console(p)
            self.board.set(p.phase, p.done_bytes or None, p.total_bytes or None)

        return report

    def _failed(self, exc: Exception) -> ModelLoadError:
        """The phase ``failed``, with the cause and what to do, logged and returned."""
        reason = load_failure_reason(self.profile.source, exc)
        self.load_error = reason
        self.board.set("failed", reason=reason)
        logger.error("model %s failed to load: %s", self.profile.name, reason)
        return ModelLoadError(reason)

    def _prepare(self, service: ModelService) -> float:
        """A new service's memory limits, store activation, warm-up (its seconds) and KV
        budget."""
        memory = self.memory
        if memory is not None:  # MLX's limits before the warm-up
            service.engine.set_memory_limits(memory.limits(self.machine))
            if memory.hot_share_bytes > 0:  # a larger conversation is kept out of RAM
                service.cache.snapshot_limit_bytes = memory.hot_share_bytes
        if self.client is not None and service.cache.enabled:
            self.client.activate(self.profile.name, service.cache.identity,
                                 service.layout.digest, timeout=120)
        seconds = service.warm_up()
        if memory is not None:  # the KV budget after it (the warm-up never waits on it)
            service.engine.set_kv_budget(memory.kv_share_bytes)
        return seconds

    @property
    def transition(self) -> asyncio.Lock:
        if self._transition is None:  # made on Serve's loop, which uses it
            self._transition = asyncio.Lock()
        return self._transition

    async def _loaded(self) -> ModelService:
        """The loaded service, loading it first when the pool unloaded it."""
        service = self.service
        if service is not None:
            return service
        async with self.transition:
            if self.service is None:
                try:
                    await asyncio.to_thread(self._load)
                except ModelLoadError as exc:
                    raise model_load_failed_error(
                        f"model {self.profile.name!r} could not be loaded: {exc}") from None
            assert self.service is not None
            return self.service

    async def load(self) -> str:
        """Load the model (the pool's call); returns once it is loaded and warmed."""
        await self._loaded()
        return "loaded"

    async def unload(self, reason: str = "capacity") -> bool:
        """Free the model (the pool's call, for ``reason``: ``capacity`` or ``idle``): its
        engine, weights and KV, and MLX's buffer cache. Refused (False) while a request is
        here; True when it is unloaded."""
        async with self.transition:
            service = self.service
            if service is None:
                return True
            # A request the ingress saw end may still be closing here (a stream's last
            # chunk goes out before its generator's cleanup): wait for it, briefly.
            deadline = time.monotonic() + UNLOAD_WAIT_S
            while self._busy(service):
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.02)
            self.service = None
            self.demoted = await asyncio.to_thread(_free, service, self.client)
            self.unloads[reason if reason in self.unloads else "capacity"] += 1
            self.board.set("unloaded")
            logger.info("model %s unloaded (memory freed; its SSD cache stays)",
                        self.profile.name)
            return True

    def _busy(self, service: ModelService) -> bool:
        return bool(self.active or self.stage.busy or service.engine.stats.in_flight)

    async def status(self) -> str:
        """``loaded`` or ``unloaded``: what the pool reconciles its view with."""
        return "unloaded" if self.service is None else "loaded"

    def cache_identities(self) -> frozenset[str]:
        """The identities this model's blocks are stored under (every rank's for a sharded
        model): what a cache clear removes. Known once the model was loaded in this
        process (a hash of its weights and template); empty before, or with the cache off."""
        return self.identities

    async def self_benchmark(self, ssd_bytes: int) -> SelfBenchmark:
        """This node's SSD cache directory and this model (when loaded) measured
        (``serve_app.serving.selfbench``); only when asked."""
        from serve_app.serving.selfbench import run_self_benchmark
        from serve_app.store.actor import ssd_dir_of

        ssd_dir = (Path(ssd_dir_of(self.cache_store.ssd_dir)).expanduser()
                   if self.cache_store.ssd else None)
        self.active += 1  # the pool does not unload it meanwhile
        try:
            return await asyncio.to_thread(run_self_benchmark, self.profile.name,
                                           self.node_id, ssd_dir, ssd_bytes, self.service)
        finally:
            self.active -= 1

    async def ready(self) -> bool:
        """Answered only once __init__ (load and warm-up, for a model loaded at start) is
        done: the ingress's probe."""
        self.loop_thread = threading.current_thread().name
        return True

    async def generate_all(self, request: OpenAIRequest | PreparedRequest,
                           caller: Caller) -> list[list[Event]]:
        """``generate``'s event batches in one reply, for a request answered in one piece
        (each streamed batch is a Ray round trip to the ingress)."""
        return [batch async for batch in self.generate(request, caller)]

    async def generate(self, request: OpenAIRequest | PreparedRequest,
                       caller: Caller) -> AsyncIterator[list[Event]]:
        """Event batches for one request, which the ingress has already validated (and,
        where replicas are routed on prefixes, prepared: the router needed its tokens).
        An unloaded model is loaded first (the pool loads it before it sends requests;
        this covers a request that reached an unloaded replica anyway)."""
        from serve_app.serving.prepare import PreparedRequest

        self.active += 1
        try:
            try:
                service = await self._loaded()
                self._admit(service)  # before any templating: a full model costs nothing
                if isinstance(request, PreparedRequest):
                    prepared = request
                else:
                    prepared = await self.stage.run(service.prepare, request, caller)
                # A request whose KV alone is over the model's KV budget: 429 before its
                # grammar.
                self._admit(service, prepared)
                # Grammars compile here, off the event loop (cached per schema).
                processors = await self.stage.run(service.constraints, prepared)
            except ApiError as exc:
                yield [exc.to_failure()]
                return
            sent = 0
            async for events in service.stream(prepared, processors):
                yield events
                if DIE_ENV in os.environ:
                    sent += sum(len(e.ids) for e in events if isinstance(e, Tokens))
                    _die_after(sent)
        finally:
            self.active -= 1

    async def count_tokens(self, request: OpenAIRequest, caller: Caller) -> int:
        """Prompt tokens of a request, templated as it would be served (no generation)."""
        self.active += 1
        try:
            service = await self._loaded()
            self._admit(service)  # the same admission as a generation
            return await self.stage.run(service.preparer.count, request)
        finally:
            self.active -= 1

    def _admit(self, service: ModelService, prepared: PreparedRequest | None = None) -> None:
        """429 when the engine is full (``admission.refusal``), or, for a prepared
        request, when its KV alone could never fit; then when too many requests wait
        to be prepared. A request that fits waits in the engine while the running
        requests' KV leaves no room for it."""
        from serve_app.serving.admission import refusal

        prompt = None if prepared is None else len(prepared.prompt)
        refused = refusal(service.engine, prompt,
                          0 if prepared is None else prepared.params.max_tokens)
        if refused is not None:
            raise refused
        if prepared is None:
            self.stage.admit(self.profile.name)

    def metric_samples(self) -> list:
        """The service's samples and this model's memory (the metrics pump's thread)."""
        service = self.service
        own = service.metric_samples() if service is not None else []
        if service is not None:  # a model in one process is its own rank 0
            own += rank_samples(self.profile.name, self._rank_stats(service))
        return [*own, *memory_samples(self.profile.name, self._memory_stats(service)),
                *pool_samples(self.profile.name, service is not None, self.loads,
                              self.load_seconds, self.unloads)]

    def _memory_stats(self, service: ModelService | None) -> ReplicaMemory:
        """This model's memory on its node (``ReplicaMemory``)."""
        engine = service.engine if service is not None else None
        snap = engine.snapshot() if engine is not None else None
        limits = engine.applied_limits if engine is not None else None
        m = self.memory
        return ReplicaMemory(
            loaded=service is not None,
            total_memory_bytes=self.machine.total_bytes,
            gpu_working_set_bytes=self.machine.gpu_working_set_bytes,
            # Nothing is set off Metal or without a plan (whether loaded or not).
            advisory=not self.machine.metal or self.memory is None,
            planned=None if m is None else PlannedMemory(
                m.weights_bytes, m.kv_bytes, m.hot_share_bytes, m.total_bytes),
            kv_budget_bytes=engine.kv.budget_bytes if engine is not None else None,
            kv_in_use_bytes=snap.kv_in_use_bytes if snap is not None else 0,
            kv_waiting=snap.kv_waiting if snap is not None else 0,
            wired_limit_bytes=limits.wired_bytes if limits is not None else None,
            cache_limit_bytes=limits.cache_bytes if limits is not None else None,
            process_rss_bytes=process_rss_bytes())

    def record_routing_stats(self) -> dict:
        """What the prefix-affinity router needs of this replica (polled by Serve)."""
        from serve_app.cluster.routing import ReplicaInfo

        service = self.service
        if service is None or not service.cache.enabled:
            return {}
        cache, engine = service.cache, service.engine.stats
        return ReplicaInfo(ray.get_runtime_context().get_node_id(), cache.root,
                           cache.settings.block_size, self.profile.max_batch_size,
                           engine.running_batch_size,
                           max(0, engine.in_flight - engine.running_batch_size),
                           cache.remote.prefill_rate or 0.0).to_stats()

    async def stats(self) -> ReplicaStats:
        service = self.service
        stats = (await service.full_stats() if service is not None
                 else ReplicaStats(self.profile.name))
        # Where Serve runs our code: its main loop ("AsyncIO Thread: default") once
        # SERVE_REPLICA_ENV took effect, not a "Thread-N (_run_user_code_event_loop)".
        self.loop_thread = threading.current_thread().name
        return replace(stats, replica=self._replica_stats(service))

    def _replica_stats(self, service: ModelService | None) -> ReplicaProcess:
        return ReplicaProcess(
            pid=os.getpid(), node_id=self.node_id, user_code_thread=self.loop_thread,
            status="loaded" if service is not None else "unloaded",
            loads=self.loads, load_seconds=round(self.load_seconds, 3),
            unloads=dict(self.unloads),
            last_unload_demoted={"blocks": self.demoted[0], "bytes": self.demoted[1]},
            preparing=self.stage.busy, prepare_runs=self.stage.runs,
            memory=self._memory_stats(service),
            ranks=(self._rank_stats(service)
                   if self.ranks is not None and service is not None else ()))

    def _rank_stats(self, service: ModelService) -> tuple[RankStatus, ...]:
        """Each rank's status; a model in one process: rank 0, with no channel."""
        if self.ranks is not None:
            from serve_app.serving.engine_ranks import RankEngine

            assert isinstance(service.engine, RankEngine)
            return self.ranks.stats(service.engine)
        snap = service.engine.snapshot()
        return (RankStatus(0, self.node_id, "", os.getpid(), snap.decode_steps,
                           snap.step_seconds),)

    def report_stats(self) -> ReplicaStats | None:
        """What this replica reports to its node's store: its own stats (no store call;
        any thread); None while unloaded (nothing of its own to total)."""
        service = self.service
        if service is None:
            return None
        own = self.client.own_stats() if self.client is not None else None
        return replace(service.local_stats(), replica=self._replica_stats(service),
                       cache_store=own)

    def report(self) -> None:
        """This replica's stats to its node's store (the metrics pump's thread; never
        waits), where the ingress finds them for ``/v1/stats``."""
        stats = self.report_stats()
        if self.client is not None and stats is not None:
            self.client.report(ReplicaReport(self.profile.name, self.node_id, os.getpid(),
                                             stats))

    def __del__(self) -> None:
        board = getattr(self, "board", None)
        if board is not None:
            board.clear()
        pump = getattr(self, "pump", None)
        if pump is not None:
            pump.stop()
        pool = getattr(self, "prepare_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        service = getattr(self, "service", None)
        if service is not None:
            service.shutdown()


# A replica lost mid-answer at a chosen moment, for the tests (the process really dies: Ray
# sees a lost replica; a test cannot time a kill from outside within a fast stream).
# "N:PATH": once a request has sent N tokens, the replica that removes PATH (the test
# creates it to arm one loss) kills its own process.
DIE_ENV = "SERVE_APP_TEST_DIE_AFTER_TOKENS"


def _die_after(sent: int) -> None:
    after, _, path = os.environ.get(DIE_ENV, "").partition(":")
    if not path or sent < int(after):
        return
    try:
        os.remove(path)  # one replica claims the armed loss
    except OSError:
        return
    logger.error("%s: this replica kills itself after %d tokens", DIE_ENV, sent)
    os.kill(os.getpid(), signal.SIGKILL)


def _free(service: ModelService, client: RayCacheClient | None) -> tuple[int, int]:
    """Free an unloaded model's memory: stop its engine (which lets go of the weights and
    the running batch's KV), take its blocks that the SSD tier holds out of the store's
    RAM (its hot share; a reload restores them from SSD), then hand MLX's buffer cache
    and the C allocator's free pages back to the OS (``malloc_trim``, where glibc has it:
    on Linux the freed weights stay in the process's heap otherwise). Returns the blocks
    and bytes taken out of the hot tier."""
    import gc

    import mlx.core as mx

    service.shutdown()
    demoted = (0, 0)
    if client is not None and service.cache.enabled:
        demoted = client.demote(service.cache.settings.model, service.layout.digest,
                                wait_s=DEMOTE_WAIT_S)
    del service
    gc.collect()
    mx.clear_cache()
    trim_malloc()
    return demoted


def load_preparer(profile: ModelProfile, model_home: str | None) -> Preparer:
    """A model's request preparer with its tokenizer only (no weights)."""
    from mlx_lm.utils import load_tokenizer

    from serve_app.serving.prepare import Preparer
    from serve_app.serving.service import source_path

    home = Path(model_home).expanduser() if model_home else None
    # Only the tokenizer's files: the ingress's node needs no weights for it.
    model_dir = download_model(source_path(profile.source, home), profile.revision,
                               allow_patterns=TOKENIZER_FILES)
    return Preparer(profile, load_tokenizer(model_dir, profile.tokenizer_config()),
                    branch_points=profile.cache.enabled)
