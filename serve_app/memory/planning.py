"""A profile's memory plan on this machine: the models' facts (read from disk, the
Hugging Face cache, or with ``hub`` the hub's listing), this machine's memory, and the
arithmetic of ``serve_app/memory/plan.py``. Used by ``python -m serve_app check`` and by the
application builder to resolve ``cache_store.hot_budget: auto``."""

from __future__ import annotations

import logging
from pathlib import Path

from serve_app.config.profile import Profile
from serve_app.memory.facts import profile_footprints
from serve_app.memory.machine import MachineMemory, probe_machine
from serve_app.memory.plan import MemoryPlan, plan_memory

logger = logging.getLogger(__name__)


def plan_profile(profile: Profile, machine: MachineMemory | None = None,
                 hub: bool = False) -> MemoryPlan:
    """Plan ``profile`` on ``machine`` (default: this one)."""
    home = Path(profile.model_home).expanduser() if profile.model_home else None
    known, unknown = profile_footprints(profile.models, home, hub)
    return plan_memory(profile, known, machine or probe_machine(), unknown)


def with_planned_hot_budget(profile: Profile) -> Profile:
    """``profile`` with ``cache_store.hot_budget: auto`` replaced by the plan's bytes (the
    profile itself when it gives bytes). Planned where it is called: the builder runs on
    the head node, so on a cluster every node gets the head's figure."""
    return planned(profile)[0]


def planned(profile: Profile) -> tuple[Profile, MemoryPlan]:
    """The profile as served (``with_planned_hot_budget``) and its plan, logged: what the
    builder hands the replicas (their KV shares, MLX's limits) and the ingress (reports).
    Planned once, on the node that builds the application."""
    plan = plan_profile(profile)
    for line in (*plan.problems, *plan.notes):
        logger.warning("memory plan: %s", line)
    if profile.cache_store.hot_budget != "auto":
        return profile, plan
    logger.info("memory plan: hot tier %d bytes (%s)", plan.hot_bytes, plan.hot_origin)
    store = profile.cache_store.model_copy(update={"hot_budget": plan.hot_bytes})
    return profile.model_copy(update={"cache_store": store}), plan
