"""The ingress deployment: the OpenAI/Anthropic HTTP app (``serve_app.api.http``) bound
to the model replicas through their handles, with admission before templating, the
model pool, and the calls to a replica (streamed or in one reply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.api import auth
from serve_app.api.http import api
from serve_app.api.pooling_api import PoolingRoutes
from serve_app.api.status_routes import StatusRoutes
from serve_app.cluster.replicas import Gathered, ModelView, model_view
from serve_app.config.api_keys import KeyDigests
from serve_app.config.profile import Profile
from serve_app.deploy.pool import (
    PoolCapacityError,
    PoolGate,
    PoolLoadError,
    PoolRefused,
    pool_for,
    pooled,
)
from serve_app.deploy.replica import load_preparer
from serve_app.deploy.scrape import StoreReports, gather_node_metrics, node_list
from serve_app.deploy.stage import PrepareStage
from serve_app.memory.plan import MemoryPlan, memory_report
from serve_app.metrics.table import RayRecorder, Recorder, zero_at_start
from serve_app.models.compat import assigned_to_replica
from serve_app.models.phase import (
    ModelPhase,
    model_phase,
    read_phases,
    replica_identity,
)
from serve_app.serving.errors import (
    conflict_error,
    model_capacity_error,
    model_load_failed_error,
    queue_full_error,
)
from serve_app.serving.events import Event
from serve_app.serving.replica_stats import ReplicaStats
from serve_app.serving.request import ApiError, Caller, OpenAIRequest

if TYPE_CHECKING:  # MLX and the grammar library load in replicas only (and where needed)
    from serve_app.cache.stats import Cleared
    from serve_app.pooling.calls import PoolingAnswer, PoolingCall
    from serve_app.serving.events import Failure
    from serve_app.serving.prepare import PreparedRequest
    from serve_app.serving.selfbench import SelfBenchmark

logger = logging.getLogger("ray.serve")


READY_PROBE_TIMEOUT_S = 0.5  # how long /health or a request waits on a model's probe
CLEAR_WAIT_S = 10.0  # a cache clear waits this long for the model's staged SSD writes


# Applied at import time, in every process that loads this module: the replica
# re-imports it, so routes must be bound here, not inside the builder.
@serve.ingress(api)
class Ingress(PoolingRoutes, StatusRoutes):
    """The OpenAI-compatible HTTP front (the routes of ``OpenAIIngress``), the embedding and
    rerank routes (``PoolingRoutes``) and the status page (``StatusRoutes``) on the models'
    Ray Serve handles (``RayModels``)."""

    def __init__(self, profile: Profile, handles: dict[str, DeploymentHandle],
                 keys: KeyDigests | None = None,
                 plan: MemoryPlan | None = None) -> None:
        # Before anything else: the keys every route but /health checks (or the
        # WARNING that there are none).
        keys = keys or KeyDigests()
        auth.configure(auth.ApiKeys(keys.api, keys.admin))
        super().__init__(RayModels(profile, handles, plan))


class RayModels:
    """The ingress's way to its models (``serve_app.api.backend.ModelBackend``): each
    model's deployment handle, admission before templating, preparation for prefix-routed
    models, the model pool, readiness probes, and the stats and metrics of every node."""

    def __init__(self, profile: Profile, handles: dict[str, DeploymentHandle],
                 plan: MemoryPlan | None = None) -> None:
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
        self.recorder: Recorder = RayRecorder("ingress", serve=True)
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
        self.benchmarks: dict[str, SelfBenchmark] = {}  # the last self-benchmark by model
        self.benchmarking: str | None = None  # the model a self-benchmark runs on now
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

    async def run_pooling(self, name: str, call: PoolingCall) -> PoolingAnswer | Failure:
        sent = self._sent(name)  # counted while it runs: the pool never unloads it then
        try:
            await self._pool_ready(name)
            return await self.handles[name].run.remote(call)
        finally:
            sent.done()

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

    async def model_phase(self, name: str, probe: bool = True) -> ModelPhase:
        """The phases the model's replicas wrote (Ray's KV store, a GCS round trip off the
        event loop), read with whether one answered the readiness probe (``probe``
        False: whether one answered it so far, no call to the replica)."""
        ready = await self.model_ready(name) if probe else name in self.ready_models
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
        assert m is not None  # the routes answer 404 for a model not in the profile
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

    async def stats(self) -> dict:
        views = {name: await self.one_model_stats(name) for name in self.handles}
        memory = None if self.plan is None else memory_report(
            self.plan, self.profile.memory.budget,
            [r for view in views.values() for r in view.memory()])
        return {"models": {name: view.to_json() for name, view in views.items()},
                "memory": memory, "pool": self.pool_report(),
                "nodes": [n.to_json() for n in await node_list()],
                "benchmarks": {n: b.to_json() for n, b in self.benchmarks.items()}}

    # ---- asked for on the status page (POST /admin/...) ------------------------------

    def _gate(self) -> PoolGate:
        if self.gate is None:
            raise conflict_error("there is no model pool: with ingress.num_replicas > 1 "
                                 "every model is loaded at start and stays", "no_model_pool")
        return self.gate

    async def load_model(self, name: str) -> None:
        self._gate()
        await self._pool_ready(name)

    async def unload_model(self, name: str) -> None:
        try:
            await self._gate().unload(name)
        except PoolRefused as exc:
            raise conflict_error(str(exc), exc.code) from None

    def pin_model(self, name: str, pinned: bool) -> None:
        try:
            self._gate().pool.pin(name, pinned)
        except PoolRefused as exc:
            raise conflict_error(str(exc), exc.code) from None

    async def clear_cache(self, name: str) -> Cleared:
        """Forget the model's blocks in every node's store (hot and SSD)."""
        m = self.profile.model(name)
        if m is not None and not m.cache.enabled:
            raise conflict_error(f"model {name!r} has no prefix cache (cache.enabled: "
                                 "false)", "cache_disabled")
        identities = await self.handles[name].cache_identities.remote()
        if not identities:
            raise conflict_error(
                f"model {name!r} has not been loaded since its replica started, so its "
                "cache identity (a hash of its weights and template) is not known yet: "
                "load it, then clear its cache", "cache_identity_unknown")
        cleared, unreachable = await self.stores.clear(name, identities, CLEAR_WAIT_S)
        if unreachable:
            raise ApiError(503, f"the cache stores of node(s) {', '.join(unreachable)} did "
                                f"not answer; cleared elsewhere: {cleared}",
                           type="service_unavailable", code="store_unavailable")
        return cleared

    async def self_benchmark(self, name: str, ssd_bytes: int) -> SelfBenchmark:
        """The self-benchmark on the model's replica; one at a time (409 meanwhile)."""
        if self.benchmarking is not None:
            raise conflict_error(f"a self-benchmark is running (on model "
                                 f"{self.benchmarking!r}); retry once it ends",
                                 "benchmark_running")
        self.benchmarking = name
        sent = self._sent(name)  # in flight: the pool never unloads it meanwhile
        try:
            result = await self.handles[name].self_benchmark.remote(ssd_bytes)
        finally:
            sent.done()
            self.benchmarking = None
        self.benchmarks[name] = result
        return result

    async def one_model_stats(self, name: str) -> ModelView:
        """A model's stats: the replica that takes this call (fresh), merged with every
        other replica's last report, gathered from every node's cache store meanwhile
        (``serve_app.cluster.replicas.model_view``: the model's totals and its replicas)."""
        m = self.profile.model(name)
        expected = m.num_replicas if m is not None else 1

        async def answer() -> ReplicaStats:
            stats = await self.handles[name].stats.remote()
            # A replica answers once its constructor is done: as good as the ready probe.
            self.ready_models.add(name)
            return stats

        if expected == 1:  # the one replica answers: nothing to gather
            return model_view(await answer(), Gathered(), expected)
        if m is not None and not m.cache.enabled:
            return model_view(await answer(), Gathered(not_asked=(
                "this model's prefix cache is off: its replicas have no cache store to "
                "report to, so only the replica that answered is in the totals")), expected)
        answered, gathered = await asyncio.gather(answer(), self.stores.gather(name))
        return model_view(answered, gathered, expected)

    async def metrics_text(self) -> str:
        return await gather_node_metrics(models=tuple(m.name for m in self.profile.models))

    def memory_bytes(self, name: str) -> int | None:
        if self.plan is None:
            return None
        return next((m.total_bytes for m in self.plan.models if m.name == name), None)


class _Batches:
    """A replica's whole answer (``generate_all``) read like a stream of event batches,
    so a non-streamed request goes through the same consumers as a streamed one."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._batches: list | None = None

    def __aiter__(self) -> _Batches:
        return self

    async def assigned(self) -> None:
        await assigned_to_replica(self._response)

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

    async def assigned(self) -> None:
        """Once Serve has given the call to a replica (``ModelBackend.stream_events``)."""
        events = self.events
        await (events.assigned() if isinstance(events, _Batches)
               else assigned_to_replica(events))

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
