"""Requests to prompt tokens: the chat template, context checks, sampling defaults.

``Preparer`` needs only the tokenizer and the model's profile, so the replica
(``ModelService``) and the ingress share it: where replicas are routed by their
cached prefixes, the ingress prepares each request itself (the router needs its
tokens), and the replica takes the ``PreparedRequest`` as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from serve_app.cache.manager import find_branch_points
from serve_app.engine import SamplingParams
from serve_app.openai_api import (
    ApiError,
    Caller,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_size,
)
from serve_app.profile import ModelProfile


@dataclass
class PreparedRequest:
    """What the engine needs for one request, after validation."""

    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    salt: str | None = None
    api_key_digest: str | None = None  # set only when the profile isolates by API key
    # Where the conversation may branch: the end of the system prompt, the start of
    # the last message (prompt positions; a tail of the cache is captured there).
    branch_points: tuple[int, ...] = ()
    prepare_seconds: float = 0.0  # templating and tokenizing, for the phase metrics


class Preparer:
    """Validation and templating for one model's requests (no engine, no Ray)."""

    def __init__(self, profile: ModelProfile, tokenizer, branch_points: bool = True) -> None:
        self.profile = profile
        self.tokenizer = tokenizer
        self.find_branches = branch_points  # only worth it where a prefix cache keeps tails

    def prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            try:
                tokens = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True
                )
            except Exception as exc:  # templates raise on bad role orders etc.
                raise ApiError(400, f"chat template failed: {exc}", param="messages") from None
            return list(tokens)
        prompt = request.prompt
        if isinstance(prompt, list):
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < max(vocab, len(self.tokenizer))]
        if bad:
            raise ApiError(400, f"prompt has token ids outside the vocabulary: {bad[:5]}",
                           param="prompt")
        return list(prompt)

    def prepare(self, request: ChatCompletionRequest | CompletionRequest,
                caller: Caller | None = None) -> PreparedRequest:
        """Prompt tokens and sampling for a request the ingress validated.

        Runs on a worker thread: templating and tokenizing a long prompt must not
        stall an event loop. ``caller`` comes from the ingress's view of the
        headers, never from the body.
        """
        tic = time.perf_counter()
        check_prompt_size(request, self.profile.prompt_char_limit(), self.profile.context_length)
        prompt = self.prompt_tokens(request)
        if not prompt:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        limit = self.profile.context_length
        if len(prompt) >= limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt "
                f"has {len(prompt)} tokens (at least one token must remain to generate)",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        wanted = request.requested_max_tokens() or self.profile.max_tokens
        max_tokens = min(wanted, self.profile.max_tokens, limit - len(prompt))
        defaults = self.profile.sampling
        temperature = request.temperature
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if request.top_p is None else request.top_p,
            seed=request.seed,
        )
        isolate = self.profile.cache.isolate_by_api_key and caller is not None
        return PreparedRequest(prompt=prompt, params=params, stops=request.stop_list(),
                               salt=request.cache_salt,
                               api_key_digest=caller.api_key_digest if isolate else None,
                               branch_points=self.branch_points(request, prompt),
                               prepare_seconds=time.perf_counter() - tic)

    def branch_points(self, request: ChatCompletionRequest | CompletionRequest,
                      prompt: list[int]) -> tuple[int, ...]:
        """Prompt positions where another conversation is likely to branch off this one
        (see ``find_branch_points``). Only chat requests have them."""
        if not self.find_branches or not isinstance(request, ChatCompletionRequest):
            return ()
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]

        def render(conversation: list[dict[str, str]]) -> list[int]:
            return self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=False, tokenize=True)

        return find_branch_points(messages, prompt, render)
