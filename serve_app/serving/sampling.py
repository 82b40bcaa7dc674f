"""Per-request sampling settings as plain data: no MLX, so the ingress can build them.

The engine (``serve_app.serving.engine``) applies them on its thread; ``serve_app.serving.prepare``
builds them from a request's fields wherever it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

    LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
else:
    LogitsProcessor = Callable[[Any, Any], Any]

MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs may carry (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy decoding.

    ``logprobs``: None for none; ``k`` (0..20) makes every token's event carry its own
    log-probability and the ``k`` most likely alternatives (OpenAI's ``top_logprobs``).
    They are of the distribution the token was sampled from after the logits processors
    (a grammar renormalizes over what it allows), before temperature and top-p, as
    OpenAI and vLLM report them.

    ``logits_processors``: mlx-lm processors, ``(tokens, logits) -> logits``, run on this
    request's row only, so constrained and free requests share one batch. ``tokens`` is
    everything the model has seen (the whole prompt, restored part included, then each
    generated token), restored from the prefix cache or not. Processors are usually
    stateful (``structured.Grammar.processor()``): give every request fresh ones.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    logits_processors: tuple[LogitsProcessor, ...] = ()
    # The output position of the first token drawn: a resumed request's tokens already
    # generated (its seeded sampler draws the next with that position's key).
    first_index: int = 0

    def __post_init__(self) -> None:
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed < 2**64):
            # the API refuses these with a 400; a bad one built inside would fail the whole
            # batch step that draws with it (its key takes 64 bits)
            raise ValueError("seed must be None or an integer in 0..2**64-1")
        # A list would make the frozen dataclass unhashable: keep a tuple.
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
