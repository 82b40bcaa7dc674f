"""Ray Serve's own LLM prefix router on our deployments (``routing.mode: ray_prefix``),
for a user who prefers it and for ``bench.routers`` to measure ours against it.

``PrefixCacheAffinityRouter`` (``ray.serve.llm``) keeps a character-level prefix tree of
each request's text in a shared actor; it reads the text from its first argument's
``messages`` (dicts with a ``content``) or ``prompt``. Our requests' messages are typed
(pydantic): read as is they would all be empty text, so this subclass hands the router
the dicts it expects, and changes nothing else of Ray's policy or its defaults.
"""

from __future__ import annotations

from typing import Any

from serve_app.models.compat import prefix_cache_affinity_router

_RayPrefixRouter: Any = prefix_cache_affinity_router()


class RayPrefixCacheAffinityRouter(_RayPrefixRouter):
    """Ray's ``PrefixCacheAffinityRouter``, reading our requests' text."""

    def _extract_text_from_request(self, pending_request: Any) -> str:
        for arg in pending_request.args:
            messages = getattr(arg, "messages", None)
            if messages is not None:
                return self._normalize_prompt_to_string(
                    [m.model_dump() if hasattr(m, "model_dump") else m for m in messages])
            prompt = getattr(arg, "prompt", None)
            if prompt is not None:
                return self._normalize_prompt_to_string(prompt)
        return super()._extract_text_from_request(pending_request)
