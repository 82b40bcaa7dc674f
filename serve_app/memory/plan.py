"""The memory plan of a node: models, their KV, the hot tier and macOS in one pool.

On a Mac the weights, every running sequence's KV cache, the cache store's hot tier
and the OS share one pool of unified memory, and a plan that does not fit is found out
by swapping. This module is the arithmetic only: plain dataclasses and pure functions,
no Ray and no loaded model (``serve_app/memory/facts.py`` finds a model's config and
weight bytes; ``python -m serve_app check`` prints the plan and refuses one that cannot
fit).

A model's planned footprint = its weights (bytes on disk: dtype and quantization are
in them) + KV for ``max_batch_size`` sequences of ``context_length`` tokens at its
cache dtype (mlx-lm's buffers grow in steps of 256 tokens) + the fixed recurrent state
of each sequence on hybrid models + its share of the hot tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from serve_app.memory.machine import MachineMemory
from serve_app.memory.shapes import CacheShape

if TYPE_CHECKING:  # the profile imports MLX-free modules only; keep this one so too
    from serve_app.config.profile import ModelProfile, Profile

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# memory.budget: auto. MLX on Metal wires what it uses; macOS, the window server, the
# browser and Ray's own processes need the rest. 75% is also what Metal recommends as
# the GPU's working set on most Apple Silicon Macs, and 4 GiB is what a 16 GB Mac needs
# to stay responsive.
AUTO_SHARE = 0.75
OS_RESERVE_BYTES = 4 * GiB
BUDGET_FLOOR_BYTES = 1 * GiB  # a tiny machine or container still gets something

# cache_store.hot_budget: auto takes what the loaded models leave, within these bounds:
# below 256 MiB the hot tier holds too few blocks of a real model to be worth a lookup;
# above 16 GiB, restores from the SSD tier are fast enough that more RAM buys little.
HOT_AUTO_MIN_BYTES = 256 * MiB
HOT_AUTO_MAX_BYTES = 16 * GiB


def hot_budget_bytes(hot_budget: int | str) -> int:
    """The hot tier's bytes for a cache store. ``auto`` is resolved where the application
    is built (``planning.with_planned_hot_budget``); a store given an unresolved one (built
    from a bare ``CacheStoreProfile``) gets the auto minimum rather than guessing."""
    return HOT_AUTO_MIN_BYTES if hot_budget == "auto" else int(hot_budget)


def fmt_bytes(n: int | float) -> str:
    """Binary units, three significant digits: ``4.30 GiB``, ``144 KiB``, ``1000000 B``
    stays exact below 1 KiB only."""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 \
                else f"{v:.0f} {unit}"
    return f"{int(n)} B"


# ---- a model's cache -------------------------------------------------------------------


# ---- the machine -------------------------------------------------------------------------


def auto_budget(machine: MachineMemory) -> int:
    """``memory.budget: auto``: 75% of physical memory, leaving at least 4 GiB to the OS,
    never more than Metal's recommended working set, and at least 1 GiB (or half the
    memory of a machine smaller than 2 GiB)."""
    total = machine.total_bytes
    budget = min(int(total * AUTO_SHARE), total - OS_RESERVE_BYTES)
    if machine.gpu_working_set_bytes:
        budget = min(budget, machine.gpu_working_set_bytes)
    return max(budget, min(BUDGET_FLOOR_BYTES, total // 2))


# ---- the plan ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFootprint:
    """What one model takes while loaded: weights, KV of a full batch at full context,
    and its share of the node's hot tier (filled in by ``plan_memory``)."""

    name: str
    weights_bytes: int
    kv_bytes: int
    sequences: int
    tokens: int
    shape: CacheShape
    pinned: bool = False
    hot_share_bytes: int = 0
    ranks: int = 1  # a sharded model spread over nodes: one rank's share of this many
    vision_cache_bytes: int = 0  # a vision model's feature cache (``vision.feature_cache_mb``)
    prefix_cache: bool = True  # an embedding or rerank model keeps no prefix cache

    @property
    def resident_bytes(self) -> int:
        """What loading the model costs (the hot tier is there either way)."""
        return self.weights_bytes + self.kv_bytes + self.vision_cache_bytes

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.hot_share_bytes

    def describe(self) -> str:
        kv = (f"KV {fmt_bytes(self.kv_bytes)} for {self.sequences} x {self.tokens} tokens at "
              f"{fmt_bytes(self.shape.kv_bytes_per_token)} a token") if self.prefix_cache else (
            f"activations {fmt_bytes(self.kv_bytes)} for a batch of {self.tokens} tokens")
        if self.shape.state_bytes_per_sequence:
            kv += (f" and {fmt_bytes(self.shape.state_bytes_per_sequence)} of recurrent state "
                   "a sequence")
        if self.shape.kv_format != "float" and self.prefix_cache:
            kv += (f" (K/V {self.shape.kv_format}: {self.shape.kv_ratio:.2f}x float's "
                   f"{fmt_bytes(self.shape.float_kv_bytes_per_token)})")
        share = f" (one rank's share of {self.ranks})" if self.ranks > 1 else ""
        if self.vision_cache_bytes:
            share += f" + image features {fmt_bytes(self.vision_cache_bytes)}"
        return (f"weights {fmt_bytes(self.weights_bytes)} + {kv}{share} = "
                f"{fmt_bytes(self.resident_bytes)}")


