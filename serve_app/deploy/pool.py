"""The model pool: which models are loaded, which to unload to make room, and when an
idle one goes.

Every model has one Ray Serve replica process for its whole life; the pool loads and
unloads the model *inside* it (``ModelReplica.load`` / ``unload``: weights, engine and
KV freed, the cache client and the SSD tier kept). Why not Ray Serve's scale-to-zero: its
autoscaler decides from request metrics pushed every few seconds and cannot take "unload
the least recently used idle model now, to make room for this request" from the ingress
without a side channel into the controller (Ray 2.60 takes a custom policy only from
code it imports there); it also scales a deployment up from zero on queued requests
before any policy is asked, so the cap would still need a gate here. The ingress sees
every request, so it runs the pool: ``ModelPool`` decides (pure, a clock passed in),
``PoolGate`` carries decisions out with the replicas' ``load`` and ``unload`` calls.

Rules: pinned models are loaded at start and never unloaded; the others load at start
while they fit, then on their first request. A model fits when at most
``max_loaded_models`` are loaded with it and, with another model loaded beside it, their
planned footprints (weights + KV of a full batch at full context) fit in the memory the
plan leaves to models (one model alone always loads: its KV admission keeps it in its
budget). When a request's model does not fit, the least recently used loaded model that
is neither pinned nor serving a request is unloaded first (then the next, until it
fits); when none can be, the request gets 503 ``model_capacity`` with Retry-After.
A model with ``idle_unload_s`` is unloaded once that long has passed since its last
request ended. Nothing in flight is ever unloaded: the ingress counts a request from
before it is sent until its last event, and the replica refuses to unload while it
serves one (``ModelReplica.unload``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serve_app.serving.errors import CAPACITY_RETRY_AFTER_S

if TYPE_CHECKING:
    from serve_app.config.profile import ModelProfile, Profile
    from serve_app.memory.plan import MemoryPlan

logger = logging.getLogger(__name__)

# To make room for another model; its idle_unload_s; asked for (the status page, POST
# /admin/models/{name}/unload).
UNLOAD_REASONS = ("capacity", "idle", "admin")
IDLE_TICK_S = 1.0  # how often the ingress looks for idle models
RECONCILE_S = 30.0  # how often it asks the replicas what they hold
STATUS_TIMEOUT_S = 2.0  # a replica's answer to that, at most


class Status(enum.Enum):
    LOADED = "loaded"
    LOADING = "loading"
    UNLOADING = "unloading"  # still in memory: reported as ``loaded``
    UNLOADED = "unloaded"

    @property
    def reported(self) -> str:
        """``/v1/models``' status: ``loaded``, ``loading`` or ``unloaded``."""
        return "loaded" if self is Status.UNLOADING else self.value

    @property
    def in_memory(self) -> bool:
        return self is not Status.UNLOADED


@dataclass(frozen=True)
class PoolModel:
    """One model as the pool sees it."""

    name: str
    pinned: bool = False  # at start (the profile's ``pinned``, or ``locked``)
    idle_unload_s: float | None = None
    footprint_bytes: int = 0  # planned weights + KV (0: unknown, counted for the cap only)
    locked: str | None = None  # why it can never be unloaded (several replicas, sharded)


@dataclass(frozen=True)
class PoolLimits:
    max_loaded: int | None = None  # memory.max_loaded_models
    room_bytes: int | None = None  # what the plan leaves to loaded models (None: no plan)


@dataclass
class ModelState:
    status: Status = Status.UNLOADED
    pinned: bool = False  # never unloaded; set at start, then by ``ModelPool.pin``
    last_used: float = 0.0  # when its last request arrived or ended (the pool's clock)
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNLOAD_REASONS, 0))
    load_seconds: float = 0.0  # the last load's
    last_error: str | None = None


@dataclass(frozen=True)
class Admission:
    """What it takes to serve a request's model: nothing (it is in memory), or unload
    ``unload`` (least recently used first) and then load it; or ``refused``: why not."""

    load: bool = False
    unload: tuple[str, ...] = ()
    refused: str | None = None


class PoolCapacityError(Exception):
    """No room for a model and nothing that may be unloaded (503 ``model_capacity``)."""


class PoolLoadError(Exception):
    """The model's replica failed to load it (503 ``model_load_failed``)."""


