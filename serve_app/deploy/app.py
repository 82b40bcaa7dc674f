"""Ray Serve glue: the ingress, one replica deployment per model, the builder.

``serve run configs/qwen.yaml`` imports ``build_app`` and passes it the
application ``args`` (the profile). Everything here is thin: the API logic is
in ``serve_app.api.http`` and ``serve_app.serving.service``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.api import auth
from serve_app.api.http import OpenAIIngress, api
from serve_app.cluster.replicas import Gathered, ReplicaReport, model_view
from serve_app.config import api_keys
from serve_app.config.profile import (
    CacheStoreProfile,
    ModelProfile,
    Profile,
    ProfileError,
    parse_profile,
)
from serve_app.deploy.pool import (
    UNLOAD_REASONS,
    PoolCapacityError,
    PoolGate,
    PoolLoadError,
    loaded_at_start,
    pool_for,
    pooled,
)
from serve_app.memory.plan import (
    MemoryPlan,
    ModelMemory,
    memory_report,
    models_memory,
    probe_machine,
    process_rss_bytes,
    trim_malloc,
)
from serve_app.memory.planning import planned
from serve_app.metrics.table import (
    MetricsPump,
    RayRecorder,
    memory_samples,
    merge_exposition,
    pool_samples,
    zero_at_start,
)
from serve_app.models.compat import TOKENIZER_FILES, download_model, serve_replica_env
from serve_app.models.phase import (
    ModelLoadError,
    ModelPhase,
    PhaseBoard,
    load_failure_reason,
    model_phase,
    read_phases,
    replica_identity,
)
from serve_app.serving.errors import (
    kv_budget_error,
    model_capacity_error,
    model_load_failed_error,
    queue_full_error,
)
from serve_app.serving.events import Event
from serve_app.serving.request import ApiError, Caller, OpenAIRequest

if TYPE_CHECKING:  # MLX and the grammar library load in replicas only (and where needed)
    from serve_app.serving.prepare import PreparedRequest, Preparer
    from serve_app.serving.service import ModelService
    from serve_app.store.client import RayCacheClient

logger = logging.getLogger("ray.serve")

METRICS_FETCH_TIMEOUT_S = 5.0
METRICS_CACHE_S = 1.5  # /metrics answers from one gather of every node for this long
READY_PROBE_TIMEOUT_S = 0.5  # how long /health or a request waits on a model's probe
ROUTING_STATS_PERIOD_S = 2.0  # how often Serve polls a replica's record_routing_stats
# Requests waiting for (or in) a prepare pool, where templating, tokenizing and grammar
# compiling run, beyond which a replica or the ingress answers 429 before doing any of it.
MAX_PREPARING = 16
UNLOAD_WAIT_S = 5.0  # an unload waits this long for requests closing in the replica
DEMOTE_WAIT_S = 10.0  # ... and this long for its blocks to reach SSD (then they stay hot)


class PrepareStage:
    """A prepare pool and the requests admitted to it, waiting or running: a request
    leaves when its work ends or is cancelled before it started (a caller that gave up
    on work already running still holds its place until the work ends)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
        self.busy = 0
        self.runs = 0  # calls run (or queued) so far

    def admit(self, name: str) -> None:
        """429 ``queue_full`` when ``MAX_PREPARING`` requests are in the stage already."""
        if self.busy >= MAX_PREPARING:
            raise queue_full_error(f"model {name!r} is at capacity: {self.busy} requests are "
                                   f"waiting to be templated (at most {MAX_PREPARING}); "
                                   "retry shortly")

    async def run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = self.pool.submit(fn, *args)
        self.busy += 1
        self.runs += 1
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._leave))
        return await asyncio.wrap_future(future)

    def _leave(self) -> None:
        self.busy -= 1


