"""A request as the engine thread holds it, and the one way events reach its caller."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from serve_app.cache.request_plan import RequestPlan
from serve_app.multimodal.prompt import VisionPrompt
from serve_app.serving.engine_events import EngineEvent, EventSink
from serve_app.serving.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    """A request as the engine holds it: what it asked, where it is, what it produced."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    sink: EventSink
    cache: RequestPlan | None = None
    uid: int | None = None
    generated: int = 0
    output: list[int] = field(default_factory=list)
    restored: int = 0  # tokens the request really started from
    kv_bytes: int = 0  # KV reserved while in the batch (admission), released at its end
    # A sharded model: the key of the cache plans the other ranks made for this request.
    plan_key: str | None = None
    vision: VisionPrompt | None = None  # its images, where it has some


def deliver(req: EngineRequest, event: EngineEvent) -> None:
    """Hand an event to its request; a broken receiver must not take the engine down."""
    try:
        req.sink(event)
    except Exception:
        logger.exception("delivering an event for request %d failed", req.rid)