class PoolRefused(Exception):
    """An asked-for change the pool cannot make now (409): the message says why, ``code``
    names it (``model_pinned``, ``model_not_loaded``, ``model_busy``, ``pin_locked``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ModelPool:
    """The pool's state and decisions; no I/O, one thread (the ingress's event loop)."""

    def __init__(self, models: Sequence[PoolModel], limits: PoolLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.models = {m.name: m for m in models}
        self.limits = limits
        self.clock = clock
        now = clock()
        self.states = {m.name: ModelState(last_used=now, pinned=m.pinned or bool(m.locked))
                       for m in models}

    # ---- at start ----------------------------------------------------------------

    def initial(self) -> tuple[str, ...]:
        """The models loaded at start: every pinned one, then the others in the profile's
        order while they fit."""
        chosen: list[str] = [n for n, s in self.states.items() if s.pinned]
        for m in self.models.values():
            if not self.states[m.name].pinned and self._fits(m.name, chosen):
                chosen.append(m.name)
        return tuple(chosen)

    def start(self, loaded: Iterable[str]) -> None:
        """The statuses at start: ``loaded`` models are in memory (their replicas load
        them before they answer), the others unloaded."""
        names = set(loaded)
        for name, state in self.states.items():
            state.status = Status.LOADED if name in names else Status.UNLOADED

    # ---- decisions -----------------------------------------------------------------

    def admit(self, name: str, busy: Callable[[str], int]) -> Admission:
        """What serving ``name`` now takes; ``busy(model)``: its requests in flight."""
        if self.states[name].status.in_memory:
            return Admission()
        in_memory = [n for n, s in self.states.items() if s.status.in_memory]
        if self._fits(name, in_memory):
            return Admission(load=True)
        victims: list[str] = []
        kept = list(in_memory)
        for victim in self._unloadable(busy):
            victims.append(victim)
            kept.remove(victim)
            if self._fits(name, kept):
                return Admission(load=True, unload=tuple(victims))
        return Admission(refused=self._why_full(name, in_memory, busy))

    def idle(self, busy: Callable[[str], int]) -> list[str]:
        """Loaded models whose ``idle_unload_s`` has passed since their last request."""
        now = self.clock()
        out = []
        for n, s in self.states.items():
            limit = self.models[n].idle_unload_s
            if (limit is not None and s.status is Status.LOADED and not s.pinned
                    and busy(n) == 0 and now - s.last_used >= limit):
                out.append(n)
        return out

    def _unloadable(self, busy: Callable[[str], int]) -> list[str]:
        """Loaded, unpinned models serving nothing, least recently used first."""
        out = [n for n, s in self.states.items()
               if s.status is Status.LOADED and not s.pinned and busy(n) == 0]
        return sorted(out, key=lambda n: self.states[n].last_used)

    def _fits(self, name: str, others: Sequence[str]) -> bool:
        together = [*(n for n in others if n != name), name]
        cap = self.limits.max_loaded
        if cap is not None and len(together) > cap:
            return False
        room = self.limits.room_bytes
        if room is None or len(together) == 1:
            return True
        return sum(self.models[n].footprint_bytes for n in together) <= room

    def _why_full(self, name: str, in_memory: Sequence[str],
                  busy: Callable[[str], int]) -> str:
        cap = self.limits.max_loaded
        held = []
        for n in in_memory:
            s = self.states[n]
            why = ("pinned" if s.pinned
                   else f"{busy(n)} request{'s' if busy(n) > 1 else ''} in flight"
                   if busy(n)
                   else s.status.value)
            held.append(f"{n} ({why})")
        limit = (f"memory.max_loaded_models {cap}" if cap is not None
                 and len(in_memory) + 1 > cap else "the memory budget")
        return (f"model {name!r} is not loaded and there is no room for it under {limit}: "
                f"loaded are {', '.join(held) or 'none'}, and none of them can be unloaded "
                f"now; retry in {CAPACITY_RETRY_AFTER_S} s")

    # ---- bookkeeping ---------------------------------------------------------------

    def status(self, name: str) -> Status:
        return self.states[name].status

    def pin(self, name: str, pinned: bool) -> None:
        """Pin ``name`` (never unloaded while pinned) or take its pin off; raises
        ``PoolRefused`` for a model that must stay loaded (``PoolModel.locked``)."""
        locked = self.models[name].locked
        if not pinned and locked is not None:
            raise PoolRefused(f"model {name!r} stays pinned: {locked}", "pin_locked")
        self.states[name].pinned = pinned

    def used(self, name: str) -> None:
        """A request of ``name`` arrived or ended: its idle time starts again."""
        self.states[name].last_used = self.clock()

    def set(self, name: str, status: Status) -> None:
        self.states[name].status = status

    def loaded(self) -> list[str]:
        return [n for n, s in self.states.items() if s.status.in_memory]

    def report(self, busy: Callable[[str], int]) -> dict[str, Any]:
        """``/v1/stats``' ``pool``: the limits and each model's state."""
        now = self.clock()
        return {
            "max_loaded_models": self.limits.max_loaded,
            "room_bytes": self.limits.room_bytes,
            "loaded": self.loaded(),
            "models": {n: {"status": s.status.reported, "state": s.status.value,
                           "pinned": s.pinned, "pin_locked": self.models[n].locked,
                           "idle_unload_s": self.models[n].idle_unload_s,
                           "footprint_bytes": self.models[n].footprint_bytes,
                           "in_flight": busy(n), "idle_s": round(now - s.last_used, 3),
                           "loads": s.loads, "unloads": dict(s.unloads),
                           "last_load_seconds": round(s.load_seconds, 3),
                           "last_error": s.last_error}
                       for n, s in self.states.items()},
        }


class PoolGate:
    """Carries out the pool's decisions on the ingress's event loop: one transition at a
    time (``lock``); requests for a model being loaded share its load; a request for a
    loaded model never waits for anything.

    ``load(model)`` returns once the model's replica has it loaded (and warmed); it
    raises on failure. ``unload(model, reason)`` returns whether the replica unloaded it
    (it refuses while it serves a request). ``busy(model)``: the ingress's requests in
    flight at the model."""

    def __init__(self, pool: ModelPool, load: Callable[[str], Awaitable[None]],
                 unload: Callable[[str, str], Awaitable[bool]], busy: Callable[[str], int],
                 status: Callable[[str], Awaitable[str]] | None = None) -> None:
        self.pool = pool
        self.status = status
        self._load = load
        self._unload = unload
        self.busy = busy
        self._lock: asyncio.Lock | None = None
        self._bringing: dict[str, asyncio.Future] = {}
        self._idle_task: asyncio.Task | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the loop that uses it
            self._lock = asyncio.Lock()
        return self._lock

    async def ready(self, name: str) -> None:
        """Return once ``name`` is loaded (loading it, and unloading others to make room,
        when it is not); raise ``PoolCapacityError`` or ``PoolLoadError``. The caller has
        counted its request in ``busy`` already, so the model cannot be chosen to unload
        once this returns."""
        self.pool.used(name)
        self.start_idle_checks()
        if self.pool.status(name) is Status.LOADED:
            return
        bringing = self._bringing.get(name)
        if bringing is None:
            bringing = self._bringing[name] = asyncio.ensure_future(self._bring(name))
        await asyncio.shield(bringing)

    async def unload(self, name: str) -> None:
        """Unload ``name`` now, as asked (``PoolRefused`` when it is pinned, serving a
        request, or not loaded)."""
        async with self.lock:
            state = self.pool.states[name]
            if state.pinned:
                raise PoolRefused(f"model {name!r} is pinned: unpin it first", "model_pinned")
            if state.status is not Status.LOADED:
                raise PoolRefused(f"model {name!r} is {state.status.value}, not loaded",
                                  "model_not_loaded")
            if self.busy(name):
                raise PoolRefused(f"model {name!r} is serving {self.busy(name)} request(s); "
                                  "retry once they end", "model_busy")
            if not await self._unload_one(name, "admin"):
                raise PoolRefused(f"model {name!r} did not unload: its replica is serving a "
                                  "request or failed to (see last_error in the pool)",
                                  "model_busy")

    async def _bring(self, name: str) -> None:
        try:
            async with self.lock:
                if self.pool.status(name) is Status.LOADED:
                    return
                admission = self.pool.admit(name, self.busy)
                if admission.refused is not None:
                    raise PoolCapacityError(admission.refused)
                # Every victim at once: a request for one of them from now on waits for
                # this transition (and loads it again after), never reaches its replica
                # while it is being unloaded.
                for victim in admission.unload:
                    self.pool.set(victim, Status.UNLOADING)
                for i, victim in enumerate(admission.unload):
                    if not await self._unload_one(victim, "capacity"):
                        for kept in admission.unload[i + 1:]:
                            self.pool.set(kept, Status.LOADED)
                        raise PoolCapacityError(
                            f"model {name!r} is not loaded and model {victim!r}, which had "
                            "to make room for it, took a request meanwhile; retry in "
                            f"{CAPACITY_RETRY_AFTER_S} s")
                await self._load_one(name)
        finally:
            self._bringing.pop(name, None)

    async def _load_one(self, name: str) -> None:
        state = self.pool.states[name]
        self.pool.set(name, Status.LOADING)
        tic = time.perf_counter()
        try:
            await self._load(name)
        except Exception as exc:
            self.pool.set(name, Status.UNLOADED)
            state.last_error = f"load failed: {exc!r}"
            logger.warning("model pool: loading %s failed: %r", name, exc)
            raise PoolLoadError(f"model {name!r} could not be loaded: {exc}") from exc
        state.load_seconds = time.perf_counter() - tic
        state.loads += 1
        state.last_error = None
        self.pool.set(name, Status.LOADED)
        self.pool.used(name)
        logger.info("model pool: loaded %s in %.2f s", name, state.load_seconds)

    async def _unload_one(self, name: str, reason: str) -> bool:
        """Unload ``name`` (the lock held); False when its replica refused (busy)."""
        self.pool.set(name, Status.UNLOADING)
        try:
            done = await self._unload(name, reason)
        except Exception as exc:  # failing or gone: kept as loaded (never counted twice)
            logger.warning("model pool: unloading %s failed: %r", name, exc)
            self.pool.states[name].last_error = f"unload failed: {exc!r}"
            done = False
        if not done:
            self.pool.set(name, Status.LOADED)
            return False
        self.pool.set(name, Status.UNLOADED)
        self.pool.states[name].unloads[reason] += 1
        logger.info("model pool: unloaded %s (%s)", name, reason)
        return True

    # ---- in the background: idle unloading, the replicas' own word -----------------

    def start_idle_checks(self) -> None:
        """Start the background checks on the running loop (once): idle unloading every
        ``IDLE_TICK_S`` (when a model has ``idle_unload_s``), and every ``RECONCILE_S``
        the replicas' own word on what they hold (``reconcile``, when ``status`` is set)."""
        if self._idle_task is not None and not self._idle_task.done():
            return
        idle = any(m.idle_unload_s for m in self.pool.models.values())
        if not idle and self.status is None:
            return
        self._idle_task = asyncio.get_running_loop().create_task(self._checks(idle))

    async def _checks(self, idle: bool) -> None:
        last_reconcile = 0.0  # at the first tick: an ingress that restarted learns at once
        while True:
            await asyncio.sleep(IDLE_TICK_S)
            try:
                if self.status is not None and time.monotonic() - last_reconcile > RECONCILE_S:
                    last_reconcile = time.monotonic()
                    await self.reconcile()
                if idle:
                    await self.unload_idle()
            except Exception:  # the checks must outlive one failure
                logger.exception("model pool: background check failed")

    async def reconcile(self) -> dict[str, str]:
        """Take each replica's word for whether it holds its model (``status(model)``:
        ``loaded`` or ``unloaded``; one that does not answer in ``STATUS_TIMEOUT_S`` is
        left as the pool has it). A replica that Serve restarted comes back as its
        deployment was built (loaded or not at start), and an ingress that restarted
        starts from the start-time view: without this the cap could be passed unseen.
        Returns the models whose status changed, with the new one."""
        status = self.status
        if status is None:
            return {}
        async with self.lock:  # no transition runs meanwhile
            names = list(self.pool.models)
            answers = await asyncio.gather(
                *(asyncio.wait_for(status(n), STATUS_TIMEOUT_S) for n in names),
                return_exceptions=True)
            changed = {}
            for name, answer in zip(names, answers, strict=True):
                held = {"loaded": Status.LOADED, "unloaded": Status.UNLOADED}.get(
                    answer if isinstance(answer, str) else "")
                if held is not None and held is not self.pool.status(name):
                    self.pool.set(name, held)
                    changed[name] = held.value
            if changed:
                logger.warning("model pool: the replicas say %s (the pool had it otherwise)",
                               changed)
            return changed

    async def unload_idle(self) -> list[str]:
        """Unload every model idle past its ``idle_unload_s``; the ones unloaded."""
        out = []
        for name in self.pool.idle(self.busy):
            async with self.lock:
                if name in self.pool.idle(self.busy) and await self._unload_one(name, "idle"):
                    out.append(name)
        return out