class ModelReplica:
    """Serves one model through a ``ModelService``; the model pool (``serve_app.deploy.pool``,
    run by the ingress) loads and unloads the model inside this process, which keeps its
    cache client (the SSD tier's conversations come back after a reload)."""

    def __init__(self, profile: ModelProfile, model_home: str | None,
                 cache_store: CacheStoreProfile, memory: ModelMemory | None = None,
                 load_at_start: bool = True) -> None:
        from serve_app.cache.client import CircuitBreaker
        from serve_app.cluster.directory_service import DirectoryFollower
        from serve_app.store.actor import get_or_create_actor
        from serve_app.store.client import RayCacheClient

        self.profile = profile  # validated by the builder, pickled to this replica as is
        self.model_home = Path(model_home).expanduser() if model_home else None
        client = None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.loop_thread: str | None = None  # where Serve runs our async code (stats)
        if self.profile.cache.enabled:
            # Waits for the actor (and replaces one of older code), here, not in the
            # first request; a store that never starts fails this replica with a reason.
            actor = get_or_create_actor(cache_store)
            # The replica's copy of the cluster's block directory: which other node holds
            # more of a prompt (then it fetches those blocks instead of prefilling them).
            follower = DirectoryFollower().start() if cache_store.directory != "off" else None
            # A store that fails costs requests their cache, never the request: calls are
            # bounded, a failing store is skipped for a while, a dead one is replaced.
            client = RayCacheClient(
                actor, follower, timeout=cache_store.call_timeout_s,
                reconnect=lambda: get_or_create_actor(cache_store),
                breaker=CircuitBreaker(cache_store.breaker_failures,
                                       cache_store.breaker_cool_down_s))
        self.client = client
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
            model, tokenizer, model_dir = load_model(self.profile, self.model_home,
                                                     self._progress())
            self.board.set("loading")
            service = ModelService(self.profile, model, tokenizer, model_dir, self.client,
                                   self.recorder)
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
        self.load_error = None
        self.board.set("ready")
        took = time.perf_counter() - tic
        if not at_start:
            self.loads += 1
            self.load_seconds += took
        logger.info("model %s ready (source %s; loaded in %.2f s, warm-up %.2f s)",
                    self.profile.name, self.profile.source, took, seconds)
        return service

    def _progress(self):
        """Download and materialize progress: to the console and to the phase board."""
        from serve_app.models.smollm2 import console_progress

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
                self._admit_kv(service, prepared)
                # Grammars compile here, off the event loop (cached per schema).
                processors = await self.stage.run(service.constraints, prepared)
            except ApiError as exc:
                yield [exc.to_failure()]
                return
            async for events in service.stream(prepared, processors):
                yield events
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

    def _admit(self, service: ModelService) -> None:
        """429 when the engine is full or too many requests wait to be prepared."""
        engine = service.engine
        if engine.at_capacity():
            raise queue_full_error(engine.capacity_message())
        self.stage.admit(self.profile.name)

    def _admit_kv(self, service: ModelService, prepared: PreparedRequest) -> None:
        """429 ``kv_budget_exceeded`` for a request that could never be admitted (the
        engine would refuse it too, as ``queue_full``); one that fits waits in the engine
        while the running requests' KV leaves no room for it."""
        from serve_app.serving.engine import KVBudgetError

        try:
            service.engine.check_kv(len(prepared.prompt), prepared.params.max_tokens)
        except KVBudgetError as exc:
            raise kv_budget_error(str(exc)) from None

    def metric_samples(self) -> list:
        """The service's samples and this model's memory (the metrics pump's thread)."""
        service = self.service
        own = service.metric_samples() if service is not None else []
        return [*own, *memory_samples(self.profile.name, self._memory_stats(service)),
                *pool_samples(self.profile.name, service is not None, self.loads,
                              self.load_seconds, self.unloads)]

    def _memory_stats(self, service: ModelService | None) -> dict:
        """This model's memory on its node: the plan's numbers, the KV budget and what the
        running requests reserve of it, MLX's limits where set (``advisory``: none is,
        off Metal); ``loaded``: False while the pool has it unloaded (then it holds no
        weights and no KV); ``process_rss_bytes``: this replica's resident memory now."""
        engine = service.engine if service is not None else None
        snap = engine.snapshot() if engine is not None else None
        limits = engine.applied_limits if engine is not None else None
        m = self.memory
        return {
            "loaded": service is not None,
            "total_memory_bytes": self.machine.total_bytes,
            "gpu_working_set_bytes": self.machine.gpu_working_set_bytes,
            # Nothing is set off Metal or without a plan (whether loaded or not).
            "advisory": not self.machine.metal or self.memory is None,
            "planned": None if m is None else {
                "weights_bytes": m.weights_bytes, "kv_bytes": m.kv_bytes,
                "hot_share_bytes": m.hot_share_bytes, "total_bytes": m.total_bytes},
            "kv_budget_bytes": engine.kv_budget_bytes if engine is not None else None,
            "kv_in_use_bytes": snap.kv_in_use_bytes if snap is not None else 0,
            "kv_waiting": snap.kv_waiting if snap is not None else 0,
            "wired_limit_bytes": limits.wired_bytes if limits is not None else None,
            "cache_limit_bytes": limits.cache_bytes if limits is not None else None,
            "process_rss_bytes": process_rss_bytes(),
        }

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
                           max(0, engine.in_flight - engine.running_batch_size)).to_stats()

    async def stats(self) -> dict:
        service = self.service
        out = await service.stats() if service is not None else {"model": self.profile.name}
        # Where Serve runs our code: its main loop ("AsyncIO Thread: default") once
        # SERVE_REPLICA_ENV took effect, not a "Thread-N (_run_user_code_event_loop)".
        self.loop_thread = threading.current_thread().name
        out["replica"] = self._replica_stats(service)
        return out

    def _replica_stats(self, service: ModelService | None) -> dict:
        return {"pid": os.getpid(), "node_id": self.node_id,
                "user_code_thread": self.loop_thread,
                "status": "loaded" if service is not None else "unloaded",
                "loads": self.loads, "load_seconds": round(self.load_seconds, 3),
                "unloads": dict(self.unloads),
                "last_unload_demoted": {"blocks": self.demoted[0], "bytes": self.demoted[1]},
                "preparing": self.stage.busy, "prepare_runs": self.stage.runs,
                "memory": self._memory_stats(service)}

    def report_stats(self) -> dict | None:
        """What this replica reports to its node's store: its own sections of ``stats()``
        (no store call; any thread); None while unloaded (nothing of its own to total)."""
        service = self.service
        if service is None:
            return None
        out = service.local_stats()
        out["replica"] = self._replica_stats(service)
        if self.client is not None:
            out["cache_store"] = self.client.own_stats()
        return out

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
    from serve_app.serving.service import resolve_source

    home = Path(model_home).expanduser() if model_home else None
    # Only the tokenizer's files: the ingress's node needs no weights for it.
    model_dir = download_model(resolve_source(profile, home), profile.revision,
                               allow_patterns=TOKENIZER_FILES)
    return Preparer(profile, load_tokenizer(model_dir, profile.tokenizer_config()),
                    branch_points=profile.cache.enabled)