def footprint(model: ModelProfile, weights_bytes: int, shape: CacheShape,
              vision: bool = False) -> ModelFootprint:
    """A model profile's footprint: ``max_batch_size`` sequences of ``context_length``.
    A model sharded over ranks spread one per node takes one rank's share on a node: its
    weights and KV over the ranks (each holds its heads, or its layers). ``vision``: the
    checkpoint has a vision tower, whose feature cache is planned too (where enabled)."""
    if model.task != "generate":  # no KV kept: one batch's activations, for a while
        return ModelFootprint(
            name=model.name, weights_bytes=weights_bytes,
            kv_bytes=shape.bytes_for(1, model.pooling.max_batch_tokens), sequences=1,
            tokens=model.pooling.max_batch_tokens, shape=shape, pinned=model.pinned,
            prefix_cache=False)
    kv_bytes = shape.bytes_for(model.max_batch_size, model.context_length)
    parallel = model.parallel
    ranks = parallel.size if parallel is not None and parallel.placement == "spread" else 1
    return ModelFootprint(
        name=model.name, weights_bytes=-(-weights_bytes // ranks),
        kv_bytes=-(-kv_bytes // ranks),
        sequences=model.max_batch_size, tokens=model.context_length, shape=shape,
        pinned=model.pinned, ranks=ranks,
        vision_cache_bytes=model.vision.feature_cache_mb << 20
        if vision and model.vision.enabled and ranks == 1 and model.speculative is None else 0)


@dataclass(frozen=True)
class MemoryPlan:
    """A node's plan. ``problems`` say why it cannot work (``check`` refuses it);
    ``notes`` what a user should know although it can."""

    total_memory_bytes: int
    budget_bytes: int
    budget_origin: str
    models: tuple[ModelFootprint, ...]
    hot_bytes: int
    hot_origin: str
    staging_bytes: int
    loaded: tuple[str, ...]  # the models planned to be loaded together (pinned first)
    max_loaded_models: int | None = None
    unknown: tuple[tuple[str, str], ...] = ()  # (model, why its footprint is unknown)
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    metal: bool = False

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def reserve_bytes(self) -> int:
        """What the budget leaves to the OS and everything else on the machine."""
        return max(self.total_memory_bytes - self.budget_bytes, 0)

    @property
    def planned_bytes(self) -> int:
        """The loaded models, the hot tier and the SSD write buffer together."""
        by_name = {m.name: m for m in self.models}
        return (sum(by_name[n].resident_bytes for n in self.loaded) + self.hot_bytes
                + self.staging_bytes)

    def as_dict(self) -> dict[str, Any]:
        """For ``/v1/stats`` and logs: bytes as integers."""
        return {
            "total_memory_bytes": self.total_memory_bytes,
            "budget_bytes": self.budget_bytes, "budget_origin": self.budget_origin,
            "reserve_bytes": self.reserve_bytes, "planned_bytes": self.planned_bytes,
            "hot_bytes": self.hot_bytes, "hot_origin": self.hot_origin,
            "staging_bytes": self.staging_bytes, "loaded": list(self.loaded),
            "max_loaded_models": self.max_loaded_models, "fits": self.fits,
            "advisory": not self.metal,
            "models": {m.name: {"weights_bytes": m.weights_bytes, "kv_bytes": m.kv_bytes,
                                "hot_share_bytes": m.hot_share_bytes,
                                "total_bytes": m.total_bytes, "pinned": m.pinned,
                                "kv_bytes_per_token": m.shape.kv_bytes_per_token,
                                "kv_format": m.shape.kv_format,
                                "state_bytes_per_sequence": m.shape.state_bytes_per_sequence}
                       for m in self.models},
            "unknown": dict(self.unknown), "problems": list(self.problems),
            "notes": list(self.notes),
        }


def _resident_set(models: Sequence[ModelFootprint], cap: int | None) -> list[ModelFootprint]:
    """The models that may be loaded at once, at worst: every pinned one, then the largest
    unpinned ones up to ``cap`` (all of them without a cap)."""
    pinned = [m for m in models if m.pinned]
    others = sorted((m for m in models if not m.pinned), key=lambda m: -m.resident_bytes)
    room = len(others) if cap is None else max(cap - len(pinned), 0)
    return pinned + others[:room]


@dataclass
class _Budget:
    bytes: int
    origin: str
    notes: list[str] = field(default_factory=list)

    @property
    def words(self) -> str:
        if self.origin == "memory.budget":  # the user's own figure, exactly
            return f"{fmt_bytes(self.bytes)} ({self.bytes} bytes, memory.budget)"
        return f"{fmt_bytes(self.bytes)} ({self.origin})"


def _budget(profile: Profile, machine: MachineMemory) -> _Budget:
    configured = profile.memory.budget
    if configured == "auto":
        how = (f"auto: {AUTO_SHARE:.0%} of {fmt_bytes(machine.total_bytes)}, at least "
               f"{fmt_bytes(OS_RESERVE_BYTES)} left to the OS")
        if machine.gpu_working_set_bytes:
            how += f", at most Metal's working set {fmt_bytes(machine.gpu_working_set_bytes)}"
        return _Budget(auto_budget(machine), how)
    out = _Budget(int(configured), "memory.budget")
    if configured > machine.total_bytes:
        out.notes.append(f"memory.budget {fmt_bytes(configured)} is more than this "
                         f"machine's {fmt_bytes(machine.total_bytes)} of memory")
    return out


def plan_memory(profile: Profile, models: Sequence[ModelFootprint], machine: MachineMemory,
                unknown: Sequence[tuple[str, str]] = ()) -> MemoryPlan:
    """Plan a node serving ``profile`` with these footprints (``unknown``: models whose
    config or weights could not be read; they are left out of the sums and noted).

    Refused (``problems``): pinned models that do not fit together, or a model that does
    not fit beside the pinned ones: either can never be served. Only noted: models that
    do not all fit at once (a model pool can load them in turn).
    """
    budget = _budget(profile, machine)
    store = profile.cache_store
    pinned_names = {m.name for m in profile.models if m.always_loaded}
    models = [replace(m, pinned=m.name in pinned_names) for m in models]
    staging = int(store.gdn_ssd_pending_max_size) if store.ssd else 0
    cap = profile.memory.max_loaded_models
    resident = _resident_set(models, cap)
    resident_bytes = sum(m.resident_bytes for m in resident)
    notes = list(budget.notes)
    if store.hot_budget == "auto":
        hot_floor = HOT_AUTO_MIN_BYTES
        if unknown:
            hot, hot_origin = hot_floor, "auto (lower bound: a model's footprint is unknown)"
        else:
            left = budget.bytes - resident_bytes - staging
            hot = min(max(left, HOT_AUTO_MIN_BYTES), HOT_AUTO_MAX_BYTES)
            hot_origin = (f"auto: what the loaded models leave, within "
                          f"{fmt_bytes(HOT_AUTO_MIN_BYTES)}-{fmt_bytes(HOT_AUTO_MAX_BYTES)}")
    else:
        hot = hot_floor = int(store.hot_budget)
        hot_origin = "cache_store.hot_budget"
    share = hot // max(sum(m.prefix_cache for m in resident), 1)
    planned = tuple(replace(m, hot_share_bytes=share if m.prefix_cache else 0) for m in models)

    problems: list[str] = []
    fixed = hot_floor + staging
    fixed_words = (f"the hot tier {fmt_bytes(hot_floor)}"
                   + (" (its auto minimum)" if store.hot_budget == "auto" else "")
                   + (f" and the SSD write buffer {fmt_bytes(staging)}" if staging else ""))
    over = f"more than the memory budget {budget.words}"
    pinned = [m for m in models if m.pinned]
    pinned_bytes = sum(m.resident_bytes for m in pinned)
    if pinned and pinned_bytes + fixed > budget.bytes:
        each = "; ".join(f"{m.name!r}: {m.describe()}" for m in pinned)
        problems.append(
            f"the pinned models need {fmt_bytes(pinned_bytes)} of memory ({each}); with "
            f"{fixed_words} that is {fmt_bytes(pinned_bytes + fixed)}, {over}")
    for m in models:  # pinned ones are never unloaded: each other model must fit beside them
        if m.pinned:
            continue
        need = m.resident_bytes + pinned_bytes + fixed
        if need > budget.bytes:
            beside = f"the pinned models' {fmt_bytes(pinned_bytes)}, " if pinned else ""
            problems.append(
                f"model {m.name!r} needs {fmt_bytes(m.resident_bytes)} of memory "
                f"({m.describe()}); with {beside}{fixed_words} that is {fmt_bytes(need)}, "
                f"{over}")
    if not problems and len(resident) > 1 and resident_bytes + fixed > budget.bytes:
        names = ", ".join(m.name for m in resident)
        notes.append(
            f"the models loaded together ({names}) need {fmt_bytes(resident_bytes)} of "
            f"memory; with {fixed_words} that is {fmt_bytes(resident_bytes + fixed)}, {over}: "
            "they do not fit in memory all at once (lower max_batch_size or context_length, "
            "or list fewer models)")
    return MemoryPlan(
        total_memory_bytes=machine.total_bytes, budget_bytes=budget.bytes,
        budget_origin=budget.origin, models=planned, hot_bytes=hot, hot_origin=hot_origin,
        staging_bytes=staging, loaded=tuple(m.name for m in resident), max_loaded_models=cap,
        unknown=tuple(unknown), problems=tuple(problems), notes=tuple(notes),
        metal=machine.metal)


def _what_fits(m: ModelFootprint) -> str:
    """What quantized K/V buys a model: sessions of its context in its KV and hot-tier
    shares, against float K/V's."""
    def sessions(share: int, per_token: int) -> int:
        return share // max(1, per_token * m.tokens)

    q, f = m.shape.kv_bytes_per_token, m.shape.float_kv_bytes_per_token or \
        m.shape.kv_bytes_per_token
    kv_share = q * m.tokens * m.sequences
    return (f"with {m.shape.kv_format} K/V: its KV share holds {m.sequences} sessions of "
            f"{m.tokens} tokens (as float: {sessions(kv_share, f)}, or {m.sequences} of "
            f"{kv_share // max(1, f * m.sequences)} tokens); its hot-tier share "
            f"{sessions(m.hot_share_bytes, q)} sessions of {m.tokens} tokens (as float: "
            f"{sessions(m.hot_share_bytes, f)})")


def describe(plan: MemoryPlan) -> list[str]:
    """The plan as ``check`` prints it, one line each."""
    exact = f" = {plan.budget_bytes} bytes" if plan.budget_origin == "memory.budget" else ""
    lines = [f"memory budget {fmt_bytes(plan.budget_bytes)}{exact} of "
             f"{fmt_bytes(plan.total_memory_bytes)} ({plan.budget_origin}; "
             f"{fmt_bytes(plan.reserve_bytes)} left outside it)"]
    for m in plan.models:
        tags = " [pinned]" if m.pinned else ""
        lines.append(f"  model {m.name!r}{tags}: {m.describe()}, "
                     f"+ hot-tier share {fmt_bytes(m.hot_share_bytes)}")
        if m.prefix_cache and m.shape.kv_format != "float":
            lines.append("    " + _what_fits(m))
    for name, why in plan.unknown:
        lines.append(f"  model {name!r}: footprint unknown ({why})")
    lines.append(f"  hot tier: {fmt_bytes(plan.hot_bytes)} ({plan.hot_origin})")
    if plan.staging_bytes:
        lines.append(f"  SSD write buffer: {fmt_bytes(plan.staging_bytes)} "
                     "(cache_store.gdn_ssd_pending_max_size)")
    loaded = ", ".join(plan.loaded) or "none"
    verdict = ("" if plan.planned_bytes <= plan.budget_bytes
               else ": over the budget" if plan.fits else ": does NOT fit")
    lines.append(f"  planned: {fmt_bytes(plan.planned_bytes)} of {fmt_bytes(plan.budget_bytes)}"
                 f" with {loaded} loaded{verdict}")
    if not plan.metal:
        lines.append("  (no Metal GPU here: the plan is advisory, nothing is wired)")
    return lines


# ---- what a replica serves by: its KV share, MLX's limits, its report ---------------------


def kv_shares(plan: MemoryPlan) -> dict[str, int]:
    """Each model's KV share: the bytes of KV its running requests may hold together
    (``Engine.set_kv_budget``).

    A plan that fits gives every model its planned KV (``max_batch_size`` x
    ``context_length``). One over its budget (every listed model loads at start, so
    the plan is all of them) shares what the budget leaves after the weights, the hot
    tier and the SSD write buffer among the models in proportion to their planned KV:
    admission then keeps the KV in use inside the budget instead of swapping.
    """
    planned = sum(m.kv_bytes for m in plan.models)
    room = plan.budget_bytes - plan.hot_bytes - plan.staging_bytes - sum(
        m.weights_bytes for m in plan.models)
    if planned <= 0 or room >= planned:
        return {m.name: m.kv_bytes for m in plan.models}
    scale = max(room, 0) / planned
    return {m.name: int(m.kv_bytes * scale) for m in plan.models}


@dataclass(frozen=True)
class MemoryLimits:
    """What a model's replica asks of MLX on Metal (``mx.set_wired_limit``,
    ``mx.set_cache_limit``); None leaves MLX's own setting.

    The wired limit is per process, and every model runs in a process of its own: each
    wires its weights and its KV share, never the whole working set that mlx-lm's
    ``BatchGenerator`` asks for on creation (two models doing that would promise the
    GPU the same memory twice). MLX's buffer cache (freed buffers kept for reuse) is
    bounded by the KV share: a full batch reuses its buffers, and whatever a burst freed
    beyond that goes back to the OS for the other models and the hot tier.
    """

    wired_bytes: int | None = None
    cache_bytes: int | None = None

    def apply(self) -> MemoryLimits | None:
        """Into MLX, on Metal only (on the thread that runs the model); what was applied
        (None off Metal: the plan is advisory)."""
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        if self.wired_bytes is not None:
            mx.set_wired_limit(self.wired_bytes)
        if self.cache_bytes is not None:
            mx.set_cache_limit(self.cache_bytes)
        return self


def mlx_limits(model: ModelFootprint, kv_share: int,
               working_set_bytes: int | None) -> MemoryLimits:
    """A model's limits on a machine with this Metal working set (None: not Metal, so
    nothing to set)."""
    if working_set_bytes is None:
        return MemoryLimits()
    wired = min(model.weights_bytes + kv_share, working_set_bytes)
    return MemoryLimits(wired_bytes=wired, cache_bytes=kv_share)


@dataclass(frozen=True)
class ModelMemory:
    """One model's part of the plan, as its replica gets it (pickled, plain numbers):
    its planned footprint and its KV share."""

    name: str
    weights_bytes: int
    kv_bytes: int
    hot_share_bytes: int
    kv_share_bytes: int

    @property
    def total_bytes(self) -> int:
        """Its planned footprint (``/v1/models``' ``memory_bytes``)."""
        return self.weights_bytes + self.kv_bytes + self.hot_share_bytes

    def limits(self, machine: MachineMemory) -> MemoryLimits:
        """MLX's limits for this model on ``machine`` (none off Metal)."""
        fp = ModelFootprint(self.name, self.weights_bytes, self.kv_bytes, 0, 0, CacheShape(0))
        return mlx_limits(fp, self.kv_share_bytes, machine.gpu_working_set_bytes)


def models_memory(plan: MemoryPlan) -> dict[str, ModelMemory]:
    """Every planned model's ``ModelMemory`` (models whose footprint is unknown are not in
    it: they are served without a KV budget)."""
    shares = kv_shares(plan)
    return {m.name: ModelMemory(m.name, m.weights_bytes, m.kv_bytes, m.hot_share_bytes,
                                shares[m.name]) for m in plan.models}


def node_budget(budget: int | str, machine: MachineMemory) -> int:
    """``memory.budget`` on one node: its bytes, or ``auto`` for that node's memory."""
    return auto_budget(machine) if budget == "auto" else int(budget)


@dataclass(frozen=True)
class PlannedMemory:
    """A model's part of the plan as its replica shows it."""

    weights_bytes: int
    kv_bytes: int
    hot_share_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class ReplicaMemory:
    """One replica's memory on its node (its stats' ``replica.memory``): the plan's
    numbers, the KV budget and what the running requests reserve of it, MLX's limits where
    set (``advisory``: none is, off Metal); ``loaded``: False while the pool has it
    unloaded (then it holds no weights and no KV); ``process_rss_bytes``: now."""

    loaded: bool
    total_memory_bytes: int
    gpu_working_set_bytes: int | None
    advisory: bool
    planned: PlannedMemory | None
    kv_budget_bytes: int | None
    kv_in_use_bytes: int
    kv_waiting: int
    wired_limit_bytes: int | None
    cache_limit_bytes: int | None
    process_rss_bytes: int | None


@dataclass(frozen=True)
class NodeMemory:
    """A replica's memory as ``memory_report`` takes it: which model, process and node."""

    model: str
    pid: int
    node_id: str
    memory: ReplicaMemory


def memory_report(plan: MemoryPlan, budget: int | str,
                  replicas: Sequence[NodeMemory]) -> dict[str, Any]:
    """``/v1/stats``' ``memory``: the plan as made where the application was built
    (``plan``), and per node what its replicas report (``replicas``).

    A node's ``budget_bytes`` is ``memory.budget`` on that node's memory;
    ``planned_bytes`` (what the plan uses of it) is the weights and KV budgets of the
    models it has loaded, the hot tier and the SSD write buffer; ``kv_in_use_bytes`` what
    running requests reserve now; ``wired_limit_bytes`` the sum of the limits set on it
    (None: none set); ``advisory``: nothing is set on some model there (no Metal).
    """
    nodes: dict[str, dict[str, Any]] = {}
    for r in replicas:
        m = r.memory
        node = nodes.setdefault(r.node_id, {
            "total_memory_bytes": m.total_memory_bytes,
            "budget_bytes": node_budget(budget, MachineMemory(
                m.total_memory_bytes, m.gpu_working_set_bytes)),
            "planned_bytes": plan.hot_bytes + plan.staging_bytes,
            "kv_in_use_bytes": 0, "hot_bytes": plan.hot_bytes,
            "staging_bytes": plan.staging_bytes, "wired_limit_bytes": None,
            "advisory": False, "models": {}})
        if m.loaded:  # a model the pool unloaded holds neither
            node["planned_bytes"] += (m.planned.weights_bytes if m.planned else 0) + (
                m.kv_budget_bytes or (m.planned.kv_bytes if m.planned else 0))
        node["kv_in_use_bytes"] += m.kv_in_use_bytes
        if m.wired_limit_bytes is not None:
            node["wired_limit_bytes"] = (node["wired_limit_bytes"] or 0) + m.wired_limit_bytes
        node["advisory"] = node["advisory"] or m.advisory
        node["models"].setdefault(r.model, []).append({"pid": r.pid, **asdict(m)})
    return {"plan": plan.as_dict(), "nodes": nodes}