def pool_for(profile: Profile, plan: MemoryPlan | None) -> ModelPool:
    """The pool of a profile, with the plan's footprints and the memory it leaves to
    models (the budget less the hot tier and the SSD write buffer). An ``always_loaded``
    model (pinned, or with several replicas) is pinned here."""
    footprints = {m.name: m.resident_bytes for m in plan.models} if plan is not None else {}
    models = [PoolModel(m.name, pinned=m.pinned, idle_unload_s=m.idle_unload_s,
                        footprint_bytes=footprints.get(m.name, 0), locked=_locked(m))
              for m in profile.models]
    room = (plan.budget_bytes - plan.hot_bytes - plan.staging_bytes
            if plan is not None else None)
    return ModelPool(models, PoolLimits(profile.memory.max_loaded_models, room))


def _locked(m: ModelProfile) -> str | None:
    """Why a model can never be unloaded by the pool, which unloads one replica."""
    if m.parallel is not None:
        return "it is sharded over ranks (models[].parallel)"
    if m.num_replicas > 1:
        return f"it has {m.num_replicas} replicas (models[].num_replicas)"
    return None


def pooled(profile: Profile) -> bool:
    """Whether the ingress runs a pool: it must be the only ingress (with several, each
    would hold its own view); without a pool every model loads at start and stays."""
    return profile.ingress.num_replicas == 1


def loaded_at_start(profile: Profile, plan: MemoryPlan | None) -> tuple[str, ...]:
    """The models whose replicas load them at start (``ModelPool.initial``)."""
    if not pooled(profile):
        return tuple(m.name for m in profile.models)
    return pool_for(profile, plan).initial()