def deployment_name(model_name: str) -> str:
    """A Serve deployment name for a model name (which may contain '/')."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in model_name)
    return f"model-{safe}"


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: validate the profile, then bind deployments."""
    try:
        profile: Profile = parse_profile(args, where="serve config application args")
    except ProfileError as exc:
        raise ProfileError(
            f"{exc}\n(`python -m serve_app check CONFIG.yaml` names the file too)"
        ) from None
    # Keys are read here, where the application is built (in the environment of `serve
    # run`'s Ray processes); the ingress gets their digests only.
    try:
        digests = api_keys.configured_digests(profile.ingress.api_keys_file)
    except api_keys.ApiKeyError as exc:
        raise ProfileError(str(exc)) from None
    profile = keyed_profile(profile, bool(digests))
    # The memory plan: hot_budget: auto -> bytes, each model's KV share and MLX limits.
    profile, plan = planned(profile)
    memory = models_memory(plan)
    # The model pool: the models loaded at start (the others load on their first request).
    at_start = loaded_at_start(profile, plan)
    handles: dict[str, Any] = {}
    for m in profile.models:
        threads = m.cpu_threads or os.cpu_count() or 1
        options: dict[str, Any] = {}
        if m.max_replicas_per_node is not None:
            options["max_replicas_per_node"] = m.max_replicas_per_node
        if m.prefix_routing:
            # (Ray annotates this __init__'s **kwargs as dicts, each of them)
            options["request_router_config"] = RequestRouterConfig(
                request_router_class="serve_app.cluster.routing:PrefixAffinityRouter",  # type: ignore[arg-type]
                request_router_kwargs={"model": m.name,
                                       "load_cost_tokens": m.routing.load_cost_tokens},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)  # type: ignore[arg-type]
        # serve.deployment(**options)(cls): Ray's annotation says a call given the class
        # returns the decorator too, where it returns the deployment
        replica = serve.deployment(
            name=deployment_name(m.name),
            num_replicas=m.num_replicas,
            ray_actor_options={
                "num_cpus": m.num_cpus,
                "resources": dict(m.resources),
                # Ray forces OMP_NUM_THREADS=1 in actors without whole CPUs, which
                # halves MLX's CPU backend; the engine thread wants the machine.
                "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads),
                                             **serve_replica_env()}},
            },
            # Our own queue answers 429 before Serve would start queueing.
            max_ongoing_requests=m.max_batch_size + m.max_queued_requests + 8,
            health_check_period_s=10,
            **options,
        )(ModelReplica)
        handles[m.name] = replica.bind(m, profile.model_home, profile.cache_store,
                                       memory.get(m.name), m.name in at_start)
    ingress = serve.deployment(
        name="ingress",
        num_replicas=profile.ingress.num_replicas,
        ray_actor_options={"num_cpus": profile.ingress.num_cpus,
                           "runtime_env": {"env_vars": serve_replica_env()}},
        max_ongoing_requests=1000,
    )(Ingress)
    return ingress.bind(profile, handles, digests, plan)


