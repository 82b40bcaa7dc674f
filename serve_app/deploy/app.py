"""The builder: the profile in, the Ray Serve application out.

``serve run configs/qwen.yaml`` imports ``build_app`` (``serve_app.app``) and passes it
the application ``args`` (the profile). It binds one replica deployment per model
(``deploy/replica.py``) under the ingress (``deploy/ingress.py``); the API logic is in
``serve_app.api.http`` and ``serve_app.serving.service``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_app.config import api_keys
from serve_app.config.profile import (
    Profile,
    ProfileError,
    parse_profile,
)
from serve_app.deploy.ingress import Ingress
from serve_app.deploy.pool import loaded_at_start
from serve_app.deploy.pooling_replica import PoolingReplica
from serve_app.deploy.replica import ROUTING_STATS_PERIOD_S, ModelReplica
from serve_app.memory.plan import models_memory
from serve_app.memory.planning import planned
from serve_app.models.compat import HEAD_NODE_RESOURCE, serve_replica_env

logger = logging.getLogger("ray.serve")


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
        digests = api_keys.configured_digests(profile.ingress.api_keys_file,
                                              admin_file=profile.ingress.admin_keys_file)
    except api_keys.ApiKeyError as exc:
        raise ProfileError(str(exc)) from None
    profile = keyed_profile(profile, bool(digests.api))
    # The memory plan: hot_budget: auto -> bytes, each model's KV share and MLX limits.
    profile, plan = planned(profile)
    memory = models_memory(plan)
    # The model pool: the models loaded at start (the others load on their first request).
    at_start = loaded_at_start(profile, plan)
    handles: dict[str, Any] = {}
    for i, m in enumerate(profile.models):
        threads = m.cpu_threads or os.cpu_count() or 1
        if m.task != "generate":
            handles[m.name] = pooling_deployment(m, threads).bind(
                m, profile.model_home, m.name in at_start)
            continue
        options: dict[str, Any] = {}
        if m.max_replicas_per_node is not None:
            options["max_replicas_per_node"] = m.max_replicas_per_node
        if m.prefix_routing:
            # (Ray annotates this __init__'s **kwargs as dicts, each of them)
            options["request_router_config"] = RequestRouterConfig(
                request_router_class="serve_app.cluster.routing:PrefixAffinityRouter",  # type: ignore[arg-type]
                request_router_kwargs={"model": m.name,
                                       "load_cost_tokens": m.routing.load_cost_tokens,
                                       "routers": profile.ingress.num_replicas},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)  # type: ignore[arg-type]
        elif m.routing.mode == "ray_prefix":  # Ray's own, as a Ray user would pick it
            ray_router = "serve_app.cluster.ray_routers:RayPrefixCacheAffinityRouter"
            threshold = m.routing.ray_imbalanced_threshold
            options["request_router_config"] = RequestRouterConfig(
                request_router_class=ray_router,  # type: ignore[arg-type]
                request_router_kwargs={} if threshold is None else {
                    "imbalanced_threshold": threshold},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)  # type: ignore[arg-type]
        if m.parallel is not None:
            # One bundle per rank; the replica (rank 0) runs in the first, its ranks in the
            # others: on as many nodes (spread) or on one (pack).
            options["placement_group_bundles"] = [{"CPU": 0.01}] * m.parallel.size
            options["placement_group_strategy"] = (
                "STRICT_SPREAD" if m.parallel.placement == "spread" else "STRICT_PACK")
            check_nodes(m.name, i, m.parallel.size, m.parallel.placement)
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
                           "runtime_env": {"env_vars": serve_replica_env()},
                           **({"resources": {HEAD_NODE_RESOURCE: 0.001}}
                              if profile.ingress.on_head_node else {})},
        max_ongoing_requests=1000,
    )(Ingress)
    return ingress.bind(profile, handles, digests, plan)


def pooling_deployment(m: Any, threads: int) -> Any:
    """An embedding or rerank model's deployment (``deploy/pooling_replica.py``)."""
    return serve.deployment(
        name=deployment_name(m.name), num_replicas=m.num_replicas,
        ray_actor_options={"num_cpus": m.num_cpus, "resources": dict(m.resources),
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads),
                                                        **serve_replica_env()}}},
        # @serve.batch gathers what is in flight: room for several full batches; beyond
        # max_queued_requests waiting, Serve refuses (a 429 from the ingress)
        max_ongoing_requests=4 * m.pooling.max_batch_size,
        max_queued_requests=m.max_queued_requests, health_check_period_s=10,
        **({"max_replicas_per_node": m.max_replicas_per_node}
           if m.max_replicas_per_node is not None else {}),
    )(PoolingReplica)


def check_nodes(name: str, index: int, size: int, placement: str) -> None:
    """A model spread over ``size`` nodes on a cluster with fewer: a clear error now,
    not a placement group pending for ever."""
    import ray

    if placement != "spread" or not ray.is_initialized():
        return
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    if alive < size:
        raise ProfileError(
            f"models[{index}].parallel: model {name!r} needs {size} nodes (one rank each, "
            f"placement: spread) and the cluster has {alive}; add nodes, or use "
            "placement: pack to run every rank on one node")


def keyed_profile(profile: Profile, keys_on: bool) -> Profile:
    """The profile as deployed: without the key file's path (the builder read it; the
    ingress may run on a node without the file), and with API keys on, every model's
    cache isolated by key unless ``ingress.share_cache_between_keys``."""
    models = profile.models
    if keys_on and not profile.ingress.share_cache_between_keys:
        models = [m.model_copy(update={"cache": m.cache.model_copy(
            update={"isolate_by_api_key": True})}) for m in models]
    ingress = profile.ingress.model_copy(update={"api_keys_file": None,
                                                 "admin_keys_file": None})
    return profile.model_copy(update={"models": models, "ingress": ingress})


