"""How the HTTP API reaches models: the one typed interface its routes call.

``OpenAIIngress`` (``api/http.py``) parses, authenticates and answers; everything that
needs a model (its events, its readiness and phase, its stats, the memory plan, the
pool) goes through a ``ModelBackend``. The deployment's is ``deploy/ingress.RayModels``
(Ray Serve handles, the model pool, prefix routing); a request never goes back and forth
between the two through subclass hooks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from serve_app.cache.stats import Cleared
    from serve_app.config.profile import Profile
    from serve_app.metrics.table import Recorder
    from serve_app.models.phase import ModelPhase
    from serve_app.pooling.calls import PoolingAnswer, PoolingCall
    from serve_app.serving.events import Event, Failure
    from serve_app.serving.request import Caller, ChatCompletionRequest, OpenAIRequest
    from serve_app.serving.selfbench import SelfBenchmark


class ModelBackend(Protocol):
    """What the routes ask of the models they serve."""

    profile: Profile  # the validated profile: the models, the ingress's limits
    recorder: Recorder  # where the routes count requests

    async def stream_events(self, name: str, request: OpenAIRequest,
                            caller: Caller) -> AsyncIterator[list[Event]]:
        """The model's event batches for ``request`` (its replica's, as they come). The
        iterator may have ``async assigned()``: it returns once a replica took the request
        (the ingress sends a request again that none took in time)."""
        ...

    async def count_prompt_tokens(self, name: str, request: ChatCompletionRequest,
                                  caller: Caller) -> int:
        """Prompt tokens of ``request`` templated as it would be served (no generation)."""
        ...

    async def run_pooling(self, name: str, call: PoolingCall) -> PoolingAnswer | Failure:
        """An embedding or rerank model's answer to ``call`` (its replica's, batched with
        the requests arriving with it), or the ``Failure`` to send."""
        ...

    async def model_ready(self, name: str) -> bool:
        """Whether ``name`` has a replica that is loaded and warmed; must answer fast."""
        ...

    async def model_phase(self, name: str, probe: bool = True) -> ModelPhase:
        """What ``name``'s replicas are doing (``serve_app.models.phase``); fast. ``probe``
        False: no call to the model's replica (what is known of its readiness so far)."""
        ...

    def replica_lost(self, name: str, exc: Exception) -> bool:
        """Whether ``exc`` means the model's replica went away (then: 503, re-check)."""
        ...

    def model_status(self, name: str, ready: bool) -> str:
        """``/v1/models``' ``status``: ``loaded``, ``loading`` or ``unloaded`` (the pool's)."""
        ...

    def memory_bytes(self, name: str) -> int | None:
        """A model's planned footprint; None where there is no plan or it is unknown."""
        ...

    def pool_report(self) -> dict | None:
        """``/v1/stats``' ``pool``: the model pool's limits and models; None without one."""
        ...

    async def stats(self) -> dict:
        """``/v1/stats``: each model's totals over its replicas, the memory plan and what
        each node's replicas hold, the model pool."""
        ...

    async def metrics_text(self) -> str:
        """``/metrics``: every node's export of our families, merged."""
        ...

    # ---- the status page's controls (each raises ``ApiError``: 409 when refused) ----

    async def load_model(self, name: str) -> None:
        """Load ``name`` now (the model pool), as a request for it would."""
        ...

    async def unload_model(self, name: str) -> None:
        """Unload ``name`` now; refused while it is pinned or serving a request."""
        ...

    def pin_model(self, name: str, pinned: bool) -> None:
        """Pin ``name`` (never unloaded) or take its pin off."""
        ...

    async def clear_cache(self, name: str) -> Cleared:
        """Forget ``name``'s cached prefixes on every node: what went."""
        ...

    async def self_benchmark(self, name: str, ssd_bytes: int) -> SelfBenchmark:
        """Measure the SSD cache directory and ``name``'s prefill and decode speed."""
        ...