def keyed_profile(profile: Profile, keys_on: bool) -> Profile:
    """The profile as deployed: without the key file's path (the builder read it; the
    ingress may run on a node without the file), and with API keys on, every model's
    cache isolated by key unless ``ingress.share_cache_between_keys``."""
    models = profile.models
    if keys_on and not profile.ingress.share_cache_between_keys:
        models = [m.model_copy(update={"cache": m.cache.model_copy(
            update={"isolate_by_api_key": True})}) for m in models]
    ingress = profile.ingress.model_copy(update={"api_keys_file": None})
    return profile.model_copy(update={"models": models, "ingress": ingress})


# Applied at import time, in every process that loads this module: the replica
# re-imports it, so routes must be bound here, not inside the builder.
@serve.ingress(api)
class Ingress(OpenAIIngress):
    """The OpenAI-compatible HTTP front; routes each request to its model's handle."""

    def __init__(self, profile: Profile, handles: dict[str, DeploymentHandle],
                 api_key_digests: list[str] | None = None,
                 plan: MemoryPlan | None = None) -> None:
        # Before anything else: the keys every route but /health checks (or the
        # WARNING that there are none).
        auth.configure(auth.ApiKeys(api_key_digests or ()))
        self.profile = profile  # validated by the builder, pickled to this replica as is
        self.plan = plan  # the memory plan, made where the application was built
        self.handles = handles
        # Models routed on cached prefixes: the router needs each prompt's tokens, so
        # requests are prepared here (the replica takes them as they are).
        self.preparers = {m.name: load_preparer(m, self.profile.model_home)
                          for m in self.profile.models if m.prefix_routing}
        self.stage = PrepareStage()
        self.prepare_pool = self.stage.pool
        # Requests this ingress has admitted to each prefix-routed model and not seen end.
        self.sent: dict[str, int] = {}
        self.recorder = RayRecorder("ingress", serve=True)
        for m in self.profile.models:  # known series exist before the first request
            zero_at_start(self.recorder, "ingress", m.name)
        self.ready_models: set[str] = set()
        self.probes: dict[str, asyncio.Future] = {}
        # The model pool (serve_app.deploy.pool): loads, unloads, the cap and idle timers.
        self.gate: PoolGate | None = None
        if pooled(profile):
            pool = pool_for(profile, plan)
            pool.start(pool.initial())
            self.gate = PoolGate(pool, self._load_model, self._unload_model,
                                 lambda name: self.sent.get(name, 0),
                                 status=self._model_status)
            try:  # Serve runs this constructor on its event loop
                self.gate.start_idle_checks()
            except RuntimeError:  # no loop (a test): started by the first request
                pass
        # Every node's cache store, where each model replica reports its stats.
        self.stores = StoreReports(self.profile.cache_store.call_timeout_s)
        self.app_name = replica_identity("")[0]  # where the replicas write their phases

    async def stream_events(self, name: str, request: OpenAIRequest, caller: Caller):
        preparer = self.preparers.get(name)
        streamed = request.stream
        if preparer is not None:
            self._admit(name)  # before templating here
        # Counted from here to its last event: the pool never unloads a model serving it.
        sent = self._sent(name)
        try:
            await self._pool_ready(name)
            if preparer is None:  # the replica admits, then prepares
                return sent.watch(self._call(name, request, caller, streamed))
            prepared = await self.stage.run(preparer.prepare, request, caller)
        except BaseException:
            sent.done()
            raise
        return sent.watch(self._call(name, prepared, caller, streamed))

    def _sent(self, name: str) -> _Sent:
        gate = self.gate
        return _Sent(self.sent, name, None if gate is None else gate.pool.used)

    async def _pool_ready(self, name: str) -> None:
        """Return once the pool has ``name`` loaded: at once when it is, else after loading
        it (unloading others first to make room); 503 when it cannot."""
        if self.gate is None:
            return
        try:
            await self.gate.ready(name)
        except PoolCapacityError as exc:
            raise model_capacity_error(str(exc)) from None
        except PoolLoadError as exc:
            raise model_load_failed_error(str(exc)) from None

    async def _load_model(self, name: str) -> None:
        await self.handles[name].load.remote()

    async def _model_status(self, name: str) -> str:
        return str(await self.handles[name].status.remote())

    async def _unload_model(self, name: str, reason: str) -> bool:
        return bool(await self.handles[name].unload.remote(reason))

    async def model_phase(self, name: str) -> ModelPhase:
        """The phases the model's replicas wrote (Ray's KV store, a GCS round trip off the
        event loop), read with whether one answered the readiness probe."""
        ready = await self.model_ready(name)
        try:
            written = await asyncio.to_thread(read_phases, self.app_name, name)
        except Exception as exc:  # the GCS is away: what the probe says
            logger.warning("reading the phase of model %s failed: %r", name, exc)
            written = []
        return model_phase(written, ready)

    def model_status(self, name: str, ready: bool) -> str:
        if not ready:  # its replica is starting (and loads it, when loaded at start)
            return "loading"
        return "loaded" if self.gate is None else self.gate.pool.status(name).reported

    def pool_report(self) -> dict | None:
        gate = self.gate
        return None if gate is None else gate.pool.report(gate.busy)

    def _call(self, name: str, request: OpenAIRequest | PreparedRequest, caller: Caller,
              streamed: bool) -> Any:
        """The replica's event batches: streamed as they come, or, for a request answered
        in one piece, all of them in one reply (one Ray round trip, not one per batch)."""
        handle = self.handles[name]
        if streamed:
            return handle.options(stream=True).generate.remote(request, caller)
        return _Batches(handle.generate_all.remote(request, caller))

    async def count_prompt_tokens(self, name: str, request: OpenAIRequest,
                                  caller: Caller) -> int:
        preparer = self.preparers.get(name)
        if preparer is not None:  # the tokenizer is here: the model need not be loaded
            self._admit(name)
            return await self.stage.run(preparer.count, request)
        sent = self._sent(name)  # the replica templates it: its model must be loaded
        try:
            await self._pool_ready(name)
            return await self.handles[name].count_tokens.remote(request, caller)
        finally:
            sent.done()

    def _admit(self, name: str) -> None:
        """429 before templating at the ingress: when this ingress already has as many
        requests at the model as its replicas take (batch + queue each), or its prepare
        stage is full. The replica still checks its own engine."""
        m = self.profile.model(name)
        capacity = m.num_replicas * (m.max_batch_size + m.max_queued_requests)
        if self.sent.get(name, 0) >= capacity:
            raise queue_full_error(f"model {name!r} is at capacity: {self.sent[name]} "
                                   f"requests in flight ({m.num_replicas} replicas x "
                                   f"(max_batch_size {m.max_batch_size} + max_queued_requests "
                                   f"{m.max_queued_requests}))")
        self.stage.admit(name)

    async def model_ready(self, name: str) -> bool:
        """Ready once a probe of the model's replica answered; a probe is shared by
        every caller until it answers, so waiting callers never pile up calls."""
        if name in self.ready_models:
            return True
        probe = self.probes.get(name)
        if probe is None:
            probe = self.probes[name] = asyncio.ensure_future(self._probe(name))
        try:
            ok = await asyncio.wait_for(asyncio.shield(probe), READY_PROBE_TIMEOUT_S)
        except TimeoutError:
            return False
        finally:
            if probe.done() and self.probes.get(name) is probe:
                del self.probes[name]
        if ok:
            self.ready_models.add(name)
        return ok

    async def _probe(self, name: str) -> bool:
        try:
            return bool(await self.handles[name].ready.remote())
        except Exception as exc:  # e.g. the deployment failed: probe again next time
            logger.warning("readiness probe of model %s failed: %r", name, exc)
            return False

    def replica_lost(self, name: str, exc: Exception) -> bool:
        lost = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
        if isinstance(exc, lost):
            self.ready_models.discard(name)
            if self.gate is not None:  # its replacement holds what it was built to
                asyncio.ensure_future(self.gate.reconcile())
            return True
        return False

    async def model_stats(self) -> dict:
        out = {}
        for name in self.handles:
            out[name] = await self.one_model_stats(name)
        return out

    async def one_model_stats(self, name: str) -> dict:
        """A model's stats: the replica that takes this call (fresh), merged with every
        other replica's last report, gathered from every node's cache store meanwhile
        (``serve_app.cluster.replicas.model_view``: the model's totals and its replicas)."""
        m = self.profile.model(name)
        expected = m.num_replicas if m is not None else 1

        async def answer() -> dict:
            return await self.handles[name].stats.remote()

        if expected == 1:  # the one replica answers: nothing to gather
            return model_view(await answer(), Gathered(), expected)
        if m is not None and not m.cache.enabled:
            return model_view(await answer(), Gathered(not_asked=(
                "this model's prefix cache is off: its replicas have no cache store to "
                "report to, so only the replica that answered is in the totals")), expected)
        answered, gathered = await asyncio.gather(answer(), self.stores.gather(name))
        return model_view(answered, gathered, expected)

    async def metrics_text(self) -> str:
        return await gather_node_metrics()

    def memory_bytes(self, name: str) -> int | None:
        if self.plan is None:
            return None
        return next((m.total_bytes for m in self.plan.models if m.name == name), None)

    def memory_report(self, models: dict) -> dict | None:
        if self.plan is None:
            return None
        return memory_report(self.plan, self.profile.memory.budget, models)


