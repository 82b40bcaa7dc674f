"""``routing.mode: ray_prefix``: Ray's ``PrefixCacheAffinityRouter`` reads our requests.

Ray's router takes a request's text from its first argument's ``messages`` (dicts) or
``prompt``; ours are typed (pydantic) and would read as empty text. The subclass hands it
dicts and changes nothing else (the compat seam ``prefix_cache_affinity_router`` is the
class Ray ships)."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.cluster.ray_routers import RayPrefixCacheAffinityRouter
from serve_app.models.compat import prefix_cache_affinity_router
from serve_app.serving.request import ChatCompletionRequest, CompletionRequest


def pending(*args) -> SimpleNamespace:
    return SimpleNamespace(args=args, kwargs={})


def router() -> RayPrefixCacheAffinityRouter:
    return RayPrefixCacheAffinityRouter.__new__(RayPrefixCacheAffinityRouter)


def test_the_seam_is_rays_own_router_and_ours_only_reads_text():
    base = prefix_cache_affinity_router()
    assert base.__name__ == "PrefixCacheAffinityRouter"
    assert RayPrefixCacheAffinityRouter.__mro__[1] is base
    ours = {k for k, v in vars(RayPrefixCacheAffinityRouter).items() if callable(v)}
    assert ours == {"_extract_text_from_request"}


def test_chat_messages_are_read_as_ray_reads_dicts():
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "You are terse. "},
        {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                     {"type": "text", "text": "there"}]}]})
    text = router()._extract_text_from_request(pending(chat, None))
    assert text == "You are terse. Hello there"
    # Ray's own reading of the same typed messages finds no text at all.
    base = prefix_cache_affinity_router()
    assert base._extract_text_from_request(router(), pending(chat, None)) == ""


def test_a_completion_prompt_is_read_too():
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "Once upon"})
    assert router()._extract_text_from_request(pending(completion, None)) == "Once upon"
