"""Sections of a model's profile that belong to one capability each: thinking, images,
pooling, the K/V cache's format. (``profile.py`` holds the model and the whole file.)"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from serve_app.config.validation import Strict

Effort = Literal["minimal", "low", "medium", "high"]
DEFAULT_EFFORT_BUDGETS: dict[Effort, int] = {
    "minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


class ReasoningProfile(Strict):
    """A thinking model's thoughts (``serve_app/reasoning``): the budget a thought may
    spend before the server closes it with the model's own end-of-thinking tokens, per
    ``reasoning_effort`` and by default, and the field the chat API sends it in."""

    # Thought tokens when a request names no budget and no effort; None: no limit.
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    # ``reasoning_effort`` (chat) / ``reasoning.effort`` (Responses) as thought budgets.
    effort_budgets: dict[Effort, Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: dict(DEFAULT_EFFORT_BUDGETS))
    # The chat API's name for the thought: "reasoning_content" (DeepSeek, vLLM),
    # "reasoning" (mlx_lm.server, OpenRouter) or both.
    response_field: Literal["reasoning_content", "reasoning", "both"] = "reasoning_content"
    # After each turn, prefill the next turn's prefix ahead (the history as the template
    # renders it next time, without this turn's thought): the next turn restores all of
    # its history. Off: it restores up to this turn's answer start (serve_app/reasoning).
    prefill_next_turn: bool = True


class VisionProfile(Strict):
    """A vision-language model's images (``serve_app/multimodal``): per-request limits and
    the vision tower's output cache (by image, bounded)."""

    enabled: bool = True  # off: the model serves text only (images get a 400)
    max_image_bytes: Annotated[int, Field(ge=1)] = 20 * 1024 * 1024
    max_image_pixels: Annotated[int, Field(ge=1)] = 16_000_000
    max_images: Annotated[int, Field(ge=1, le=256)] = 16
    feature_cache_mb: Annotated[int, Field(ge=0)] = 256
    # http(s) image addresses, fetched only when on (within the timeout and max_image_bytes;
    # from fetch_hosts alone where it names some, else public addresses). Never a path.
    fetch_urls: bool = False
    fetch_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    fetch_hosts: list[str] = []


class PoolingProfile(Strict):
    """An embedding or rerank model's batching and inputs (``serve_app/pooling``)."""

    # Requests one model call takes together (Ray Serve's @serve.batch), how long the first
    # waits for others; a call runs inputs sorted by length, max_batch_tokens at a time.
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 32
    batch_wait_timeout_s: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005
    max_batch_tokens: Annotated[int, Field(ge=16)] = 8192
    max_inputs: Annotated[int, Field(ge=1)] = 2048  # inputs (or documents) in one request
    truncate: bool = False  # inputs over the model's limit: cut (true) or a 400 (false)
    matryoshka: bool = False  # the model was trained to be cut: `dimensions` is allowed
    instruction: str | None = None  # a decoder reranker's <Instruct> (Qwen3-Reranker's)


class KVCacheProfile(Strict):
    """The format of the attention layers' K/V (``serve_app/kvquant``): float as the
    model computes it (``bits: null``, the default), or quantized to 8 or 4 bits in groups
    of ``group_size`` values, in the running batch and on every tier of the prefix cache.
    A recurrent layer's state is never quantized."""

    bits: Literal[4, 8] | None = None
    group_size: Literal[32, 64, 128] = 64
    # mlx-lm's quantized_kv_start: quantize a sequence once it holds this many tokens.
    # Continuous batching holds every sequence in one cache of one format, and a
    # sequence switched mid-way would restore from its blocks other tokens than its cold
    # prefill gives, so only 0 (quantized from the first token) is served.
    quantized_after: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _from_the_start(self) -> KVCacheProfile:
        if self.quantized_after != 0:
            raise ValueError(
                f"quantized_after {self.quantized_after}: only 0 is served (continuous "
                "batching keeps every sequence in one cache of one format; switching one "
                "mid-way would make a restored turn differ from its cold prefill)")
        return self