class _Batches:
    """A replica's whole answer (``generate_all``) read like a stream of event batches,
    so a non-streamed request goes through the same consumers as a streamed one."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._batches: list | None = None

    def __aiter__(self) -> _Batches:
        return self

    async def __anext__(self) -> list[Event]:
        if self._batches is None:
            self._batches = list(await self._response)
        if not self._batches:
            raise StopAsyncIteration
        return self._batches.pop(0)

    def cancel(self) -> None:
        self._response.cancel()


class _Sent:
    """One request counted in ``counts[name]`` until its event stream ends, fails or is
    cancelled (or is collected unread); then ``ended(name)`` (the pool's idle clock)."""

    def __init__(self, counts: dict[str, int], name: str,
                 ended: Callable[[str], None] | None = None) -> None:
        self.counts, self.name, self.open, self.ended = counts, name, True, ended
        self.events: Any = None  # the handle's response generator, set by watch()
        counts[name] = counts.get(name, 0) + 1

    def watch(self, events: Any) -> _Sent:
        self.events = events
        return self

    def done(self) -> None:
        if self.open:
            self.open = False
            self.counts[self.name] -= 1
            if self.ended is not None:
                self.ended(self.name)

    def __aiter__(self) -> _Sent:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.events.__anext__()
        except BaseException:  # the end, an error, or the caller cancelled
            self.done()
            raise

    def cancel(self) -> None:
        self.done()
        self.events.cancel()

    def __del__(self) -> None:
        self.done()


class StoreReports:
    """The ingress's way to every node's cache-store actor (found by name per alive
    node, as ``/metrics`` finds every node's export), for the replicas' stats reports.
    Each call is bounded by ``timeout``: a store that does not answer leaves its
    node's replicas out (named in ``Gathered.unreachable``), never fails the call."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.handles: dict[str, Any] = {}  # node id -> its store actor

    async def gather(self, model: str) -> Gathered:
        from serve_app.cluster.directory_service import alive_node_ids

        try:
            nodes = sorted(await asyncio.to_thread(alive_node_ids))
        except Exception as exc:  # the GCS busy: this replica's numbers, and why alone
            return Gathered(not_asked=f"Ray's list of nodes could not be read: {exc!r}")
        found = await asyncio.gather(*(self._of_node(node_id, model) for node_id in nodes))
        reports = tuple(r for part in found if part is not None for r in part)
        return Gathered(reports, tuple(n for n, part in zip(nodes, found, strict=True)
                                       if part is None))

    async def _of_node(self, node_id: str, model: str) -> list[ReplicaReport] | None:
        """The node's reports of ``model``; [] for a node without a store; None: its
        store did not answer."""
        from serve_app.cluster.directory_service import NAMESPACE

        store: Any = self.handles.get(node_id)  # an actor handle
        if store is None:
            try:  # a GCS lookup: off the event loop
                store = await asyncio.to_thread(ray.get_actor, f"cache-store-{node_id}",
                                                namespace=NAMESPACE)
            except ValueError:  # no cached model's replica has run on that node
                return []
            self.handles[node_id] = store
        try:
            return await asyncio.wait_for(store.replica_reports.remote(model), self.timeout)
        except Exception as exc:  # dead, frozen, or older code: leave its replicas out
            logger.warning("replica stats from the cache store of node %s: %r", node_id, exc)
            self.handles.pop(node_id, None)
            return None


class _ScrapeCache:
    """The last merged ``/metrics`` text, kept ``METRICS_CACHE_S``; scrapes that arrive
    while one gathers wait for it instead of calling every node again."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.at = 0.0
        self.pending: asyncio.Future | None = None
        self.gathers = 0  # fan-outs to every node so far

    async def get(self, max_age: float) -> str:
        loop = asyncio.get_running_loop()
        if self.text is not None and loop.time() - self.at < max_age:
            return self.text
        pending = self.pending
        if pending is None or pending.done() or pending.get_loop() is not loop:
            pending = self.pending = asyncio.ensure_future(self._gather())
        return await asyncio.shield(pending)

    async def _gather(self) -> str:
        self.gathers += 1
        text = await _gather_node_metrics()
        self.text, self.at = text, asyncio.get_running_loop().time()
        return text


_scrapes = _ScrapeCache()


async def gather_node_metrics(max_age: float | None = None) -> str:
    """serve_app's families from every alive node's Ray metrics export, merged; at most
    one fan-out to the nodes per ``METRICS_CACHE_S`` however often (or however many at
    once) Prometheus scrapes."""
    return await _scrapes.get(METRICS_CACHE_S if max_age is None else max_age)


async def _gather_node_metrics() -> str:
    nodes = await asyncio.to_thread(ray.nodes)
    urls = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]
    texts = await asyncio.gather(*(asyncio.to_thread(_fetch, url) for url in urls))
    # Parsing every node's text is CPU work: not on the ingress's event loop.
    return await asyncio.to_thread(merge_exposition, [t for t in texts if t])


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=METRICS_FETCH_TIMEOUT_S) as response:
            return response.read().decode()
    except OSError as exc:  # one node down must not blank the others
        logger.warning("reading node metrics from %s failed: %s", url, exc)
        return None
